"""Round-trip time of md.distribute.experimental.rpc against a bare socket echo, in one run.

    python bench/rpc_round_trip.py                 # 4 B and 1 MiB, in-process and across processes
    python bench/rpc_round_trip.py --iters 2000 --sizes 4 65536 1048576

A round trip sends one float32 array of the size and gets it back:

* socket echo: a length-prefixed message over a loopback TCP connection (TCP_NODELAY) to a thread that reads it
  whole and writes it back: the floor any RPC over TCP pays;
* rpc blocking: ``client.echo_blocking(x)`` on a server whose ``echo`` returns its argument (the request's
  frame and pickle, the server's dispatch, the client's thread pool and StatusOrResult);
* rpc async x8: eight ``client.echo(x)`` issued together, then each ``get_value()``: time per call.

"in-process": server and client are threads of this process (sharing its GIL); "cross-process": the servers
run in a second process (``--serve``). Medians of ``--iters`` round trips after a warm-up, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

import mirrored as md
from mirrored.distribute.parameter_server.rpc import read_exactly

_LENGTH = struct.Struct("<Q")


def _echo(client: socket.socket) -> None:
    with client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                (n,) = _LENGTH.unpack(read_exactly(client, _LENGTH.size))
                payload = read_exactly(client, n)
                client.sendall(_LENGTH.pack(n))
                client.sendall(payload)
        except ConnectionError:
            return


def start_servers():
    """An echo socket server and an rpc server with ``echo``; returns (echo port, rpc port, stop)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    server = md.distribute.experimental.rpc.Server.create("grpc", "127.0.0.1:0")
    server.register("echo", lambda x: x)
    server.start()

    def stop():
        listener.close()
        server.stop()
    return listener.getsockname()[1], server.port, stop


def median_us(fn, iters: int) -> float:
    for _ in range(max(iters // 10, 5)):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(echo_port: int, rpc_port: int, size: int, iters: int) -> dict:
    x = np.arange(size // 4, dtype=np.float32)
    sock = socket.create_connection(("127.0.0.1", echo_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def socket_echo():
        sock.sendall(_LENGTH.pack(x.nbytes))
        sock.sendall(memoryview(x).cast("B"))
        (n,) = _LENGTH.unpack(read_exactly(sock, _LENGTH.size))
        return np.frombuffer(read_exactly(sock, n), np.float32)

    client = md.distribute.experimental.rpc.Client.create("grpc", f"127.0.0.1:{rpc_port}")

    def rpc_async():
        for pending in [client.echo(x) for _ in range(8)]:
            pending.get_value()

    assert np.array_equal(socket_echo(), x) and np.array_equal(client.echo_blocking(x), x)
    out = {"socket echo": median_us(socket_echo, iters),
           "rpc blocking": median_us(lambda: client.echo_blocking(x), iters),
           "rpc async x8": median_us(rpc_async, max(iters // 8, 10)) / 8}
    sock.close()
    client.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 1 << 20], help="payload bytes")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # the cross-process servers: ports on stdout, serve until stdin closes
        echo_port, rpc_port, stop = start_servers()
        print(echo_port, rpc_port, flush=True)
        sys.stdin.read()
        stop()
        return
    rows = []
    echo_port, rpc_port, stop = start_servers()
    for size in args.sizes:
        rows.append(("in-process", size, measure(echo_port, rpc_port, size, args.iters)))
    stop()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env) as process:
        echo_port, rpc_port = map(int, process.stdout.readline().split())
        for size in args.sizes:
            rows.append(("cross-process", size, measure(echo_port, rpc_port, size, args.iters)))
        process.stdin.close()
        process.wait()
    print(f"{'where':<14} {'bytes':>8} {'socket echo us':>15} {'rpc blocking us':>16} {'x socket':>9} "
          f"{'rpc async x8 us/call':>21} {'x socket':>9}")
    for where, size, r in rows:
        print(f"{where:<14} {size:>8} {r['socket echo']:15.1f} {r['rpc blocking']:16.1f} "
              f"{r['rpc blocking'] / r['socket echo']:9.2f} {r['rpc async x8']:21.1f} "
              f"{r['rpc async x8'] / r['socket echo']:9.2f}")


if __name__ == "__main__":
    main()
