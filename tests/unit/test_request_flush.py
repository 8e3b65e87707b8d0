"""A request's transactions wait for the disk once, before its reply (`Database.one_flush`), through the
same `Service.handle` the server calls: counted on every request of a history, a whole revocation and a
close. What must be on disk sooner is: an intent at its own end, a branch's status before any
participant acts on it, a closing session's state before its sandbox goes, and no event is heard before
the request's commits are on disk."""

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
    with daemon() as d:
        db, me = d.db, threading.current_thread()
        real_sync, real_transaction, real_handle = db._sync, db.transaction, d.service.handle
        waits: list[int] = []
        owed, intents = [0], [0]
        strict = [0]  # the last commit that is not lazy (a lazy one may wait for the flusher, by design)
        on_disk_at: dict[str, list[bool]] = {"event": [], "begin": [], "commit": [], "teardown": []}

        def sync(upto: int) -> None:
            if threading.current_thread() is me:
                waits.append(upto)
            real_sync(upto)

        @contextmanager
        def transaction(**kind: Any) -> Iterator[Database]:
            before = len(waits)
            with real_transaction(**kind) as inside:
                yield inside
            if not kind.get("lazy"):
                owed[0] = strict[0] = db._commits
            if kind.get("durable"):
                intents[0] += 1
                assert waits[before:] == [db._commits], "an intent waits for the disk at its own end"

        def handle(request: p.Request, peer: Peer, started: float | None = None) -> p.Response:
            waits.clear()
            owed[0] = intents[0] = 0
            reply = real_handle(request, peer, started)
            assert db._synced >= owed[0], (type(request).__name__, db._synced, owed[0])
            assert len(waits) <= 1 + intents[0], (type(request).__name__, waits, intents[0])
            seen.append((type(request).__name__, len(waits)))
            return reply

        def on_disk(point: str, action: Any) -> Any:
            def checked(*args: Any, **kwargs: Any) -> Any:
                on_disk_at[point].append(db._synced >= strict[0])
                return action(*args, **kwargs)
            return checked

        seen: list[tuple[str, int]] = []
        db._sync = sync  # type: ignore[method-assign]
        db.transaction = transaction  # type: ignore[method-assign]
        d.service.handle = handle  # type: ignore[method-assign]
        d.service.events.listen(lambda _sid: on_disk_at["event"].append(db._synced >= strict[0]))
        first = d.service.branches.participants[0]
        first.begin = on_disk("begin", first.begin)  # type: ignore[method-assign]
        first.commit = on_disk("commit", first.commit)  # type: ignore[method-assign]
        d.service.sessions.teardown = on_disk("teardown", d.service.sessions.teardown)  # type: ignore[method-assign]
        sid = d.open()
        secret = "key-onedisk0123456789"
        history(d, sid, secret)
        rid = d.ask(p.RevokeRequest, session_id=sid, source="o2", target=secret).revocation.revocation_id
        plan = d.ask(p.BeginRevocationRequest, revocation_id=rid)
        d.checkpoint(sid, "cp-2b", 2, 1, ["u1"], branch=plan.branch)
        d.ask(p.CommitRevocationRequest, revocation_id=rid, tokens=p.TokenCounts(), transitions_replayed=1,
              final_step=2)
        d.ask(p.CloseSessionRequest, session_id=sid)
        asked = {name for name, _ in seen}
        assert {"BeginRevocationRequest", "CommitRevocationRequest", "RevokeRequest", "CallRequest",
                "CloseSessionRequest"} <= asked
        # Each point was reached, and reached with every commit before it on disk.
        assert on_disk_at == {point: [True] * len(at) for point, at in on_disk_at.items()}
        assert all(on_disk_at.values()), on_disk_at
