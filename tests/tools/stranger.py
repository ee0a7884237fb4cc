"""A stranger on the machine: connects to every new 127.0.0.1 listener, first.

It polls /proc/net/tcp and /proc/net/tcp6 for sockets in LISTEN state on a
loopback or wildcard address that were not there when it started, connects to
each the moment it appears (a job's store, its Gloo mesh listeners, anything
else), and sends what it was told to: Gloo-like sequence numbers, garbage, or
nothing. Connections stay open a few seconds, so a listener that takes the
first comer is stuck with the stranger. Bounded: it stops after --seconds.

    python tests/tools/stranger.py --seconds 600 &   # then run `make test`

Tests use :class:`Stranger`, which starts it as a separate process (as another
user when asked) and reports how many listeners it reached.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import subprocess
import sys
import time

LISTEN = "0A"
LOOPBACK_OR_ANY = {"0100007F", "00000000",  # 127.0.0.1, 0.0.0.0 as /proc/net/tcp writes them
                   "00000000000000000000000001000000", "00000000000000000000000000000000"}  # ::1, ::


def listeners() -> set[int]:
    """Ports with a LISTEN socket on a loopback or wildcard address."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    address, port = fields[1].split(":")
                    if fields[3] == LISTEN and address in LOOPBACK_OR_ANY:
                        ports.add(int(port, 16))
        except OSError:
            continue
    return ports


def payload(mode: str) -> bytes:
    if mode == "sequence":  # what Gloo's listener reads first: a sequence number, then more
        return b"".join(struct.pack("<q", i) for i in range(4)) + os.urandom(32)
    if mode == "garbage":
        return os.urandom(256)
    return b""


def run(seconds: float, mode: str, hold: float, report) -> int:
    known = listeners()
    held: list[tuple[float, socket.socket]] = []
    reached = 0
    print("ready", file=report, flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        for port in sorted(listeners() - known):
            known.add(port)
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                s.setblocking(False)
                data = payload(mode)
                if data:
                    try:
                        s.send(data)
                    except OSError:
                        pass
                held.append((now, s))
                reached += 1
                print(f"reached {port}", file=report, flush=True)
            except OSError:
                continue
        while held and now - held[0][0] > hold:
            held.pop(0)[1].close()
        time.sleep(0.0005)
    for _, s in held:
        s.close()
    print(f"done {reached}", file=report, flush=True)
    return 0


class Stranger:
    """``with Stranger(mode) as s: ...`` runs the stranger in another process (as ``user`` if given);
    ``s.reached()`` lists the ports it connected to so far."""

    def __init__(self, mode: str = "sequence", seconds: float = 300, user: str | None = None):
        # Another user cannot run this session's Python (it may live in a private home): the system's.
        python = sys.executable if user is None else shutil.which("python3", path="/usr/bin:/bin")
        self.cmd = [python, os.path.abspath(__file__), "--seconds", str(seconds), "--mode", mode]
        self.user = user
        self.proc = None
        self.lines: list[str] = []

    def __enter__(self) -> "Stranger":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True, user=self.user,
                                     cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        first = self.proc.stdout.readline()  # blocks until it has taken stock of the existing listeners
        if first.strip() != "ready":
            raise RuntimeError(f"the stranger did not start: {first!r}")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        self.lines += out.splitlines()

    def reached(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("reached ")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600, help="stop after this long (default 600)")
    parser.add_argument("--mode", choices=["sequence", "garbage", "silent"], default="sequence",
                        help="what to send once connected (default: Gloo-like sequence numbers)")
    parser.add_argument("--hold", type=float, default=5, help="seconds to keep each connection open (default 5)")
    args = parser.parse_args()
    sys.exit(run(args.seconds, args.mode, args.hold, sys.stdout))
