"""How the launchers of a per-node job (``mirrored-run --nnodes N --node-rank I``) learn each other's hosts.

Every node runs its own launcher (one ``srun`` task per node, one pod per
node), as with torchrun. Gloo listens at each task's ``TF_CONFIG`` host, so
every task needs the real host of every node, which no node knows alone.
Node 0's launcher listens at ``--master-port`` until the N-1 others have
sent one JSON line each (their node rank, ``--nnodes``, number of tasks and
job token); it then answers each with the whole layout: every node's host
(node 0 is ``--master-addr``, the others the address they connected from),
every node's number of tasks, and the job token. The port is free again
before any task starts.

With ``MIRRORED_JOB_TOKEN`` set (the same on every node), node 0 admits only
launchers that present it; without it node 0 makes a fresh token and hands
it out, so the first N-1 launchers to join make the job.
"""

from __future__ import annotations

import hmac
import json
import secrets
import selectors
import socket
import time
from dataclasses import dataclass

__all__ = ["NodeLayout", "rendezvous"]

# A joining launcher's one line is small; more is not a launcher.
MAX_MESSAGE_BYTES = 4096
# How long node 0 waits for one connection's line before dropping it (a stranger cannot hold the door).
LINE_SECONDS = 10.0
# Connections node 0 reads at once; more wait in the listen backlog.
MAX_PENDING = 256
_RETRY_SECONDS = 0.2


@dataclass
class NodeLayout:
    hosts: list[str]  # by node rank
    tasks: list[int]  # tasks per node, by node rank
    token: str


class RendezvousError(RuntimeError):
    """The nodes of a per-node job could not agree; the message names the flag to fix."""


def _read_line(sock: socket.socket, deadline: float) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete line in time")
        sock.settimeout(left)
        chunk = sock.recv(MAX_MESSAGE_BYTES)
        if not chunk:
            raise ConnectionError("closed before a complete line")
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError("line too long")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # that launcher is gone; it reports its own failure


def _serve(nnodes: int, master_addr: str, master_port: int, tasks: int, token: str | None,
           timeout: float) -> NodeLayout:
    """Node 0: admits the other launchers, reading every connection at once (a silent stranger delays nobody)."""
    layout_token = token or secrets.token_hex(16)
    joined: dict[int, tuple[socket.socket, str, int]] = {}
    pending: dict[socket.socket, list] = {}  # connection -> [bytes so far, deadline, peer address]
    deadline = time.monotonic() + timeout
    try:
        server = socket.create_server(("", master_port))
    except OSError as e:
        raise RendezvousError(f"--master-port {master_port}: node 0 cannot listen there ({e.strerror or e}); "
                              "pick a free port") from None
    server.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)

    def drop(conn):
        selector.unregister(conn)
        del pending[conn]
        conn.close()

    try:
        while len(joined) < nnodes - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = [r for r in range(1, nnodes) if r not in joined]
                raise RendezvousError(f"--start-timeout {timeout:g}: node(s) {missing} did not join node 0 at "
                                      f"{master_addr}:{master_port}; start a launcher on every node with the same "
                                      "--nnodes, --master-addr and --master-port, or raise --start-timeout")
            for conn in [c for c, (_, until, _) in pending.items() if until <= now]:
                drop(conn)  # no complete line in time: not a launcher
            wake = min([deadline] + [until for _, until, _ in pending.values()]) - now
            for key, _ in selector.select(max(0.0, wake)):
                if key.fileobj is server:
                    try:
                        conn, address = server.accept()
                    except OSError:
                        continue
                    if len(pending) >= MAX_PENDING:
                        conn.close()
                        continue
                    conn.setblocking(False)
                    pending[conn] = [b"", time.monotonic() + LINE_SECONDS, address[0]]
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    chunk = conn.recv(MAX_MESSAGE_BYTES)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                data = pending[conn][0] + chunk
                if not chunk or len(data) > MAX_MESSAGE_BYTES:
                    drop(conn)
                    continue
                pending[conn][0] = data
                if not data.endswith(b"\n"):
                    continue
                peer = pending[conn][2]
                selector.unregister(conn)
                del pending[conn]
                conn.settimeout(LINE_SECONDS)
                try:
                    message = json.loads(data)
                except ValueError:
                    message = None
                if not isinstance(message, dict):
                    conn.close()
                    continue
                refusal = _refusal(message, nnodes, token, joined)
                if refusal:
                    _send(conn, {"error": refusal})
                    conn.close()
                    continue
                joined[message["node_rank"]] = (conn, peer, message["tasks"])
        hosts = [master_addr] + [joined[r][1] for r in range(1, nnodes)]
        counts = [tasks] + [joined[r][2] for r in range(1, nnodes)]
        for conn, _, _ in joined.values():
            _send(conn, {"hosts": hosts, "tasks": counts, "token": layout_token})
        return NodeLayout(hosts, counts, layout_token)
    finally:
        for conn in list(pending):
            drop(conn)
        for conn, _, _ in joined.values():
            conn.close()
        selector.close()
        server.close()


def _refusal(message: dict, nnodes: int, token: str | None, joined: dict) -> str | None:
    """Why node 0 turns a joining launcher away (None: it is admitted)."""
    rank, their_nnodes, tasks = message.get("node_rank"), message.get("nnodes"), message.get("tasks")
    if token is not None and not hmac.compare_digest(str(message.get("token")).encode(), token.encode()):
        return "MIRRORED_JOB_TOKEN differs from node 0's; set the same token on every node"
    if their_nnodes != nnodes:
        return f"--nnodes {their_nnodes} differs from node 0's --nnodes {nnodes}; give every node the same"
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < nnodes:
        return f"--node-rank {rank!r} is not one of 1..{nnodes - 1}"
    if rank in joined:
        return f"--node-rank {rank}: another launcher joined as node {rank} already; give each node its own rank"
    if not isinstance(tasks, int) or isinstance(tasks, bool) or tasks < 1:
        return f"-np {tasks!r}: a node needs at least 1 task"
    return None


def _join(nnodes: int, node_rank: int, master_addr: str, master_port: int, tasks: int, token: str | None,
          timeout: float) -> NodeLayout:
    deadline = time.monotonic() + timeout
    hello = {"node_rank": node_rank, "nnodes": nnodes, "tasks": tasks, "token": token}
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((master_addr, master_port), timeout=max(0.1, deadline - time.monotonic())) \
                    as sock:
                _send(sock, hello)
                reply = _read_line(sock, deadline)
        except (OSError, ValueError) as e:  # node 0 not listening yet, or it went away: try again
            last_error = str(e) or type(e).__name__
            time.sleep(_RETRY_SECONDS)
            continue
        if "error" in reply:
            raise RendezvousError(f"node 0 at {master_addr}:{master_port} refused node {node_rank}: {reply['error']}")
        return NodeLayout(list(reply["hosts"]), [int(n) for n in reply["tasks"]], str(reply["token"]))
    raise RendezvousError(f"--start-timeout {timeout:g}: node {node_rank} could not join node 0 at --master-addr "
                          f"{master_addr} --master-port {master_port} ({last_error}); check that node 0's launcher "
                          "runs there, or raise --start-timeout")


def rendezvous(nnodes: int, node_rank: int, master_addr: str, master_port: int, tasks: int, token: str | None,
               timeout: float) -> NodeLayout:
    """Every node's host and number of tasks, and the job token, agreed by all N launchers."""
    if nnodes == 1:
        return NodeLayout([master_addr], [tasks], token or secrets.token_hex(16))
    if node_rank == 0:
        return _serve(nnodes, master_addr, master_port, tasks, token, timeout)
    return _join(nnodes, node_rank, master_addr, master_port, tasks, token, timeout)
