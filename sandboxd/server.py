"""The daemon loop: receive -> decode -> handler for that type -> reply, over ZeroMQ ROUTER sockets.

The socket thread owns the ROUTERs (ZeroMQ sockets are not thread-safe). Cheap requests are answered
inline, and so is a call the service can serve without waiting on anything (`Handler.answer_now`: a
small read of a session no request is using or is queued for, so calls of one session keep their
order); the rest go to a worker pool, whose threads hand their replies back through an inproc
PUSH/PULL pair that the socket thread polls alongside the ROUTERs.

A `WaitEvents` long-poll is parked on the socket thread, not on a worker: it is answered when an event
of its session is published (the publishing thread wakes the socket thread through an inproc pair) or
when its wait runs out, so any number of agents can wait without taking a worker each.

There are one or two ROUTERs, and which one a request arrives on says who sent it (`sandboxd.auth`):
the owner-only ipc socket, whose peer is the local owner, always; and with a tcp:// endpoint a CURVE
socket, whose ZAP handler admits only allowlisted keys and whose peers are named by their key.
Two sockets rather than one bound twice, so a peer's identity never rests on a frame lacking a
User-Id.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq

from sandboxd import protocol as p
from sandboxd.auth import LOCAL_PEER, Peer, ServerKeys, ZapHandler
from sandboxd.config import DaemonConfig
from sandboxd.errors import ErrorCode, ProtocolError

log = logging.getLogger("sandboxd")

_REPLIES = "inproc://sandboxd-replies"
_WAKES = "inproc://sandboxd-wakes"
#: the queue key of a request that acts on a session it names only by a revocation or a call
_ANY_SESSION = ""


def _queue_key(request: p.Request) -> str | None:
    """Whose reads must not be answered at once while this request waits for a worker: its session's, or
    every session's when it changes one it does not name (a revocation's commit restores the workspace)."""
    session_id = getattr(request, "session_id", None)
    if isinstance(session_id, str):
        return session_id
    if getattr(request, "revocation_id", None) is not None or getattr(request, "call_id", None) is not None:
        return _ANY_SESSION
    return None


class Handler(Protocol):
    """What the server serves: the daemon's requests (`sandboxd.service.Service`)."""

    INLINE: tuple[type[Any], ...]
    metrics: Any
    events: Any

    def handle(self, request: p.Request, peer: Peer) -> p.Response: ...

    def answer_now(self, request: p.Request, peer: Peer) -> p.Response | None: ...

    def wait_events(self, request: p.WaitEventsRequest, peer: Peer) -> p.Response | None: ...

    def no_events(self, request: p.WaitEventsRequest) -> p.Response: ...


@dataclass
class _Parked:
    """A long-poll waiting for its session's next event."""

    index: int
    envelope: list[bytes]
    request: p.WaitEventsRequest
    peer: Peer
    deadline: float


@dataclass
class _Listener:
    """One ROUTER and how to tell who sent a message on it (None: nobody we can name; drop it)."""

    socket: zmq.Socket[bytes]
    peer_of: Callable[[zmq.Frame], Peer | None]


class Server:
    """Serves one `Handler` on the configured endpoints until `stop()`."""

    def __init__(self, config: DaemonConfig, service: Handler, keys: ServerKeys | None = None) -> None:
        self.config = config
        self.service = service
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="sandboxd-worker")
        if config.endpoint.startswith("tcp://") and keys is None:
            raise ValueError(f"{config.endpoint} is served with CURVE only: load the server's keys first")
        self.keys = keys
        self._parked: list[_Parked] = []
        self._pushes = threading.local()
        self._push_sockets: list[zmq.Socket[bytes]] = []
        self._waiting: frozenset[str] = frozenset()
        """Sessions with a parked long-poll (written by the socket thread only, replaced whole)."""
        self._queued: dict[str, int] = {}
        """Requests holding back each session's reads (`_queue_key`) whose replies are not yet forwarded
        (the socket thread's own: counted up where a request goes to a worker, down where its reply leaves)."""
        service.events.listen(self._wake)

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        """Bind, then answer requests until stopped."""
        zap = ZapHandler(self.ctx, self.keys) if self.keys is not None else None
        listeners = [_Listener(self._bind_local(), lambda _frame: LOCAL_PEER)]
        if self.keys is not None:
            listeners.append(_Listener(self._bind_curve(self.keys), self._curve_peer))
        replies = self.ctx.socket(zmq.PULL)
        replies.bind(_REPLIES)
        wakes = self.ctx.socket(zmq.PULL)
        wakes.bind(_WAKES)
        poller = zmq.Poller()
        for listener in listeners:
            poller.register(listener.socket, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        poller.register(wakes, zmq.POLLIN)
        log.info("sandboxd serving on %s", ", ".join(sorted({self.config.local_endpoint, self.config.endpoint})))
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if replies in events:
                    self._forward_replies(replies, listeners)
                woken = set()
                while wakes.poll(0):
                    woken.add(wakes.recv().decode())
                self._answer_parked(listeners, woken)
                for index, listener in enumerate(listeners):
                    while listener.socket in events and listener.socket.poll(0):
                        self._receive(index, listener, listener.socket.recv_multipart(copy=False))
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._forward_replies(replies, listeners)
            for push in self._push_sockets:  # their workers are gone: no thread uses them any more
                push.close(linger=5000)
            for parked in self._parked:  # stopping: every waiter hears now, rather than at its timeout
                listeners[parked.index].socket.send_multipart(
                    [*parked.envelope, p.encode(self.service.no_events(parked.request))])
            self._parked = []
            for listener in listeners:
                listener.socket.close()
            replies.close()
            wakes.close()
            if zap is not None:
                zap.stop()  # only now: a CURVE socket without its ZAP handler would admit anyone
            self.ctx.term()

    def _router(self) -> zmq.Socket[bytes]:
        router = self.ctx.socket(zmq.ROUTER)
        # A hard ceiling well above the configured limit: frames between the two get a
        # frame_too_large reply, anything larger is dropped by ZeroMQ before it costs memory.
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes * 4 + 4096)
        router.setsockopt(zmq.LINGER, 0)
        return router

    def _bind_local(self) -> zmq.Socket[bytes]:
        """The ipc socket: its file mode is the authentication, so it is owner-only from birth."""
        router = self._router()
        endpoint = self.config.local_endpoint
        path = Path(endpoint[len("ipc://"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)  # the socket is born owner-only; no window where others may connect
        try:
            router.bind(endpoint)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return router

    def _bind_curve(self, keys: ServerKeys) -> zmq.Socket[bytes]:
        """The tcp socket: CURVE-encrypted, and only keys the ZAP handler admits get through."""
        router = self._router()
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
        router.setsockopt(zmq.ZAP_DOMAIN, b"sandboxd")
        router.bind(self.config.endpoint)
        log.info("CURVE on %s, server key %s", self.config.endpoint, keys.public)
        return router

    def _curve_peer(self, frame: zmq.Frame) -> Peer | None:
        key = frame.get("User-Id")  # our ZAP handler sets it to the client's z85 public key
        if not isinstance(key, str) or len(key) != 40:
            return None
        assert self.keys is not None
        return Peer(key, operator=key in self.keys.operators)

    def _forward_replies(self, replies: zmq.Socket[bytes], listeners: list[_Listener]) -> None:
        while replies.poll(0):
            index, key, *frames = replies.recv_multipart()
            listeners[index[0]].socket.send_multipart(frames)
            if key:  # b"=" and the key: see `_work`
                key_text = key[1:].decode()
                if (left := self._queued.get(key_text, 1) - 1) > 0:
                    self._queued[key_text] = left
                else:
                    self._queued.pop(key_text, None)

    def _receive(self, index: int, listener: _Listener, frames: list[zmq.Frame]) -> None:
        router = listener.socket
        peer = listener.peer_of(frames[-1])
        if peer is None:
            log.error("dropped a message on %s from a peer without a CURVE key", self.config.endpoint)
            return
        envelope, payload = [f.bytes for f in frames[:-1]], frames[-1].bytes
        if len(envelope) > 2 or (len(envelope) == 2 and envelope[1] != b""):
            bad = ProtocolError(ErrorCode.BAD_FRAME, "a request is exactly one message frame")
            router.send_multipart([envelope[0], p.encode(p.error_response(p.request_id_of(payload), bad))])
            return
        try:
            request = p.decode_request(payload, self.config.max_frame_bytes)
        except ProtocolError as exc:
            log.info("rejected frame: %s", exc)
            self.service.metrics.errors.inc(exc.code.value)
            router.send_multipart([*envelope, p.encode(p.error_response(p.request_id_of(payload), exc))])
            return
        if isinstance(request, p.WaitEventsRequest):
            self._park(index, envelope, request, peer, router)
        elif isinstance(request, self.service.INLINE):
            router.send_multipart([*envelope, p.encode(self.service.handle(request, peer))])
        elif (reply := self._answer_now(request, peer)) is not None:
            router.send_multipart([*envelope, p.encode(reply)])
        else:
            if (key := _queue_key(request)) is not None:
                self._queued[key] = self._queued.get(key, 0) + 1
            self._pool.submit(self._work, index, envelope, request, peer)

    def _answer_now(self, request: p.Request, peer: Peer) -> p.Response | None:
        """The service's reply at once, unless a request that holds it back is still at a worker or its
        reply not yet sent: answered now, a read could overtake a write sent before it, or its reply."""
        session_id = getattr(request, "session_id", None)
        if session_id in self._queued or _ANY_SESSION in self._queued:
            return None
        try:
            reply = self.service.answer_now(request, peer)
        except AssertionError:
            log.critical("invariant broken; exiting", exc_info=True)
            os._exit(70)
        if reply is not None:
            self.service.metrics.answered_now.inc()
        return reply

    def _park(self, index: int, envelope: list[bytes], request: p.WaitEventsRequest, peer: Peer,
              router: zmq.Socket[bytes]) -> None:
        # Waiting before looking: an event published after the look finds the session here and wakes it.
        self._waiting = self._waiting | {request.session_id}
        reply = self.service.wait_events(request, peer)
        if reply is not None:
            router.send_multipart([*envelope, p.encode(reply)])
            return
        self._parked.append(_Parked(index, envelope, request, peer, time.monotonic() + request.timeout_s))

    def _answer_parked(self, listeners: list[_Listener], woken: set[str]) -> None:
        """Answer the parked long-polls whose session had an event, or whose wait ran out."""
        now, waiting = time.monotonic(), []
        for parked in self._parked:
            reply = self.service.wait_events(parked.request, parked.peer) \
                if parked.request.session_id in woken else None
            if reply is None and now >= parked.deadline:
                reply = self.service.no_events(parked.request)
            if reply is None:
                waiting.append(parked)
            else:
                listeners[parked.index].socket.send_multipart([*parked.envelope, p.encode(reply)])
        answered = len(waiting) != len(self._parked)
        self._parked = waiting
        if answered:
            self._waiting = frozenset(parked.request.session_id for parked in waiting)

    def _wake(self, session_id: str) -> None:
        """Called by the thread that published an event: the socket thread answers the session's waiters.

        Only when the session has one: a socket per wake costs more than the tool call that published it."""
        if session_id not in self._waiting:
            return
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(_WAKES)
        push.send(session_id.encode())
        push.close()

    def _work(self, index: int, envelope: list[bytes], request: p.Request, peer: Peer) -> None:
        try:
            reply = self.service.handle(request, peer)
        except AssertionError:
            # A broken invariant: stop loudly rather than keep serving from a state we do not trust.
            log.critical("invariant broken; exiting", exc_info=True)
            os._exit(70)
        # The request's queue key goes with its reply: the socket thread counts it down as the reply leaves.
        key = _queue_key(request)
        tag = b"" if key is None else b"=" + key.encode()
        self._push().send_multipart([bytes([index]), tag, *envelope, p.encode(reply)])

    def _push(self) -> zmq.Socket[bytes]:
        """This worker's socket to the socket thread, made once per worker: a socket per reply cost more
        (~65 us) than the rest of a read call's daemon side. Closed after the pool has stopped."""
        push: zmq.Socket[bytes] | None = getattr(self._pushes, "socket", None)
        if push is None:
            push = self._pushes.socket = self.ctx.socket(zmq.PUSH)
            push.connect(_REPLIES)
            self._push_sockets.append(push)
        return push
