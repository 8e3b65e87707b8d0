"""Events a session's agent must react to, pushed rather than polled for.

A revocation raised from another terminal, a held call an operator decided: the daemon appends an
`Event` to the session's log (in memory, bounded: the durable facts are in the database, an event only
says "look") and wakes whoever waits. An agent waits with a `WaitEvents` long-poll on the same socket as
its other requests: the server parks it without a worker thread and answers it the moment an event of
its session is published, or when its wait runs out.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sandboxd import protocol as p

#: events kept per session: a waiter that fell further behind reads the durable state instead
KEPT = 256


class Events:
    """Per-session event logs of this daemon run, and the listeners woken by each publish."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self._seq = 0
        self._logs: dict[str, collections.deque[p.Event]] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def listen(self, wake: Callable[[str], None]) -> None:
        """Call `wake(session_id)` after every publish (from the publishing thread)."""
        with self._lock:
            self._listeners.append(wake)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Publishes on this thread wait for the block's end: a request's, once its commits are on disk
        (`Database.one_flush`), so no watcher hears of a state a crash of the host could take back."""
        if getattr(self._local, "held", None) is not None:
            yield  # joined: the outermost block publishes
            return
        self._local.held = []
        try:
            yield
        finally:
            held, self._local.held = self._local.held, None
            for event in held:
                self.publish(*event)

    def publish(self, session_id: str, kind: str, subject: str) -> None:
        if (held := getattr(self._local, "held", None)) is not None:
            held.append((session_id, kind, subject))
            return
        with self._lock:
            self._seq += 1
            event = p.Event(seq=self._seq, kind=kind, subject=subject)  # type: ignore[arg-type]
            self._logs.setdefault(session_id, collections.deque(maxlen=KEPT)).append(event)
            listeners = list(self._listeners)
        for wake in listeners:
            wake(session_id)

    def since(self, session_id: str, after: int, epoch: str) -> list[p.Event]:
        """The session's events after `after`; all of them when `epoch` is another run's."""
        if epoch != self.epoch:
            after = 0
        with self._lock:
            return [e for e in self._logs.get(session_id, ()) if e.seq > after]

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._logs.pop(session_id, None)
