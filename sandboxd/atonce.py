"""Small reads answered on the daemon's socket thread, where they arrive, when nothing would make them wait.

A worker's hand-off and the wake of the socket thread by its reply cost more, on an idle machine, than a
small read's whole work in the daemon. So a read the host answers (`sandboxd.sandbox.hostread`) of a small
file or directory, in a session no request is using, on an embedded database whose writer no one holds, is
answered where it arrives: `Calls.call` serves it as any call, and its record is written as any call's, in
the same order, under the same locks, taken here without waiting. Anything else (a lock held, a larger file,
a read only the executor can answer, a server's state, a stream, a caller the session is not its own, any
failure on the way) is left to a worker with nothing done. The one wait left is SQLite's own: the commit that
takes the WAL past its threshold (every thousand pages or so) copies it into the database, as it would on a
worker, and holds this thread for those ms. Which requests hold a session's reads back while they wait for a
worker is the server's to know (`sandboxd.server`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sandboxd import auth
from sandboxd import protocol as p
from sandboxd.errors import SandboxdError
from sandboxd.session import SessionRow

if TYPE_CHECKING:
    from sandboxd.calls import Calls

log = logging.getLogger("sandboxd")

#: what a read answered at once may touch: the socket thread must not stall on it
NOW_BYTES, NOW_ENTRIES = 256 * 1024, 1024
NOW_TOOLS = frozenset({"read_file", "list_dir"})


def may_read(request: p.Request, peer: auth.Peer, session_of: Callable[[str], str | None]
             ) -> Callable[[SessionRow], bool]:
    """The daemon's ownership rule (`sandboxd.auth.authorize`), asked of the session's row read for the call."""
    def may(row: SessionRow) -> bool:
        try:
            auth.authorize(request, peer, lambda _: row.owner, session_of)
        except SandboxdError:
            return False
        return True
    return may


@contextmanager
def answering(calls: Calls, req: p.CallRequest, may: Callable[[SessionRow], bool]) -> Iterator[bool]:
    """Whether this call can be answered at once: True within the block when it can, `calls.now` then holding
    what `Calls.call` needs (its locks are held and its read done); False with nothing done when it cannot."""
    if req.tool not in NOW_TOOLS or req.stream or calls.db.url is not None or calls.effects.serves(req.tool):
        yield False
        return
    lock = calls.sessions.lock(req.session_id)
    if not lock.acquire(blocking=False):
        yield False
        return
    try:
        if not calls.db.lock.acquire(blocking=False):
            yield False
            return
        try:
            started = time.monotonic()
            try:
                ready = _ready(calls, req, may)
            except AssertionError:
                raise
            except Exception:  # noqa: BLE001 - a worker serves it, and answers with the error if it recurs
                log.warning("a read could not be answered at once; a worker serves it", exc_info=True,
                            extra={"request_id": req.request_id, "session_id": req.session_id})
                ready = None
            if ready is None:
                yield False
                return
            row, reply, manifest = ready
            now = calls.now
            now.session, now.reply, now.manifest, now.started = req.session_id, reply, manifest, started
            try:
                with calls.sessions.holding(row):
                    yield True
            finally:
                now.session = now.reply = now.manifest = now.started = None
        finally:
            calls.db.lock.release()
    finally:
        lock.release()


def _ready(calls: Calls, req: p.CallRequest, may: Callable[[SessionRow], bool]
           ) -> tuple[SessionRow, dict[str, Any], p.ToolManifest] | None:
    """The session's row, the host's reply and the tool, for a read that can be answered at once; None when it
    cannot. Nothing is read for a caller `may` refuses (a worker answers it with the refusal), nor for an
    invalid call (a worker words the error)."""
    row = calls.sessions.get(req.session_id)
    if row is None or row.state != "open" or not may(row):
        return None
    try:
        manifest = calls.tools.validate(req.tool, req.args)
        payload = calls.payload(req)
    except SandboxdError:
        return None
    reply = calls.sessions.sandbox.read_now(req.session_id, payload,
                                            NOW_BYTES if req.tool == "read_file" else NOW_ENTRIES)
    return None if reply is None else (row, reply, manifest)
