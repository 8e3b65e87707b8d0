"""The same statements, as the daemon's modules write them, on SQLite and on a real PostgreSQL server.

A differential test: generated sequences of writes (INSERT, INSERT OR REPLACE / OR IGNORE, UPDATE,
DELETE) with generated text (quotes, `?`, `%`, any unicode) go to both backends through `Database`;
afterwards both hold the same rows in the same order (`ORDER BY rowid`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.db import Database
from sandboxd.errors import SandboxdError

ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
TEXT = st.one_of(st.sampled_from(["a", "A", "aB", "", "_", "%"]), ANY_TEXT)  # LIKE's case and wildcards, often
KEYS = st.sampled_from(["a", "b", "c?", "d%s", "e'"])
OPS = st.lists(st.one_of(
    st.tuples(st.just("replace"), KEYS, TEXT, st.integers(-2**40, 2**40)),
    st.tuples(st.just("ignore"), KEYS, TEXT, st.integers(-5, 5)),
    st.tuples(st.just("update"), KEYS, TEXT, st.integers(-5, 5)),
    st.tuples(st.just("delete"), KEYS, TEXT, st.integers(-5, 5)),
), max_size=12)


@pytest.fixture(scope="module")
def both(pg_server: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Database, Database]]:
    lite = Database(Path(tmp_path_factory.mktemp("dialect")) / "state.db")
    pg = Database(pg_server.fresh_url(), node="n")  # type: ignore[attr-defined]
    yield lite, pg
    lite.close()
    pg.close()


def apply(db: Database, ops: list[tuple[str, str, str, int]]) -> list[dict[str, object]]:
    with db.transaction():
        db.execute("DELETE FROM outbox_held")
        for op, key, text, n in ops:
            if op == "replace":
                db.execute("INSERT OR REPLACE INTO outbox_held (call_id, session_id, turn, policy) "
                           "VALUES (?, ?, ?, 'x%')", [key, text, n])
            elif op == "ignore":
                db.execute("INSERT OR IGNORE INTO outbox_held (call_id, session_id, turn) VALUES (?, ?, ?)",
                           [key, text, n])
            elif op == "update":
                db.update("outbox_held", {"call_id": key}, session_id=text, turn=n)
            else:
                db.execute("DELETE FROM outbox_held WHERE call_id = ? OR session_id LIKE ?", [key, text + "%"])
    return db.rows("SELECT call_id, session_id, turn, policy FROM outbox_held ORDER BY rowid")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_sqlite_and_postgresql_agree_on_every_write(both: tuple[Database, Database],
                                                    ops: list[tuple[str, str, str, int]]) -> None:
    lite, pg = both
    assert apply(pg, ops) == apply(lite, ops)


def test_a_failed_statement_rolls_back_and_the_database_keeps_serving(both: tuple[Database, Database]) -> None:
    _, pg = both
    apply(pg, [("replace", "a", "kept", 1)])
    with pytest.raises(Exception) as failed, pg.transaction():
        pg.execute("INSERT INTO outbox_held (call_id) VALUES (?)", ["z"])
        pg.execute("INSERT INTO no_such_table (x) VALUES (?)", [1])
    assert not isinstance(failed.value, SandboxdError)
    assert [r["call_id"] for r in pg.rows("SELECT call_id FROM outbox_held")] == ["a"]
    assert pg.value("SELECT COUNT(*) FROM outbox_held WHERE call_id = ?", ["z"]) == 0


def test_a_state_setting_that_is_no_url_is_refused_before_anything_opens(tmp_path: Path) -> None:
    from sandboxd.config import load_config

    with pytest.raises(ValueError, match="postgresql:// URL"):
        load_config(state_dir=str(tmp_path / "s"), state="mysql://nope")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("stored", ["Alice", "ALICE", "alice", "aLiCe"])
def test_like_is_blind_to_ascii_case_on_both(both: tuple[Database, Database], stored: str) -> None:
    for db in both:
        apply(db, [("replace", "a", stored, 1)])
        assert db.value("SELECT COUNT(*) FROM outbox_held WHERE session_id LIKE ?", ["alic%"]) == 1
