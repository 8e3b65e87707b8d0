"""An HTTP sink on 127.0.0.1 that counts what it receives; the SMTP sink is agent.harness.MailSink."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.harness import MailSink, free_port

__all__ = ["HttpSink", "MailSink", "free_port"]


class HttpSink:
    """ThreadingHTTPServer that records each request; paths under /slow answer after `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.delay = delay
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with sink._lock:
                    sink.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": body,
                        }
                    )
                    n = len(sink.requests)
                if self.path.startswith("/slow"):
                    sink.stop.wait(sink.delay)
                payload = json.dumps({"ok": True, "n": n}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client gave up (the timeout test); nothing to answer

            do_GET = do_POST = do_PUT = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
