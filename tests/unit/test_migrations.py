"""The migrations of this round (5 and 6) on a database a daemon of version 4 left, full of rows.

A database is migrated in place at start-up: every row it held must still be there, unchanged, and read
back as the typed rows of today, with the new columns at their defaults. Rows are generated, so text
with quotes, NULLs and unicode goes through the ALTERs too.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.db import Database
from sandboxd.migrations import MIGRATIONS, Migration
from sandboxd.session import SessionRow

V4 = tuple(m for m in MIGRATIONS if m.version <= 4)
LATEST = max(m.version for m in MIGRATIONS)

text = st.text(max_size=40)
maybe_text = st.none() | text
stamp = st.floats(min_value=0, max_value=4e9, allow_nan=False)

session = st.fixed_dictionaries({
    "session_id": st.uuids().map(lambda u: f"s-{u.hex[:12]}"), "image": text,
    "state": st.sampled_from(["open", "closed", "failed", "opening"]), "created_at": stamp,
    "closed_at": st.none() | stamp, "container_id": maybe_text, "env_snapshot": maybe_text, "owner": text})
event = st.fixed_dictionaries({"call_id": text, "at": stamp, "from_state": maybe_text, "to_state": text,
                               "note": maybe_text})
branch = st.fixed_dictionaries({
    "branch": st.uuids().map(lambda u: f"rb-{u.hex[:12]}"), "lineage": text, "parent": maybe_text,
    "status": st.sampled_from(["open", "committing", "committed", "abandoned"]),
    "from_turn": st.none() | st.integers(0, 1000), "created_at": stamp, "finished_at": st.none() | stamp,
    "kind": st.none() | st.sampled_from(["replay", "revocation", "rollback"]), "splice": maybe_text})


def insert(conn: sqlite3.Connection, table: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        names = ", ".join(row)
        conn.execute(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def table(db: Database, name: str, columns: list[str], key: str) -> list[dict[str, Any]]:
    return db.rows(f"SELECT {', '.join(columns)} FROM {name} ORDER BY {key}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions=st.lists(session, max_size=6, unique_by=lambda s: s["session_id"]),
       events=st.lists(event, max_size=6), branches=st.lists(branch, max_size=4, unique_by=lambda b: b["branch"]))
def test_a_version_4_database_with_rows_migrates_and_keeps_every_row(
        sessions: list[dict[str, Any]], events: list[dict[str, Any]], branches: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.db"
        old = Database(path, V4)
        assert old.value("PRAGMA user_version") == 4
        assert "actor" not in {r["name"] for r in old.rows("PRAGMA table_info(ledger_events)")}
        with old.transaction():
            insert(old.conn, "sessions", sessions)
            insert(old.conn, "ledger_events", events)
            insert(old.conn, "branches", branches)
        old.close()

        db = Database(path)  # what a daemon of today does at start-up
        assert db.value("PRAGMA user_version") == LATEST
        order = {"sessions": "session_id", "ledger_events": "id", "branches": "branch"}
        for name, rows in (("sessions", sessions), ("ledger_events", events), ("branches", branches)):
            key = order[name]
            expected = sorted(rows, key=lambda r: r[key]) if key in (rows[0] if rows else {}) else rows
            assert table(db, name, list(rows[0]) if rows else ["*"], key) == expected
        # The new columns, at their defaults, and the typed rows of today read the old ones.
        for row in db.rows("SELECT idle_timeout_s, ttl_s, forked_from, hold_effects FROM sessions"):
            assert row == {"idle_timeout_s": None, "ttl_s": None, "forked_from": None, "hold_effects": 0}
        assert all(r == {"actor": None, "reason": None} for r in db.rows("SELECT actor, reason FROM ledger_events"))
        assert all(r["report"] is None for r in db.rows("SELECT report FROM branches"))
        typed = db.structs("SELECT * FROM sessions ORDER BY session_id", [], SessionRow)
        assert [s.session_id for s in typed] == sorted(s["session_id"] for s in sessions)
        assert all(s.hold_effects == 0 and s.forked_from is None for s in typed)
        # Migrating again is a no-op: a daemon restarts on the same state.
        assert db.migrate(MIGRATIONS) == LATEST
        db.close()


def test_a_migration_that_fails_leaves_the_database_at_the_version_before_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    old = Database(path, V4)
    with old.transaction():
        insert(old.conn, "sessions", [{"session_id": "s-1", "image": "i", "state": "open", "created_at": 1.0,
                                       "owner": "local"}])
    old.close()
    broken = (*MIGRATIONS, Migration(LATEST + 1, "broken", ("ALTER TABLE sessions ADD COLUMN x TEXT",
                                                           "ALTER TABLE nowhere ADD COLUMN y TEXT")))
    with pytest.raises(sqlite3.OperationalError):
        Database(path, broken)
    db = Database(path)
    assert db.value("PRAGMA user_version") == LATEST
    assert "x" not in {r["name"] for r in db.rows("PRAGMA table_info(sessions)")}
    assert db.rows("SELECT session_id, state FROM sessions") == [{"session_id": "s-1", "state": "open"}]
    db.close()


def test_a_tables_columns_are_read_once_and_again_after_a_migration(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db", [Migration(1, "one", ["CREATE TABLE t (a TEXT)"])])
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)  # the writer's connection: a scrub asks under the writers' lock
    with db.transaction():
        assert db.columns("t") == {"a"} and db.columns("t") == {"a"}
        assert db.columns("later") == frozenset()  # no such table (yet)
    assert sum("table_info" in s for s in statements) == 2  # t once, and the missing table
    with db.transaction():
        db.execute("CREATE TABLE later (b TEXT)")
    assert db.columns("later") == {"b"}  # a missing table is not remembered as empty
    db.migrate([Migration(2, "two", ["ALTER TABLE t ADD COLUMN c TEXT"])])
    assert db.columns("t") == {"a", "c"}
    db.close()
