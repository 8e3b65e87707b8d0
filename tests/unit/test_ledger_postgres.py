"""The ledger's own guarantees (`test_firewall_ledger`) again, with the state on a real PostgreSQL server.

Every test of that module whose subject is the ledger runs here unchanged over a fresh schema; the few
that open the SQLite file behind the daemon's back (its pragmas, an old file's migration, a second
connection's view) have PostgreSQL counterparts below.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from sandboxd.errors import CallUnknown, InvalidState
from sandboxd.firewall import Firewall
from sandboxd.migrations import MIGRATIONS
from tests.unit.test_firewall_ledger import *  # noqa: F403  (the same tests, collected here again)

del test_schema_and_durability_pragmas  # noqa: F821  (SQLite's pragmas)
del test_intent_is_committed_before_the_effect_fires  # noqa: F821  (opens the file with sqlite3)
del test_a_ledger_from_before_simulated_answers_gains_the_column  # noqa: F821  (an old SQLite file)


@pytest.fixture
def db_path(pg_url: str) -> str:
    """The tests' `Database(str(db_path))` opens this URL: the same database for every firewall they make."""
    return pg_url


def test_the_schema_is_the_migrations(make_firewall: Callable[..., Any]) -> None:
    firewall, _ = make_firewall()
    db = firewall.ledger._db
    assert db.value("PRAGMA user_version") == max(m.version for m in MIGRATIONS)
    names = {r["name"] for r in db.rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"ledger_calls", "ledger_reached", "ledger_aliases", "branches", "outbox_held", "sessions"} <= names
    make_firewall()  # a second daemon over the same database finds its tables and does not fail


def test_the_intent_is_committed_before_the_effect_fires(make_firewall: Callable[..., Any], db_path: str) -> None:
    firewall, adapter = make_firewall()
    seen: list[str] = []

    def look(call_id: str) -> None:
        with psycopg.connect(db_path) as other:  # another client sees committed rows only
            row = other.execute("SELECT state FROM ledger_calls WHERE call_id = %s", [call_id]).fetchone()
        seen.append(row[0] if row else "missing")

    adapter.before_fire = look
    result = firewall.call("s", "lin", "notify", {"text": "hello"})
    assert seen == ["fired"] and result.state == "done"


def test_two_daemons_on_one_database_fire_each_intent_once(make_firewall: Callable[..., Any]) -> None:
    """Two firewalls (as two daemons: their own connections, locks and in-flight sets) race on the same
    intents of one lineage: each intent fires once in all, and every answer is its one result."""
    (one, adapter_one), (two, adapter_two) = make_firewall(), make_firewall()
    texts = [f"t{i % 7}" for i in range(28)]
    answers: list[tuple[str, str]] = []

    def run(firewall: Firewall, share: list[str]) -> None:
        for text in share:
            try:  # the same agent call id on both: a retry sent to whichever daemon
                result = firewall.call("s", "lin", "notify", {"text": text}, call_id="c-" + text)
                answers.append((result.call_id, result.state))
            except InvalidState:
                pass  # the other daemon is firing it right now: refused, never fired twice

    threads = [threading.Thread(target=run, args=(fw, texts)) for fw in (one, two, one, two)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fired = adapter_one.fired + adapter_two.fired
    assert len(fired) == len(set(fired)), "an intent fired twice"
    assert len(fired) == 7 and {call_id for call_id, _ in answers} == set(fired)
    assert {state for _, state in answers} == {"done"}
    assert one.stats().states == {"done": 7} and one.ledger.fired_twice("s") == 0


def test_a_call_another_live_daemon_fires_is_not_taken_for_an_orphan(make_firewall: Callable[..., Any],
                                                                      db_path: str) -> None:
    """While daemon one fires, daemon two reaching the same call refuses it as busy; once daemon one is
    gone (its connections closed, as when its node dies), the call left in flight is `unknown`."""
    (one, adapter_one), (two, _) = make_firewall(), make_firewall()
    started, release = threading.Event(), threading.Event()
    adapter_one.before_fire = lambda call_id: (started.set(), release.wait(10))
    call = ("s", "lin", "notify", {"text": "x"})
    worker = threading.Thread(target=one.call, args=call, kwargs={"call_id": "c-x"})
    worker.start()
    assert started.wait(10)
    try:
        with pytest.raises(InvalidState, match="firing it now"):
            two.call(*call, call_id="c-x")  # the agent's retry, sent to the other daemon
        assert two.recover() == []  # a second daemon starting up leaves the live one's call alone
    finally:
        release.set()
        worker.join()
    assert len(adapter_one.fired) == 1
    assert two.call(*call, call_id="c-x").state == "done"  # answered from the ledger, not fired again
    assert len(adapter_one.fired) == 1


def test_a_call_left_in_flight_by_a_daemon_that_died_is_unknown(make_firewall: Callable[..., Any]) -> None:
    """A daemon gone mid-send (its connections closed with it): the next daemon finds the call in flight
    with no lock held, so it is `unknown`, for an operator to resolve; it is not fired again."""
    (one, adapter_one), (two, adapter_two) = make_firewall(), make_firewall()
    started = threading.Event()

    def die(call_id: str) -> None:
        started.set()
        one.ledger._db.close()  # every connection of daemon one closes, as its process's would
        raise SystemExit  # and this thread never reaches the send

    adapter_one.before_fire = die
    def send() -> None:
        with contextlib.suppress(BaseException):
            one.call("s", "lin", "notify", {"text": "y"}, call_id="c-y")

    worker = threading.Thread(target=send)
    worker.start()
    worker.join(10)
    assert started.is_set()
    # The server ends a closed connection's backend, and releases its advisory locks, after the close
    # returns: until then daemon one is, to the server, still sending.
    deadline = time.monotonic() + 10
    while two.ledger._db.value("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(CallUnknown):
        two.call("s", "lin", "notify", {"text": "y"}, call_id="c-y")
    assert adapter_one.fired == [] and adapter_two.fired == []
