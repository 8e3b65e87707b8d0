"""The ledger and the Firewall's bookkeeping, driven by an in-process adapter (no network).

The integration tests repeat the important paths against real SMTP and HTTP servers; these pin the
ledger's own guarantees: write-ahead ordering, durable counters, recovery, replay branches, threads.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxd.db import Database
from sandboxd.errors import (
    BranchStateError,
    CallIdConflict,
    CallUnknown,
    EffectFailed,
    ErrorCode,
    InvalidArguments,
    InvalidState,
    UnknownTool,
)
from sandboxd.firewall import EffectAdapter, EffectNotDelivered, Firewall, FirewallConfig
from sandboxd.firewall.ledger import CallRecord, Ledger
from sandboxd.protocol import ToolManifest

NOTIFY = ToolManifest(
    name="notify",
    description="Test effect.",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string"}, "n": {"type": "number"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    effect="external",
    intent_fields=["text", "n"],
)


class RecordingAdapter(EffectAdapter):
    """Counts fires; `before_fire` lets a test look at the ledger at the moment the effect fires."""

    manifest = NOTIFY
    timeout_s = 1.0

    def __init__(self) -> None:
        self.fired: list[str] = []
        self.before_fire: Callable[[str], None] | None = None
        self.fail_with: Exception | None = None
        self._lock = threading.Lock()

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        if self.before_fire is not None:
            self.before_fire(call_id)
        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            self.fired.append(call_id)
            return {"delivered": len(self.fired), "text": args["text"]}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def make_firewall(db_path: Path) -> Iterator[Callable[..., tuple[Firewall, RecordingAdapter]]]:
    opened: list[Any] = []

    def make(release: dict[str, str] | None = None) -> tuple[Firewall, RecordingAdapter]:
        db = Database(str(db_path))
        adapter = RecordingAdapter()
        config = FirewallConfig(release=release or {})  # type: ignore[arg-type]
        firewall = Firewall(config, db, adapters=[adapter])
        opened.append(db)
        return firewall, adapter

    yield make
    for db in opened:
        db.close()


def test_schema_and_durability_pragmas(make_firewall: Callable[..., Any], db_path: Path) -> None:
    firewall, _ = make_firewall()
    db = firewall.ledger._db
    assert db.value("PRAGMA journal_mode") == "wal"
    assert db.value("PRAGMA synchronous") == 2  # FULL
    names = {r["name"] for r in db.rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"ledger_calls", "ledger_reached", "ledger_aliases", "branches", "outbox_held"} <= names
    make_firewall()  # a second ledger over the same file finds its tables and does not fail


def test_intent_is_committed_before_the_effect_fires(
    make_firewall: Callable[..., Any], db_path: Path
) -> None:
    firewall, adapter = make_firewall()
    seen: list[str] = []

    def look(call_id: str) -> None:
        # A separate connection sees only committed data: what a crash right now would leave behind.
        with sqlite3.connect(db_path) as other:
            row = other.execute("SELECT state FROM ledger_calls WHERE call_id = ?", [call_id]).fetchone()
        seen.append(row[0] if row else "missing")

    adapter.before_fire = look
    result = firewall.call("s", "lin", "notify", {"text": "hello"})
    assert seen == ["fired"]
    assert result.state == "done" and result.result == {"delivered": 1, "text": "hello"}
    states = [to for _, to, _ in firewall.ledger.events(result.call_id)]
    assert states == ["intent", "fired", "done"]


def test_invalid_arguments_record_nothing(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    with pytest.raises(InvalidArguments) as caught:
        firewall.call("s", "lin", "notify", {"text": 3})
    assert caught.value.code is ErrorCode.INVALID_ARGUMENTS and caught.value.details["path"] == "$.text"
    with pytest.raises(InvalidArguments):
        firewall.call("s", "lin", "notify", {"text": "x", "extra": 1})
    with pytest.raises(InvalidArguments, match="canonical"):
        firewall.call("s", "lin", "notify", {"text": "x", "n": float("nan")})
    with pytest.raises(UnknownTool):
        firewall.call("s", "lin", "nope", {})
    assert adapter.fired == [] and firewall.calls("s") == [] and firewall.stats().states == {}


def test_occurrence_counters_survive_a_restart(make_firewall: Callable[..., Any]) -> None:
    first, adapter1 = make_firewall()
    a = first.call("s", "lin", "notify", {"text": "same"})
    second, adapter2 = make_firewall()
    b = second.call("s", "lin", "notify", {"text": "same"})
    # Had the counter restarted at 0, b would have been answered from a's record and not sent.
    assert (a.occurrence, b.occurrence) == (0, 1) and a.call_id != b.call_id
    assert len(adapter1.fired) == len(adapter2.fired) == 1 and not b.deduplicated


def test_retry_and_conflict(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    a = firewall.call("s", "lin", "notify", {"text": "a  b", "n": 1}, call_id="c1")
    again = firewall.call("s", "lin", "notify", {"text": "a b", "n": 1.0}, call_id="c1")
    assert again.deduplicated and again.call_id == a.call_id and again.result == a.result
    with pytest.raises(CallIdConflict) as caught:
        firewall.call("s", "lin", "notify", {"text": "other"}, call_id="c1")
    assert caught.value.code is ErrorCode.CALL_ID_CONFLICT
    assert len(adapter.fired) == 1 and len(firewall.calls("s")) == 1
    assert firewall.stats().counters["error.call_id_conflict"] == 1


def test_failed_call_is_retried_but_unknown_is_not(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    adapter.fail_with = EffectNotDelivered("refused")
    with pytest.raises(EffectFailed) as caught:
        firewall.call("s", "lin", "notify", {"text": "x"}, call_id="c1")
    assert caught.value.details["state"] == "failed"
    adapter.fail_with = None
    retried = firewall.call("s", "lin", "notify", {"text": "x"}, call_id="c1")
    assert retried.state == "done" and not retried.deduplicated and adapter.fired == [retried.call_id]
    record = firewall.ledger.get(retried.call_id)
    assert record is not None and record.attempts == 2

    adapter.fail_with = RuntimeError("adapter bug")
    with pytest.raises(RuntimeError):
        firewall.call("s", "lin", "notify", {"text": "y"}, call_id="c2")
    adapter.fail_with = None
    with pytest.raises(CallUnknown):
        firewall.call("s", "lin", "notify", {"text": "y"}, call_id="c2")
    assert len(adapter.fired) == 1


def _crash_after_intent(ledger: Ledger, call_id: str, state: str = "intent") -> None:
    """What a daemon killed between committing an intent and firing leaves behind."""
    record = CallRecord(
        call_id=call_id,
        tool="notify",
        state="intent",
        session_id="s",
        lineage="lin",
        branch="lin#0",
        occurrence=0,
        intent_key="k",
        intent={"text": "x"},
        args={"text": "x"},
        policy="immediate",
    )
    with ledger.transaction():
        ledger.insert_call(record)
        if state != "intent":
            ledger.transition(call_id, state, ("intent",))  # type: ignore[arg-type]


def test_recover_turns_in_flight_calls_unknown(make_firewall: Callable[..., Any]) -> None:
    old, _ = make_firewall()
    _crash_after_intent(old.ledger, "fx-a")
    _crash_after_intent(old.ledger, "fx-b", "fired")
    done = old.call("s", "lin", "notify", {"text": "done"})
    restarted, adapter = make_firewall()
    assert sorted(restarted.recover()) == ["fx-a", "fx-b"]
    assert restarted.recover() == []
    a, b, c = (restarted.ledger.get(i) for i in ("fx-a", "fx-b", done.call_id))
    assert a and b and c and (a.state, b.state, c.state) == ("unknown", "unknown", "done")
    assert (a.recovered_from, b.recovered_from) == ("intent", "fired")
    with pytest.raises(InvalidState):
        restarted.resolve(done.call_id, "failed")
    assert restarted.resolve("fx-a", "done", {"by": "operator"}).result == {"by": "operator"}
    assert restarted.resolve("fx-b", "failed").state == "failed"
    assert adapter.fired == []


def test_leftover_in_flight_call_is_not_fired_even_without_recover(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    first = firewall.call("s", "lin", "notify", {"text": "x"}, call_id="c1")
    with firewall.ledger.transaction():  # pretend a previous process died while firing it
        firewall.ledger.transition(first.call_id, "intent", ("done",))
    restarted, adapter2 = make_firewall()
    with pytest.raises(CallUnknown):
        restarted.call("s", "lin", "notify", {"text": "x"}, call_id="c1")
    record = restarted.ledger.get(first.call_id)
    assert record is not None and record.state == "unknown" and adapter2.fired == []


def test_transaction_refuses_to_nest_in_an_open_transaction(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    db = firewall.ledger._db
    db.execute("BEGIN")
    try:
        with pytest.raises(RuntimeError, match="inside an open transaction"):
            firewall.call("s", "lin", "notify", {"text": "x"})
    finally:
        db.execute("ROLLBACK")
    assert adapter.fired == []


def test_replay_branch_dedupes_stages_and_orphans(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    kept = firewall.call("s", "lin", "notify", {"text": "kept"}, turn=1)
    gone = firewall.call("s", "lin", "notify", {"text": "gone"}, turn=2)
    with pytest.raises(BranchStateError):
        firewall.call("s", "lin", "notify", {"text": "kept"}, mode="shadow")
    branch = firewall.open_replay("lin")
    with pytest.raises(BranchStateError):
        firewall.open_replay("lin")
    replayed = firewall.call("s2", "lin", "notify", {"text": " kept "}, mode="shadow", call_id="x", turn=1)
    assert replayed.deduplicated and replayed.call_id == kept.call_id and replayed.result == kept.result
    new = firewall.call("s2", "lin", "notify", {"text": "new"}, mode="shadow", turn=2)
    assert new.shadowed and new.state == "staged" and new.result and new.result["status"] == "shadowed"
    assert firewall.orphans("lin", branch) == [gone.call_id]
    report = firewall.finish_replay(branch, commit=True)
    assert report.orphaned == [gone.call_id] and report.staged == [new.call_id]
    assert firewall.orphans("lin", branch) == [gone.call_id]
    gone_record = firewall.ledger.get(gone.call_id)
    assert gone_record is not None and gone_record.state == "orphaned"
    assert len(adapter.fired) == 2
    # The replay branch is live now: its counters continue, so a third 'kept' is a new call.
    third = firewall.call("s2", "lin", "notify", {"text": "kept"})
    assert third.occurrence == 1 and len(adapter.fired) == 3
    released = firewall.release(new.call_id)
    assert released.state == "done" and len(adapter.fired) == 4
    with pytest.raises(BranchStateError):
        firewall.finish_replay(branch, commit=True)


def test_abandoned_replay_leaves_nothing_staged(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    original = firewall.call("s", "lin", "notify", {"text": "a"})
    branch = firewall.open_replay("lin")
    staged = firewall.call("s", "lin", "notify", {"text": "b"}, mode="shadow")
    report = firewall.finish_replay(branch, commit=False)
    assert report.orphaned == [] and report.staged == [staged.call_id] and firewall.outbox() == []
    record = firewall.ledger.get(staged.call_id)
    assert record is not None and record.state == "shadowed"
    # The original branch is still live: 'b' reached live now is the same call id and fires.
    live = firewall.call("s", "lin", "notify", {"text": "b"})
    assert live.call_id == staged.call_id and live.state == "done"
    assert adapter.fired == [original.call_id, live.call_id]


@pytest.mark.parametrize("policy", ["on_commit", "manual"])
def test_a_replay_holds_a_new_call_to_a_held_tool_as_the_live_run_would(
    make_firewall: Callable[..., Any], policy: str
) -> None:
    firewall, adapter = make_firewall({"notify": policy})
    original = firewall.call("s", "lin", "notify", {"text": "a"}, turn=1)
    branch = firewall.open_replay("lin")
    new = firewall.call("s", "lin", "notify", {"text": "b"}, mode="shadow", turn=1)
    live_would = {"on_commit": "held until this turn is committed", "manual": "held for operator approval"}
    assert new.held and not new.shadowed and new.state == "staged" and new.result is not None
    assert (new.result["policy"], new.result["message"]) == (policy, live_would[policy])
    # The replay is not the session's yet: committing the turn now releases only the original's hold.
    assert [r.call_id for r in firewall.commit("s", 1)] == ([original.call_id] if policy == "on_commit" else [])
    assert new.call_id not in adapter.fired
    report = firewall.finish_replay(branch, commit=True)
    assert report.held == [new.call_id] and report.staged == []
    if policy == "on_commit":
        assert [r.state for r in firewall.commit("s", 1)] == ["done"]
    else:
        assert firewall.release(new.call_id).state == "done"
    assert adapter.fired[-1] == new.call_id


def test_an_abandoned_replay_drops_what_it_held(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall({"notify": "on_commit"})
    branch = firewall.open_replay("lin")
    new = firewall.call("s", "lin", "notify", {"text": "b"}, mode="shadow", turn=3)
    report = firewall.finish_replay(branch, commit=False)
    assert report.held == [new.call_id] and firewall.outbox() == []
    record = firewall.ledger.get(new.call_id)
    assert record is not None and record.state == "dropped"
    assert firewall.commit("s", 3) == [] and adapter.fired == []
    firewall.open_replay("lin")
    with pytest.raises(InvalidArguments):  # held for its turn's commit, so it needs a turn, replay or not
        firewall.call("s", "lin", "notify", {"text": "c"}, mode="shadow")


def test_an_open_replays_holds_wait_for_the_replay_to_finish(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall({"notify": "on_commit"})
    original = firewall.call("s", "lin", "notify", {"text": "a"}, turn=2)
    branch = firewall.open_replay("lin")
    new = firewall.call("s", "lin", "notify", {"text": "b"}, mode="shadow", turn=2)
    # Released now, an effect of a replay that may yet be abandoned could not be taken back.
    for decide in (firewall.release, firewall.drop):
        with pytest.raises(BranchStateError, match="still open"):
            decide(new.call_id)
    assert firewall.drop_turn("s", 2) == [original.call_id]
    record = firewall.ledger.get(new.call_id)
    assert record is not None and record.state == "staged" and adapter.fired == []
    assert [h.call_id for h in firewall.outbox("s") if firewall.in_open_replay(h)] == [new.call_id]
    firewall.finish_replay(branch, commit=True)
    assert not any(firewall.in_open_replay(h) for h in firewall.outbox("s"))
    assert [r.state for r in firewall.commit("s", 2)] == ["done"] and adapter.fired == [new.call_id]


def test_an_abandoned_replay_drops_what_it_held_for_an_operator(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall({"notify": "manual"})
    branch = firewall.open_replay("lin")
    new = firewall.call("s", "lin", "notify", {"text": "b"}, mode="shadow", turn=1)
    report = firewall.finish_replay(branch, commit=False)
    assert report.branch == branch and not report.committed
    assert firewall.replay_status(branch) == "abandoned"
    assert report.held == [new.call_id] and firewall.outbox() == [] and adapter.fired == []
    firewall.open_replay("lin")  # nothing is left open


def test_a_ledger_from_before_simulated_answers_gains_the_column(db_path: Path) -> None:
    old = sqlite3.connect(db_path)
    old.execute("CREATE TABLE ledger_calls (call_id TEXT PRIMARY KEY, state TEXT, result TEXT)")
    old.commit()
    old.close()
    db = Database(str(db_path))  # the migrations bring an old ledger up to date
    Ledger(db)
    assert "simulated" in {r["name"] for r in db.rows("PRAGMA table_info(ledger_calls)")}
    db.close()


def test_replay_from_turn_inherits_the_prefix(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    early = firewall.call("s", "lin", "notify", {"text": "same"}, turn=1)
    late = firewall.call("s", "lin", "notify", {"text": "same"}, turn=5)
    branch = firewall.open_replay("lin", from_turn=3)
    # Turn 1 is not replayed; the replay's first 'same' is the second occurrence, i.e. `late`.
    replayed = firewall.call("s", "lin", "notify", {"text": "same"}, mode="shadow", turn=5)
    assert replayed.call_id == late.call_id and replayed.deduplicated
    assert firewall.finish_replay(branch, commit=True).orphaned == []
    assert [
        r.state for r in (firewall.ledger.get(early.call_id), firewall.ledger.get(late.call_id)) if r
    ] == [
        "done",
        "done",
    ]
    assert len(adapter.fired) == 2


def test_concurrent_calls_fire_once_per_identity(make_firewall: Callable[..., Any]) -> None:
    firewall, adapter = make_firewall()
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            firewall.call("s", "lin", "notify", {"text": f"m{i % 10}"}, call_id=f"c{i % 10}")
        except InvalidState:
            pass  # a retry racing its own first attempt is refused, never fired twice
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(adapter.fired) == sorted(set(adapter.fired)) and len(adapter.fired) == 10
    assert firewall.stats().states == {"done": 10}
