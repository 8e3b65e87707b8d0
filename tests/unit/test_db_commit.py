"""Group commit and grouped purges of the state database: what one session's transaction waits for.

A transaction's fsync happens after its COMMIT and outside the writers' lock, so another thread's
transaction commits while the first still waits for the disk; purges asked for while one is in flight
share the next checkpoint. Both are shown by holding one party inside its fsync or checkpoint (an
event, not a timing) and watching the others go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.db import Database
from sandboxd.migrations import Migration

SCHEMA = [Migration(1, "test", ["CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)"])]


@pytest.fixture
def db(tmp_path: Path) -> Database:
    return Database(tmp_path / "state.db", SCHEMA)


def in_thread(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def test_a_transaction_commits_while_another_waits_for_its_fsync(db: Database,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real, held, release = db._fsync_wal, threading.Event(), threading.Event()
    fsyncs: list[str] = []

    def slow_fsync() -> None:
        fsyncs.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            held.set()
            assert release.wait(30)
        real()

    monkeypatch.setattr(db, "_fsync_wal", slow_fsync)

    def first() -> None:
        with db.transaction():
            db.execute("INSERT INTO t VALUES (1, 'a')")

    a = threading.Thread(target=first, name="first", daemon=True)
    a.start()
    assert held.wait(30)
    # The first transaction is committed and waiting for the disk: the writers' lock is free.
    with db.transaction(lazy=True):
        db.execute("INSERT INTO t VALUES (2, 'b')")
    assert a.is_alive()
    assert db.value("SELECT COUNT(*) FROM t") == 2
    release.set()
    a.join(30)
    assert not a.is_alive()
    assert db._synced >= 1


@settings(max_examples=10, deadline=None)
@given(writers=st.integers(min_value=2, max_value=8))
def test_transactions_committed_during_an_fsync_share_the_next_one(tmp_path_factory: pytest.TempPathFactory,
                                                                   writers: int) -> None:
    db = Database(tmp_path_factory.mktemp("db") / "state.db", SCHEMA)
    real, held, release = db._fsync_wal, threading.Event(), threading.Event()
    fsyncs = 0

    def counted() -> None:
        nonlocal fsyncs
        fsyncs += 1
        if fsyncs == 1:
            held.set()
            assert release.wait(30)
        real()

    db._fsync_wal = counted  # type: ignore[method-assign]
    before = db._commits  # the migrations'

    def write(k: int) -> Callable[[], None]:
        def run() -> None:
            with db.transaction():
                db.execute("INSERT INTO t VALUES (?, 'x')", [k])
        return run

    first = in_thread(write(0))
    assert held.wait(30)
    others = [in_thread(write(k)) for k in range(1, writers + 1)]
    # Every other writer has committed and waits on the fsync in flight, which began before its commit.
    wait_for(lambda: db._commits == before + writers + 1 and len(db._sync_cond._waiters) == writers,  # type: ignore[attr-defined]
             "all writers committed and waiting")
    release.set()
    for thread in [first, *others]:
        thread.join(30)
        assert not thread.is_alive()
    assert fsyncs == 2, fsyncs  # the held one, then one for all the others
    assert db._synced == before + writers + 1
    db.close()


@settings(max_examples=10, deadline=None)
@given(callers=st.integers(min_value=2, max_value=8))
def test_purges_asked_for_during_a_checkpoint_share_the_next_one(tmp_path_factory: pytest.TempPathFactory,
                                                                 callers: int) -> None:
    db = Database(tmp_path_factory.mktemp("db") / "state.db", SCHEMA)
    real, held, release = db._checkpoint, threading.Event(), threading.Event()
    began: list[int] = []
    covered: list[list[str] | None] = []

    def counted(tables: list[str] | None) -> None:
        began.append(db.value("SELECT COUNT(*) FROM t"))
        covered.append(tables)
        if len(began) == 1:
            held.set()
            assert release.wait(30)
        real(tables)

    db._checkpoint = counted  # type: ignore[method-assign]
    first = in_thread(lambda: db.purge(["first"]))
    assert held.wait(30)

    def write_then_purge(k: int) -> Callable[[], None]:
        def run() -> None:
            with db.transaction():
                db.execute("INSERT INTO t VALUES (?, 'x')", [k])
            db.purge([f"t{k}"])
        return run

    others = [in_thread(write_then_purge(k)) for k in range(callers)]
    wait_for(lambda: len(db._purge_cond._waiters) == callers, "every caller waiting")  # type: ignore[attr-defined]
    release.set()
    for thread in [first, *others]:
        thread.join(30)
        assert not thread.is_alive()
    # The first checkpoint began before their writes; the second, shared, after all of them.
    assert began == [0, callers]
    # ... and it covers the tables every one of them named (on a server, each is rewritten).
    assert covered == [["first"], sorted(f"t{k}" for k in range(callers))]
    db.close()


def test_a_failed_purge_covers_none_of_the_callers_waiting_for_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    db = Database(tmp_path_factory.mktemp("db") / "state.db", SCHEMA)
    real, held, release = db._checkpoint, threading.Event(), threading.Event()
    covered: list[list[str] | None] = []

    def failing_once(tables: list[str] | None) -> None:
        covered.append(tables)
        if len(covered) == 1:
            held.set()
            assert release.wait(30)
        if len(covered) == 2:
            raise RuntimeError("the WAL could not be truncated")
        real(tables)

    db._checkpoint = failing_once  # type: ignore[method-assign]
    first = in_thread(lambda: db.purge(["first"]))
    assert held.wait(30)
    outcomes: list[str] = []

    def purge(table: str) -> Callable[[], None]:
        def run() -> None:
            try:
                db.purge([table])
                outcomes.append("purged")
            except RuntimeError:
                outcomes.append("raised")
        return run

    others = [in_thread(purge(table)) for table in ("a", "b")]
    wait_for(lambda: len(db._purge_cond._waiters) == 2, "both callers waiting")  # type: ignore[attr-defined]
    release.set()
    for thread in [first, *others]:
        thread.join(30)
        assert not thread.is_alive()
    # The shared purge failed: its runner says so, and the other caller ran one of its own, covering
    # every table the failed one had taken, instead of returning as if its content were gone.
    assert sorted(outcomes) == ["purged", "raised"]
    assert covered == [["first"], ["a", "b"], ["a", "b"]]
    db.close()


def test_a_purge_copies_the_wal_outside_the_writers_lock_and_leaves_no_deleted_value(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "purged-value-5c1e0b7a93"
    with db.transaction():
        db.execute("INSERT INTO t VALUES (1, ?)", [secret])
    with db.transaction():
        db.execute("DELETE FROM t WHERE k = 1")
    real, copied, release = db._backfill, threading.Event(), threading.Event()

    def held_after_copying() -> None:
        real()
        copied.set()
        assert release.wait(30)

    monkeypatch.setattr(db, "_backfill", held_after_copying)
    purge = in_thread(db.purge)
    assert copied.wait(30)
    # The WAL is being copied: another session's transaction commits meanwhile, adding frames the
    # TRUNCATE that follows must copy itself.
    writer = in_thread(lambda: db.execute("INSERT INTO t VALUES (2, 'later')"))
    wait_for(lambda: not writer.is_alive(), "a transaction committed while the purge copied the WAL")
    assert purge.is_alive()
    release.set()
    purge.join(30)
    assert not purge.is_alive()
    wal = Path(f"{db.path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    for path in db.path.parent.glob("state.db*"):
        assert secret.encode() not in path.read_bytes(), path
    assert db.rows("SELECT k, v FROM t") == [{"k": 2, "v": "later"}]
    db.close()


@settings(max_examples=20, deadline=None)
@given(plan=st.lists(st.sampled_from(["plain", "lazy", "durable"]), min_size=1, max_size=8))
def test_a_requests_transactions_wait_for_the_disk_once_at_its_end_and_an_intent_at_its_own(
        tmp_path_factory: pytest.TempPathFactory, plan: list[str]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        # No flusher: its fsync of lazy commits would cover the block's commits at times of its choosing.
        patch.setattr(Database, "_flusher", lambda _self: None)
        db = Database(tmp_path_factory.mktemp("db") / "state.db", SCHEMA)
    real, me = db._sync, threading.current_thread()
    waits: list[int] = []  # this thread's waits for the disk, each as the commit it waited for

    def counted(upto: int) -> None:
        if threading.current_thread() is me:
            waits.append(upto)
        real(upto)

    db._sync = counted  # type: ignore[method-assign]
    owed = 0  # the last commit the block's end must wait for
    with db.one_flush():
        for k, kind in enumerate(plan):
            before = len(waits)
            with db.transaction(durable=kind == "durable", lazy=kind == "lazy"):
                db.execute("INSERT INTO t VALUES (?, ?)", [k, kind])
            if kind == "durable":
                # An intent is on disk when its block ends, and so is every commit before it.
                assert waits[before:] == [db._commits] and db._synced >= db._commits
                owed = 0
            else:
                assert waits[before:] == []  # no wait of its own
                owed = db._commits if kind == "plain" else owed
        inside = len(waits)
    # The block's end waits once, for its last plain commit after its last intent (a lazy one stays lazy).
    assert waits[inside:] == ([owed] if owed else [])
    assert db._synced >= owed
    db.close()


def test_a_block_whose_flush_fails_raises_and_counts_nothing_durable(db: Database,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def failing() -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(db, "_fsync_wal", failing)
    with pytest.raises(OSError), db.one_flush():
        with db.transaction():
            db.execute("INSERT INTO t VALUES (1, 'a')")
        with db.one_flush():  # joined: the outer block waits
            with db.transaction():
                db.execute("INSERT INTO t VALUES (2, 'b')")
    assert db.value("SELECT COUNT(*) FROM t") == 2  # neither commit waited for the disk on its own
    assert db._synced < db._commits
    assert getattr(db._local, "deferred", None) is None  # the next block starts afresh


def test_a_failed_block_whose_flush_fails_too_raises_its_own_exception(db: Database,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def failing() -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(db, "_fsync_wal", failing)
    with pytest.raises(AssertionError, match="broken invariant"), db.one_flush():
        with db.transaction():
            db.execute("INSERT INTO t VALUES (1, 'a')")
        raise AssertionError("broken invariant")
    assert getattr(db._local, "deferred", None) is None
