"""The daemon's end of the executor socket: one persistent connection per session."""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxd.errors import SandboxUnavailable

MAX_REPLY = 64 * 1024 * 1024


class ExecutorChannel:
    """Length-prefixed JSON requests to the executor listening on a unix socket."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the executor answers a ping, or raise SandboxUnavailable."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.request({"op": "ping"}, timeout=1.0)
                return
            except SandboxUnavailable as exc:
                last = exc
                time.sleep(0.02)
        raise SandboxUnavailable(f"executor did not come up within {timeout:g}s: {last}")

    def request(self, payload: dict[str, Any], timeout: float,
                on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """Send one request and wait up to `timeout` seconds for its reply; a streamed call's chunks, which
        come ahead of it, go to `on_output(stream, text)`."""
        with self._lock:
            try:
                sock = self._connect()
                sock.settimeout(timeout)
                data = json.dumps(payload).encode()
                sock.sendall(struct.pack(">I", len(data)) + data)
                deadline = time.monotonic() + timeout
                while isinstance(partial := (reply := self._read_reply(sock)).get("partial"), dict):
                    if on_output is not None:
                        on_output(str(partial.get("stream")), str(partial.get("text", "")))
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                return reply
            except (OSError, ValueError) as exc:
                self._close()
                raise SandboxUnavailable(f"executor channel failed: {exc}", socket=str(self.socket_path)) from exc

    def alive(self, wait: bool = True) -> bool:
        """Whether the connection is open and the executor has not closed its end (it exited, or its
        container stopped): one poll, no round trip. Without `wait`, False while a request holds it."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if self._sock is None:
                return False
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLRDHUP)
            return not poller.poll(0)  # between requests nothing is due: any event is an end or garbage
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            sock.connect(str(self.socket_path))
            self._sock = sock
        return self._sock

    def _read_reply(self, sock: socket.socket) -> dict[str, Any]:
        (size,) = struct.unpack(">I", _recv_exact(sock, 4))
        if size > MAX_REPLY:
            raise ValueError(f"executor reply of {size} bytes is too large")
        reply = json.loads(_recv_exact(sock, size))
        if not isinstance(reply, dict):
            raise ValueError("executor reply is not an object")
        return reply

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("executor closed the connection")
        buf.extend(chunk)
    return bytes(buf)
