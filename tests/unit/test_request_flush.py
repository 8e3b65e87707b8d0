"""A request's transactions wait for the disk once, before its reply (`Database.one_flush`), through the
same `Service.handle` the server calls: counted on every request of a history and a whole revocation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sandboxd import protocol as p
from sandboxd.auth import Peer
from sandboxd.db import Database
from tests.unit.test_core_service import daemon, history


def test_each_request_is_on_disk_before_its_reply_and_waits_for_the_disk_once_besides_its_intents() -> None:
    """A request's transactions share one wait for the disk, before its reply; an effect's intent (durable)
    still waits at its own end. Counted on every request of a history and a whole revocation."""
    with daemon() as d:
        db, me = d.db, threading.current_thread()
        real_sync, real_transaction, real_handle = db._sync, db.transaction, d.service.handle
        waits: list[int] = []
        owed, intents = [0], [0]

        def sync(upto: int) -> None:
            if threading.current_thread() is me:
                waits.append(upto)
            real_sync(upto)

        @contextmanager
        def transaction(**kind: Any) -> Iterator[Database]:
            with real_transaction(**kind) as inside:
                yield inside
            if not kind.get("lazy"):
                owed[0] = db._commits
            intents[0] += bool(kind.get("durable"))

        def handle(request: p.Request, peer: Peer, started: float | None = None) -> p.Response:
            waits.clear()
            owed[0] = intents[0] = 0
            reply = real_handle(request, peer, started)
            assert db._synced >= owed[0], (type(request).__name__, db._synced, owed[0])
            assert len(waits) <= 1 + intents[0], (type(request).__name__, waits, intents[0])
            seen.append((type(request).__name__, len(waits)))
            return reply

        seen: list[tuple[str, int]] = []
        db._sync = sync  # type: ignore[method-assign]
        db.transaction = transaction  # type: ignore[method-assign]
        d.service.handle = handle  # type: ignore[method-assign]
        sid = d.open()
        secret = "key-onedisk0123456789"
        history(d, sid, secret)
        rid = d.ask(p.RevokeRequest, session_id=sid, source="o2", target=secret).revocation.revocation_id
        plan = d.ask(p.BeginRevocationRequest, revocation_id=rid)
        d.checkpoint(sid, "cp-2b", 2, 1, ["u1"], branch=plan.branch)
        d.ask(p.CommitRevocationRequest, revocation_id=rid, tokens=p.TokenCounts(), transitions_replayed=1,
              final_step=2)
        asked = {name for name, _ in seen}
        assert {"BeginRevocationRequest", "CommitRevocationRequest", "RevokeRequest", "CallRequest"} <= asked
