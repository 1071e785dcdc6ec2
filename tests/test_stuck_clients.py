"""SIGTERM while a stream's client has stopped reading (its socket buffers full) or has left.

uvicorn's graceful timeout used to cancel such a stream's task, and uvicorn logged an
"Exception in ASGI application" traceback for each. serve_ep now closes those connections
itself after the drain timeout and its grace, one line each, and exits 0; a client that reads
still gets its stream's end. Linux only: the server's send queue is read from /proc/net/tcp.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import ServeEp

DRAIN_TIMEOUT_S = 2
HANG_GUARD_S = 60  # far past the drain timeout and its grace: only a hang reaches it
# Wide chunks (24 samples, 20 top logprobs each): megabytes a second, past any socket buffer;
# two such streams and a narrow one fit the scheduler's 64 sequences, all running at once.
WIDE = {
    "prompt": [1, 2, 3],
    "max_tokens": 1000,
    "ignore_eos": True,
    "n": 24,
    "logprobs": 20,
    "stream": True,
}
PROC_NET_TCP = Path("/proc/net/tcp")


@pytest.mark.slow
@pytest.mark.skipif(not PROC_NET_TCP.exists(), reason="reads the send queue from /proc/net/tcp")
def test_sigterm_with_a_client_not_reading_ends_every_stream_without_a_traceback():
    server = ServeEp("--drain-timeout-s", str(DRAIN_TIMEOUT_S))
    try:
        host, port = server.ready_url().rsplit("/", 1)[1].split(":")
        address = (host, int(port))
        stuck, gone = _open_stream(address, WIDE), _open_stream(address, WIDE)
        reader = _Reader(address)
        for client in (stuck, gone):
            _wait_until_the_server_cannot_send(int(port), client.getsockname()[1])
        gone.close()  # unread bytes in its buffer: a reset
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=HANG_GUARD_S) == 0
        stdout, stderr = "".join(server.rest("stdout")), "".join(server.rest("stderr"))
        assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr
        stuck_port = stuck.getsockname()[1]
        closed = [line for line in stdout.splitlines() if "closed the connection" in line]
        assert [line for line in closed if f":{stuck_port}," in line], stdout
        assert _read_to_the_end(stuck), "the stuck client's connection was never closed"
        assert reader.last_line(HANG_GUARD_S) == "data: [DONE]"
    finally:
        server.kill()


def _open_stream(address: tuple[str, int], body: dict) -> socket.socket:
    """A streamed completion on a socket with a tiny receive buffer, read up to its first
    bytes and then never again."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    sock.settimeout(HANG_GUARD_S)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def _send_queue(server_port: int, client_port: int) -> int | None:
    """Bytes queued in the kernel on the server's side of this connection (None: no such
    socket). /proc/net/tcp: local and remote address as hex ip:port, then tx_queue:rx_queue."""
    for line in PROC_NET_TCP.read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
        if (local, remote) == (server_port, client_port):
            return int(fields[4].split(":")[0], 16)
    return None


def _wait_until_the_server_cannot_send(server_port: int, client_port: int) -> None:
    """Until the server's send queue to the client holds bytes and has stopped growing (the
    client's window is shut): what follows waits in the server's own buffer."""
    deadline = time.monotonic() + HANG_GUARD_S
    seen: list[int | None] = []
    while len(seen) < 5 or len(set(seen[-5:])) != 1 or not seen[-1]:
        assert time.monotonic() < deadline, f"the send queue never filled: {seen[-5:]}"
        seen.append(_send_queue(server_port, client_port))
        time.sleep(0.2)


def _read_to_the_end(sock: socket.socket) -> bool:
    """Read until the server closes the connection: True at its end (EOF or a reset)."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


class _Reader:
    """A client that reads its (narrow) stream as it comes, on a thread."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._lines: list[str] = []
        body = {"prompt": [4, 5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        url = f"http://{address[0]}:{address[1]}"
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            self._lines.extend(line for line in response.iter_lines() if line)

    def last_line(self, timeout_s: float) -> str | None:
        self._thread.join(timeout_s)
        return self._lines[-1] if self._lines else None
