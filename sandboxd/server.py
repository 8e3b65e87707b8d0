"""The daemon loop: receive -> decode -> handler for that type -> reply, over a ZeroMQ ROUTER.

The socket thread owns the ROUTER (ZeroMQ sockets are not thread-safe). Cheap requests are answered
inline; the rest go to a worker pool, whose threads hand their replies back through an inproc
PUSH/PULL pair that the socket thread polls alongside the ROUTER.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

from sandboxd import protocol as p
from sandboxd.config import DaemonConfig
from sandboxd.errors import ErrorCode, ProtocolError
from sandboxd.service import SandboxService, error_response

log = logging.getLogger("sandboxd")

_REPLIES = "inproc://sandboxd-replies"


class Server:
    """Serves one `SandboxService` on the configured endpoint until `stop()`."""

    def __init__(self, config: DaemonConfig, service: SandboxService) -> None:
        self.config = config
        self.service = service
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="sandboxd-worker")

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        """Bind, then answer requests until stopped."""
        router = self.ctx.socket(zmq.ROUTER)
        # A hard ceiling well above the configured limit: frames between the two get a
        # frame_too_large reply, anything larger is dropped by ZeroMQ before it costs memory.
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes * 4 + 4096)
        router.setsockopt(zmq.LINGER, 0)
        self._bind(router)
        replies = self.ctx.socket(zmq.PULL)
        replies.bind(_REPLIES)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        log.info("sandboxd serving on %s", self.config.endpoint)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if replies in events:
                    while replies.poll(0):
                        router.send_multipart(replies.recv_multipart())
                if router in events:
                    while router.poll(0):
                        self._receive(router, router.recv_multipart())
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            while replies.poll(0):
                router.send_multipart(replies.recv_multipart())
            router.close()
            replies.close()
            self.ctx.term()

    def _bind(self, router: zmq.Socket[bytes]) -> None:
        endpoint = self.config.endpoint
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            old = os.umask(0o077)  # the socket is born owner-only; no window where others may connect
            try:
                router.bind(endpoint)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
        else:
            router.bind(endpoint)

    def _receive(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        envelope, payload = frames[:-1], frames[-1]
        if len(envelope) > 2 or (len(envelope) == 2 and envelope[1] != b""):
            bad = ProtocolError(ErrorCode.BAD_FRAME, "a request is exactly one message frame")
            router.send_multipart([envelope[0], p.encode(error_response(p.request_id_of(payload), bad))])
            return
        try:
            request = p.decode_request(payload, self.config.max_frame_bytes)
        except ProtocolError as exc:
            log.info("rejected frame: %s", exc)
            router.send_multipart([*envelope, p.encode(error_response(p.request_id_of(payload), exc))])
            return
        if isinstance(request, SandboxService.INLINE):
            router.send_multipart([*envelope, p.encode(self.service.handle(request))])
        else:
            self._pool.submit(self._work, envelope, request)

    def _work(self, envelope: list[bytes], request: p.Request) -> None:
        try:
            reply = self.service.handle(request)
        except AssertionError:
            # A broken invariant: stop loudly rather than keep serving from a state we do not trust.
            log.critical("invariant broken; exiting", exc_info=True)
            os._exit(70)
        # A socket per reply: inproc connects cost microseconds, and no socket outlives its thread
        # to block the context's shutdown.
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(_REPLIES)
        push.send_multipart([*envelope, p.encode(reply)])
        push.close()
