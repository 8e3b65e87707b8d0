"""What the PostgreSQL state promises once its commits no longer wait for the disk under the writer lock,
and its call records lock their session only: on a real server, two `Database`s standing for two daemons.

- A session's call records do not wait for another session's, on the same daemon or another; the same
  session's, and a whole-database transaction, still run alone.
- A durable transaction is on disk when its block ends: a server crash right after it loses nothing,
  and a flush that fails fails its transaction (the next one reconnects).
- An intent another daemon committed but has not yet flushed (so not yet fired) is refused as being
  fired, never fired again.
- A closed session's rows are pruned without a rewrite (no lock other daemons wait for); a revocation's
  purge rewrites the table, and the forgotten bytes are gone from its file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from sandboxd.db import Database
from sandboxd.errors import InvalidState
from sandboxd.firewall import Firewall, FirewallConfig
from tests.unit.test_firewall_ledger import RecordingAdapter

HOLD = "INSERT INTO outbox_held (call_id, session_id, turn) VALUES (?, ?, 0)"


@pytest.fixture
def two(pg_url: str) -> Iterator[tuple[Database, Database]]:
    one, other = Database(pg_url, node="a"), Database(pg_url, node="b")
    yield one, other
    one.close()
    other.close()


def in_thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("daemons", [2, 1])
def test_a_sessions_records_wait_only_for_the_same_session_or_the_whole_database(
        two: tuple[Database, Database], daemons: int) -> None:
    """Across two daemons; and within one, whose sessions' transactions no longer queue on its one connection."""
    one, other = two[0], two[daemons - 1]

    def holding_s1(call_id: str, then: Callable[[], None]) -> None:
        """Run `then` on the other daemon while daemon one's transaction of session s1 is open."""
        inside, release = threading.Event(), threading.Event()

        def hold() -> None:
            with one.transaction(session="s1"):
                one.execute(HOLD, [call_id, "s1"])
                inside.set()
                assert release.wait(30)

        holder = in_thread(hold)
        assert inside.wait(10)
        try:
            then()
        finally:
            release.set()
            holder.join(10)

    def writes(call_id: str, owner: str, **scope: str) -> threading.Thread:
        def run() -> None:
            with other.transaction(**scope):
                other.execute(HOLD, [call_id, owner])
        return in_thread(run)

    def runs_at_once() -> None:
        thread = writes("c2", "s2", session="s2")
        thread.join(10)
        assert not thread.is_alive(), "another session's records waited for session s1's transaction"

    waiting: list[threading.Thread] = []

    def waits(call_id: str, **scope: str) -> Callable[[], None]:
        def then() -> None:
            thread = writes(call_id, "s1", **scope)
            thread.join(0.5)
            assert thread.is_alive(), f"{scope or 'a whole-database transaction'} ran beside session s1's"
            waiting.append(thread)
        return then

    holding_s1("c1", runs_at_once)
    holding_s1("c3", waits("c4", session="s1"))
    holding_s1("c5", waits("c6"))
    for thread in waiting:
        thread.join(10)
        assert not thread.is_alive()
    assert sorted(r["call_id"] for r in other.rows("SELECT call_id FROM outbox_held")) == [f"c{i}" for i in range(1, 7)]


def test_a_transaction_beyond_a_session_cannot_join_its_transaction(two: tuple[Database, Database]) -> None:
    one, _ = two
    with one.transaction(session="s1"):
        with one.transaction(session="s1"):  # the same session's: joins
            one.execute(HOLD, ["c1", "s1"])
        for wider in ({}, {"session": "s2"}):
            with pytest.raises(RuntimeError, match="beyond session s1"), one.transaction(**wider):
                pass
    assert one.value("SELECT COUNT(*) FROM outbox_held") == 1


def test_a_durable_commit_survives_a_server_crash_right_after_it() -> None:
    """On a server of its own whose WAL writer waits 10 s, so only the daemon's flush can make it durable."""
    pytest.importorskip("psycopg")
    from tests import pgserver

    if (why := pgserver.available()) is not None:
        pytest.skip(why)
    server = pgserver.PgServer()
    try:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            admin.execute("SELECT pg_reload_conf()")
        for i in range(3):
            db = Database(server.url, node="a")
            with db.transaction(durable=True):
                db.execute(HOLD, [f"c{i}", "s"])
            server.crash()  # at once: what is not flushed now is lost
            db.close()
            server.start()
        with psycopg.connect(server.url) as check:
            kept = [r[0] for r in check.execute("SELECT call_id FROM outbox_held ORDER BY call_id").fetchall()]
        assert kept == ["c0", "c1", "c2"]
    finally:
        server.stop()


def test_an_intent_committed_but_not_yet_flushed_is_never_fired_by_the_other_daemon(pg_url: str) -> None:
    dbs = [Database(pg_url, node="a"), Database(pg_url, node="b")]
    adapters = [RecordingAdapter(), RecordingAdapter()]
    one, two = (Firewall(FirewallConfig(), db, adapters=[adapter]) for db, adapter in zip(dbs, adapters, strict=True))
    flushing, release = threading.Event(), threading.Event()
    real = dbs[0]._fsync_wal

    def slow_flush() -> None:
        flushing.set()  # committed, visible to the other daemon, not yet durable: not fired yet
        assert release.wait(30)
        real()

    dbs[0]._fsync_wal = slow_flush  # type: ignore[method-assign]
    call = ("s", "lin", "notify", {"text": "x"})
    worker = in_thread(lambda: one.call(*call, call_id="c-x"))
    try:
        assert flushing.wait(10)
        assert adapters[0].fired == []
        with pytest.raises(InvalidState, match="firing it now"):
            two.call(*call, call_id="c-x")  # the agent's retry, sent to the other daemon
    finally:
        release.set()
        worker.join(10)
    assert two.call(*call, call_id="c-x").state == "done"  # answered from the ledger
    assert len(adapters[0].fired) == 1 and adapters[1].fired == []
    for db in dbs:
        db.close()


def _heap(db: Database, table: str) -> tuple[Path, bytes]:
    """The table's main file (after a CHECKPOINT, so it holds what the server wrote) and its bytes."""
    data = Path(str(db.value("SHOW data_directory")))
    db.execute("CHECKPOINT")
    path = data / str(db.value(f"SELECT pg_relation_filepath('\"{table}\"')"))
    return path, path.read_bytes()


def test_a_close_prunes_without_a_rewrite_and_a_revocation_erases_the_bytes(pg_url: str) -> None:
    db = Database(pg_url, node="a")
    marker = "forget-me-" + "q" * 24
    with db.transaction():
        db.execute(HOLD, [marker, "s"])
        db.execute(HOLD, ["kept", "s"])
    with db.transaction():
        db.execute("DELETE FROM outbox_held WHERE call_id = ?", [marker])
    path, content = _heap(db, "outbox_held")
    assert marker.encode() in content  # a deleted row: still in the file
    db.purge(erase=False)
    assert _heap(db, "outbox_held")[0] == path  # pruned in place, no rewrite, no exclusive lock
    db.purge(["outbox_held"])
    path_after, content_after = _heap(db, "outbox_held")
    assert path_after != path and marker.encode() not in content_after and b"kept" in content_after
    assert [r["call_id"] for r in db.rows("SELECT call_id FROM outbox_held")] == ["kept"]
    db.close()


def test_a_failed_flush_fails_its_commit_and_the_next_flush_reconnects(pg_url: str) -> None:
    db = Database(pg_url, node="a")
    with db.transaction(durable=True):
        db.execute(HOLD, ["c0", "s"])  # the flush connection is open now
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [db._flusher_conn._conn.info.backend_pid])
    with pytest.raises(psycopg.OperationalError), db.transaction(durable=True):
        db.execute(HOLD, ["c1", "s"])  # committed, but not known on disk: its caller must not go on
    with db.transaction(durable=True):
        db.execute(HOLD, ["c2", "s"])
    assert db.value("SELECT COUNT(*) FROM outbox_held") == 3
    db.close()


def test_a_server_down_while_writers_connect_leaves_no_session_waiting_for_good(
        two: tuple[Database, Database], monkeypatch: pytest.MonkeyPatch) -> None:
    """Connects that fail keep no place in the pool: once the server answers again, sessions write."""
    from sandboxd import db as db_module
    from sandboxd import pg

    one = two[0]
    real = pg.Connection

    def down(*args: object, **kwargs: object) -> object:
        raise psycopg.OperationalError("the server is down")

    monkeypatch.setattr(db_module, "POOL_WAIT_S", 5.0)  # were a place kept for them, this raises, not hangs
    monkeypatch.setattr(pg, "Connection", down)
    for k in range(db_module.SESSION_WRITERS + 2):
        with pytest.raises(psycopg.OperationalError), one.transaction(session=f"s{k}"):
            pass
    monkeypatch.setattr(pg, "Connection", real)
    with one.transaction(session="s1"):
        one.execute(HOLD, ["back", "s1"])
    assert one.value("SELECT session_id FROM outbox_held WHERE call_id = 'back'") == "s1"
