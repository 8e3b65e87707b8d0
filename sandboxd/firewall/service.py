"""`Firewall`: the facade the daemon calls, from worker threads, for every `external` (and HTTP read) tool.

Call identity. The ledger id of a call is `derive_call_id(lineage, tool, intent key, k)`, where k is
the occurrence index of that intent in the caller's *branch* of the lineage. The firewall keeps the
counters itself (persisted in `ledger_reached`), so callers never pass k:
- no agent call id: each call is a new occurrence, so two identical sends are two calls;
- a new agent call id: also a new occurrence, and the id is remembered as an alias of the call;
- an agent call id already used in this branch: a retry of that call, never a new occurrence; a
  different intent under it is `CALL_ID_CONFLICT`.

Replay branches. Live calls count in the lineage's live branch. `begin_replay(branch, lineage)` opens a replay
branch whose counters start from zero (or, with `from_turn`, inherit the calls of earlier turns, which
the replay does not re-run); shadow-mode calls count there. Because k restarts, the replay's k-th
identical intent derives the same id as the original's, so it is answered from the ledger instead of
firing. `finish_replay(branch, commit=True)` makes the replay the live branch and marks the original's
fired calls it never reached `orphaned`; `commit=False` discards what the replay staged or held.

A replay's new call (one the original never made) never fires during the replay. What the live run
would have held (`on_commit`, `manual`) the replay holds the same way, for the same release: its turn's
commit once the replay is committed, or an operator. While the replay is open nothing else decides its
holds (a turn's commit or drop passes over them, `release` and `drop` refuse), since an abandoned
replay's effects must never have fired. What the live run would have fired at once
(`immediate`) is staged for an operator; if the adapter keeps a simulated far side for the replay
(AgentDojo's shadow world), the agent reads that simulation's answer (`simulated`, kept in the ledger
so a retry reads it again without simulating twice), so the replay goes on as the counterfactual run
would have, while nothing real happened.

Timeouts. A timeout before the request left (connect) leaves the call `failed`, free to retry; a
timeout after it left leaves it `unknown`, because the far side may have acted on it: honest beats
optimistic when the effect is an email or a payment. Either way the caller gets `ADAPTER_TIMEOUT`.

Rejected approaches, so nobody retries them: keying the ledger on the agent's call id (a replay
re-decodes calls under fresh ids and would fire everything again); keeping occurrence counters in
memory (a restart would reset k, and the next legitimately identical send would be answered from the
first one's record instead of being sent); holding the lock across the adapter call (one slow SMTP
server would stall every session's tools).

Why one module of this size: a call's identity, its decision and the replay branches it is counted in
are one state machine over one lock and one set of occurrence counters (`_identify` -> `_decide` ->
`_carry_out`, and `begin_replay`/`finish_replay` that reset and commit those counters). Split apart,
each half would need the other's lock and counters, which is the coupling the facade exists to hide;
the ledger (storage) and the adapters (the outside world) are already modules of their own.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import msgspec

from sandboxd.branch import BranchRow, new_branch_id
from sandboxd.db import Database
from sandboxd.errors import (
    AdapterTimeout,
    BranchStateError,
    CallIdConflict,
    CallUnknown,
    EffectFailed,
    InvalidArguments,
    InvalidState,
    SandboxdError,
    UnknownTool,
)
from sandboxd.firewall.adapters import EffectAdapter, EffectNotDelivered, EffectOutcomeUnknown, build_adapters
from sandboxd.firewall.compensation import Compensator
from sandboxd.firewall.config import FirewallConfig
from sandboxd.firewall.intent import derive_call_id, intent_key
from sandboxd.firewall.ledger import IN_FLIGHT_STATES, CallRecord, CallState, HeldEffect, HoldPolicy, Ledger
from sandboxd.protocol import ToolManifest

Mode = Literal["live", "shadow"]


class FirewallResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What one external call came to: fired, answered from the ledger, held or shadowed."""

    call_id: str
    tool: str
    state: str
    result: dict[str, Any] | None = None
    deduplicated: bool = False
    shadowed: bool = False
    held: bool = False
    simulated: bool = False
    """A shadowed call whose `result` is the replay's simulated far side's answer: nothing was sent."""
    occurrence: int | None = None
    agent_call_id: str | None = None
    error_code: str | None = None
    error: str | None = None


class ReplayReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What finishing a replay branch did to the calls of the branch it replaced."""

    branch: str
    lineage: str
    committed: bool
    orphaned: list[str] = []
    """Fired in the replaced branch, never reached by the replay: they need compensation."""
    dropped: list[str] = []
    """Held in the replaced branch, never reached: they never fired and now never will."""
    unresolved: list[str] = []
    """Unknown in the replaced branch, never reached: resolve them, they may have fired."""
    staged: list[str] = []
    """Staged by the replay: waiting for `release` (committed) or now `shadowed` (abandoned)."""
    held: list[str] = []
    """The replay's own calls to held tools: waiting for their turn's commit or an operator (committed), or
    now `dropped` (abandoned)."""


class FirewallStats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Counters since this process started, and how many ledger calls sit in each state."""

    counters: dict[str, int]
    states: dict[str, int]


@dataclass(frozen=True)
class _Ask:
    session_id: str
    lineage: str
    tool: str
    args: dict[str, Any]
    key: str
    intent: Any
    agent_call_id: str | None
    mode: Mode
    turn: int | None
    policy: str
    clock: float | None = None


@dataclass(frozen=True)
class _Plan:
    action: Literal["fire", "answer", "held", "hold", "stage", "refuse"]
    record: CallRecord
    error: SandboxdError | None = None
    retry: bool = False


_RETRYABLE: tuple[CallState, ...] = ("failed", "dropped", "shadowed")
#: statuses of a branch operation that has not finished: its replay is open
_OPEN = ("open", "committing")
_COUNTER_OF_ACTION = {"answer": "deduplicated", "held": "deduplicated", "hold": "held", "stage": "shadowed"}


class Firewall:
    """Thread-safe facade over the adapters and the ledger."""

    def __init__(
        self,
        config: FirewallConfig,
        db: Database,
        *,
        clock: Callable[[], float] = time.time,
        adapters: Sequence[EffectAdapter] | None = None,
        extra: Sequence[EffectAdapter] = (),
    ) -> None:
        if adapters is None:
            built, self._senders = build_adapters(
                config.smtp, config.http, config.webhook, config.adapter_timeout_s
            )
        else:
            built, self._senders = list(adapters), []
        clashes = sorted({a.manifest.name for a in built} & {a.manifest.name for a in extra})
        if clashes:
            raise ValueError(f"tools {clashes} are served twice: by the firewall's adapters and by the world")
        built = [*built, *extra]
        self._config = config
        self._adapters = {adapter.manifest.name: adapter for adapter in built}
        for tool in config.release:
            if tool not in self._adapters or self._adapters[tool].manifest.effect != "external":
                raise ValueError(f"release policy for {tool!r}, which is not an enabled external tool")
        self._validators = {
            name: jsonschema.Draft202012Validator(adapter.manifest.parameters)
            for name, adapter in self._adapters.items()
        }
        self._lock = db.lock
        self._ledger = Ledger(db, clock)
        # ids being fired right now, guarded by `lock`: this process's (and, on a shared PostgreSQL
        # database, every live daemon's: a call another daemon fires is not "in flight with no owner")
        self._in_flight: set[str] = db.in_flight()
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self.compensator = Compensator(self._ledger, self._adapter, db.lock)

    @property
    def ledger(self) -> Ledger:
        """The underlying ledger (for operator views and tests)."""
        return self._ledger

    def manifests(self) -> list[ToolManifest]:
        """Manifests of every tool the firewall serves."""
        return [adapter.manifest for adapter in self._adapters.values()]

    def close(self) -> None:
        """Close the adapters' network clients."""
        for adapter in self._adapters.values():
            adapter.close()
        for sender in self._senders:
            sender.close()

    # Calls ------------------------------------------------------------------------------------

    def call(
        self,
        session_id: str,
        lineage: str,
        tool: str,
        args: dict[str, Any],
        call_id: str | None = None,
        mode: Mode = "live",
        turn: int | None = None,
        clock: float | None = None,
        branch: str = "",
        hold: bool = False,
    ) -> FirewallResult:
        """Run one call through the firewall: validate, record, then fire, answer, hold or shadow it.

        `branch` names the agent's replay branch, for adapters that hold a shadow world for it. With `hold`
        (a fork's session) what would fire at once is held for an operator instead.
        """
        try:
            adapter = self._adapter(tool)
            self._check_args(adapter, args)
            adapter.check_session(session_id)
            if adapter.manifest.effect != "external":
                return self._read(adapter, session_id, clock, args, call_id, branch)
            ask = self._ask(adapter, session_id, lineage, args, call_id, mode, turn, clock, hold)
            plan = self._plan(ask)
            outcome = self._carry_out(plan, adapter, ask)
            # Live, this call would have reached the world at once; held, it would not have yet. A retry
            # was simulated when it first came, and a simulated world must not take an effect twice.
            if mode == "shadow" and branch and ask.policy == "shadow" and not plan.retry:
                simulated = adapter.shadow(session_id, branch, clock, args)
                if simulated is not None and plan.action == "stage":
                    with self._ledger.transaction():
                        self._ledger.set_simulated(plan.record.call_id, simulated)
                    outcome = msgspec.structs.replace(outcome, result=simulated, simulated=True)
            return outcome
        except SandboxdError as exc:
            self._count(f"error.{exc.code.value}")
            raise

    def _adapter(self, tool: str) -> EffectAdapter:
        adapter = self._adapters.get(tool)
        if adapter is None:
            raise UnknownTool(tool, sorted(self._adapters))
        return adapter

    def _check_args(self, adapter: EffectAdapter, args: dict[str, Any]) -> None:
        validator = self._validators[adapter.manifest.name]
        error = jsonschema.exceptions.best_match(validator.iter_errors(args))
        if error is not None:
            raise InvalidArguments(adapter.manifest.name, error.message, error.json_path)
        adapter.validate(args)

    def _ask(
        self,
        adapter: EffectAdapter,
        session_id: str,
        lineage: str,
        args: dict[str, Any],
        call_id: str | None,
        mode: Mode,
        turn: int | None,
        clock: float | None = None,
        hold: bool = False,
    ) -> _Ask:
        tool = adapter.manifest.name
        if mode not in ("live", "shadow"):
            raise InvalidArguments(tool, f"mode must be live or shadow, not {mode!r}", "mode")
        configured = self._config.policy(tool)
        if hold and configured == "immediate":
            configured = "manual"
        # A replay never fires a new call: what would have fired at once is staged for an operator.
        policy = "shadow" if mode == "shadow" and configured == "immediate" else configured
        if policy == "on_commit" and turn is None:
            raise InvalidArguments(tool, "an on_commit tool needs the turn the call belongs to", "turn")
        try:
            key, canonical = intent_key(tool, adapter.intent(args))
        except ValueError as exc:
            raise InvalidArguments(tool, f"intent has no canonical form: {exc}") from exc
        # json, not msgspec: big integers must survive the round trip exactly.
        return _Ask(session_id, lineage, tool, args, key, json.loads(canonical), call_id, mode, turn, policy, clock)

    def _plan(self, ask: _Ask) -> _Plan:
        """Decide, in one durable transaction, what this call is and what happens to it."""
        with self._ledger.transaction():
            branch = self._branch_for(ask.lineage, ask.mode)
            record, is_new, retry = self._identify(ask, branch)
            plan = self._decide(ask, branch, record, is_new)
            if plan.action == "fire":
                self._in_flight.add(record.call_id)
            fresh = self._ledger.get(record.call_id)
            return _Plan(plan.action, fresh or record, plan.error, retry)

    def _identify(self, ask: _Ask, branch: str) -> tuple[CallRecord, bool, bool]:
        """The ledger call this ask names, whether it is new and whether it retries an agent call id;
        marks a new occurrence reached in `branch`."""
        if ask.agent_call_id is not None:
            known = self._ledger.alias(branch, ask.agent_call_id)
            if known is not None:
                record = self._ledger.get(known)
                assert record is not None, f"alias {ask.agent_call_id} points at missing call {known}"
                if record.intent_key != ask.key:
                    raise CallIdConflict(
                        ask.agent_call_id, f"for a different intent ({record.tool} {record.intent})"
                    )
                self._count("retries")
                return record, False, True
        occurrence = self._ledger.next_occurrence(branch, ask.key)
        call_id = derive_call_id(ask.lineage, ask.tool, ask.key, occurrence)
        existing = self._ledger.get(call_id)
        record = existing or CallRecord(
            call_id=call_id,
            tool=ask.tool,
            state="intent",
            session_id=ask.session_id,
            lineage=ask.lineage,
            branch=branch,
            occurrence=occurrence,
            intent_key=ask.key,
            intent=ask.intent,
            args=ask.args,
            policy=ask.policy,
            turn=ask.turn,
        )
        self._ledger.mark_reached(branch, record, ask.session_id, ask.turn, ask.agent_call_id)
        return record, existing is None, False

    def _decide(self, ask: _Ask, branch: str, record: CallRecord, is_new: bool) -> _Plan:
        call_id, state = record.call_id, record.state
        # An orphaned effect an operator compensated is undone: reached again, it is made again.
        undone = state == "orphaned" and not is_new and self.compensator.undone(call_id)
        if not is_new and not undone:
            if state in ("done", "orphaned"):
                if state == "orphaned":
                    self._ledger.transition(call_id, "done", ("orphaned",), note="reached again")
                return _Plan("answer", record)
            if state == "staged":
                return _Plan("held", record)
            if state == "unknown":
                return _Plan("refuse", record, CallUnknown(call_id))
            if state in IN_FLIGHT_STATES:
                return self._in_flight_plan(record)
        # New, or it certainly never happened (failed, dropped, shadowed): apply the policy afresh.
        target: CallState = "intent" if ask.policy == "immediate" else "staged"
        if is_new:
            self._ledger.insert_call(msgspec.structs.replace(record, state=target, policy=ask.policy))
        else:
            note = "reached again after its compensation" if undone else "reached again"
            self._ledger.transition(call_id, target, (*_RETRYABLE, "orphaned"), note=note, policy=ask.policy)
            self._ledger.set_simulated(call_id, None)
        if target == "intent":
            return _Plan("fire", record)
        self._ledger.hold(record, branch, ask.session_id, ask.turn, _hold_policy(ask.policy))
        return _Plan("stage" if ask.policy == "shadow" else "hold", record)

    def _in_flight_plan(self, record: CallRecord) -> _Plan:
        if record.call_id in self._in_flight:
            error = InvalidState(record.call_id, record.state, "done", "another request is firing it now")
            return _Plan("refuse", record, error)
        # Left in flight by a process that is gone (recover() was not run): it may have fired.
        self._ledger.transition(
            record.call_id, "unknown", IN_FLIGHT_STATES, note="found in flight with no owner"
        )
        self._ledger.set_recovered_from(record.call_id, record.state)
        self._count("recovered")
        return _Plan("refuse", record, CallUnknown(record.call_id))

    def _carry_out(self, plan: _Plan, adapter: EffectAdapter, ask: _Ask) -> FirewallResult:
        record = plan.record
        if plan.action == "refuse":
            assert plan.error is not None
            raise plan.error
        if plan.action == "fire":
            return self._fire(record, adapter, ask.args, "intent", ask.agent_call_id, ask.clock)
        self._count(_COUNTER_OF_ACTION[plan.action])
        if plan.action in ("hold", "stage"):
            self._count("staged")
        held = plan.action in ("held", "hold") and record.policy != "shadow"
        shadowed = plan.action == "stage" or (plan.action == "held" and record.policy == "shadow")
        # A retry of a staged call reads what its first try read: the simulation, when there was one.
        simulated = shadowed and plan.action == "held" and record.simulated is not None
        if plan.action == "answer":
            result = record.result
        else:
            result = record.simulated if simulated else _hold_payload(record)
        return FirewallResult(
            call_id=record.call_id,
            tool=record.tool,
            state=record.state,
            result=result,
            deduplicated=plan.action in ("answer", "held"),
            shadowed=shadowed,
            held=held,
            simulated=simulated,
            occurrence=record.occurrence,
            agent_call_id=ask.agent_call_id,
        )

    def _fire(
        self,
        record: CallRecord,
        adapter: EffectAdapter,
        args: dict[str, Any],
        from_state: CallState,
        agent_call_id: str | None = None,
        clock: float | None = None,
    ) -> FirewallResult:
        """Fire an effect whose intent is already durable; settle it as done, failed or unknown."""
        call_id = record.call_id
        try:
            # `fired` marks the hand-off; recovery treats it like `intent`, but an operator reading
            # the ledger learns that the adapter was reached.
            with self._ledger.transaction():
                self._ledger.transition(call_id, "fired", (from_state,), count_attempt=True)
            try:
                # A released effect fires at the instant its call was made, as far as the world can tell.
                when = clock if clock is not None else record.created_at or None
                result = adapter.fire_in(record.session_id, when, args, call_id)
            except (EffectNotDelivered, EffectOutcomeUnknown) as exc:
                state: CallState = "failed" if isinstance(exc, EffectNotDelivered) else "unknown"
                self._settle(call_id, state, error=exc.reason)
                if exc.timed_out:
                    raise AdapterTimeout(call_id, adapter.timeout_s, state) from exc
                raise EffectFailed(call_id, exc.reason, state) from exc
            except BaseException as exc:
                # An adapter bug after the hand-off: it may have acted, so only `unknown` is honest.
                self._settle(call_id, "unknown", error=f"adapter raised {type(exc).__name__}: {exc}")
                raise
            self._settle(call_id, "done", result=result)
        finally:
            with self._lock:
                self._in_flight.discard(call_id)
        self._count("fired")
        return FirewallResult(
            call_id=call_id,
            tool=record.tool,
            state="done",
            result=result,
            occurrence=record.occurrence,
            agent_call_id=agent_call_id,
        )

    def _settle(
        self, call_id: str, state: CallState, result: dict[str, Any] | None = None, error: str | None = None
    ) -> None:
        with self._ledger.transaction():
            self._ledger.transition(call_id, state, ("fired",), result=result, error=error)
        self._count(state)

    def _read(
        self,
        adapter: EffectAdapter,
        session_id: str,
        clock: float | None,
        args: dict[str, Any],
        call_id: str | None,
        branch: str = "",
    ) -> FirewallResult:
        """Reads are not ledgered: a replay re-executes them (the allowlist was checked already)."""
        tool = adapter.manifest.name
        read_id = call_id or "rd-" + intent_key(tool, adapter.intent(args))[0][:24]
        try:
            result = adapter.fire_in(session_id, clock, args, read_id, branch)
        except (EffectNotDelivered, EffectOutcomeUnknown) as exc:
            self._count("read_errors")
            if exc.timed_out:
                # A read left unanswered was still sent: say so, it is not "before anything was sent".
                sent = isinstance(exc, EffectOutcomeUnknown)
                raise AdapterTimeout(read_id, adapter.timeout_s, "failed", sent=sent) from exc
            raise EffectFailed(read_id, exc.reason) from exc
        self._count("reads")
        return FirewallResult(call_id=read_id, tool=tool, state="done", result=result, agent_call_id=call_id)

    # Held effects and operators ------------------------------------------------------------------

    def commit(self, session_id: str, turn: int) -> list[FirewallResult]:
        """Fire every effect held for this committed turn; failures are reported in the results.

        A replay still open holds its calls back: its turns are not the session's until it is committed.
        """
        results = []
        for held in self._ledger.held(session_id=session_id, turn=turn, policy="on_commit"):
            if self.in_open_replay(held):
                continue
            try:
                results.append(self.release(held.call_id))
            except SandboxdError as exc:
                record = self._ledger.get(held.call_id)
                results.append(
                    FirewallResult(
                        call_id=held.call_id,
                        tool=held.tool,
                        state=record.state if record else "absent",
                        error_code=exc.code.value,
                        error=exc.message,
                    )
                )
        return results

    def drop_turn(self, session_id: str, turn: int) -> list[str]:
        """Drop every effect held for a turn that was revoked before it committed; returns their ids.

        An open replay's holds are its own: finishing the replay decides them.
        """
        with self._ledger.transaction():
            held = [
                effect
                for effect in self._ledger.held(session_id=session_id, turn=turn, policy="on_commit")
                if not self.in_open_replay(effect)
            ]
            for effect in held:
                self._drop(effect.call_id, f"turn {turn} of {session_id} dropped")
        return [effect.call_id for effect in held]

    def in_open_replay(self, effect: HeldEffect) -> bool:
        """Whether an open replay holds this effect (then only finishing the replay decides it)."""
        branch = self._ledger.branch(effect.branch)
        return branch is not None and branch.status in _OPEN

    def _check_decidable(self, call_id: str) -> None:
        """Refuse to release or drop what an open replay holds: the replay may yet be abandoned, and
        a released effect cannot be taken back (inside `transaction()`)."""
        for effect in self._ledger.held(call_id=call_id):
            if self.in_open_replay(effect):
                raise BranchStateError(
                    effect.lineage,
                    effect.branch,
                    f"call {call_id} is held by replay {effect.branch}, which is still open: "
                    "commit or abandon the replay first",
                )

    def target(self, tool: str, args: dict[str, Any]) -> str:
        """Where a call of `tool` with these arguments goes, as its adapter tells ("" for an unknown tool)."""
        adapter = self._adapters.get(tool)
        try:
            return adapter.target(args) if adapter is not None else ""
        except (KeyError, TypeError, AttributeError):  # arguments of an older manifest: say nothing
            return ""

    def release(self, call_id: str, actor: str | None = None, reason: str = "") -> FirewallResult:
        """Fire a staged (held or replay-staged) effect now; `actor` and `reason` are recorded."""
        with self._ledger.transaction():
            record = self._ledger.get(call_id)
            self._check_decidable(call_id)
            self._ledger.transition(call_id, "released", ("staged",), note="released", actor=actor,
                                    reason=reason)
            self._ledger.unhold(call_id)
            self._in_flight.add(call_id)
        assert record is not None
        self._count("released")
        return self._fire(record, self._adapter(record.tool), record.args, "released")

    def drop(self, call_id: str, actor: str | None = None, reason: str = "") -> None:
        """Discard a staged effect without firing it; `actor` and `reason` are recorded."""
        with self._ledger.transaction():
            self._check_decidable(call_id)
            self._drop(call_id, "dropped by operator", actor, reason)

    def _drop(self, call_id: str, note: str, actor: str | None = None, reason: str = "") -> None:
        self._ledger.transition(call_id, "dropped", ("staged",), note=note, actor=actor, reason=reason)
        self._ledger.unhold(call_id)
        self._count("dropped")

    def resolve(
        self, call_id: str, outcome: Literal["done", "failed"], result: dict[str, Any] | None = None,
        actor: str | None = None, reason: str = "",
    ) -> CallRecord:
        """Settle an `unknown` call by an operator's word: it did happen (done) or did not (failed)."""
        if outcome not in ("done", "failed"):
            raise InvalidArguments("resolve", f"outcome must be done or failed, not {outcome!r}", "$.outcome")
        with self._ledger.transaction():
            note = "resolved by operator"
            self._ledger.transition(call_id, outcome, ("unknown",), note=note, result=result, error=None,
                                    actor=actor, reason=reason)
            record = self._ledger.get(call_id)
        self._count("resolved")
        assert record is not None
        return record

    def recover(self) -> list[str]:
        """At daemon start: turn every call left between intent and result into `unknown`; returns ids."""
        turned: list[str] = []
        with self._ledger.transaction():
            for record in self._ledger.in_states(IN_FLIGHT_STATES):
                if record.call_id in self._in_flight:
                    continue
                self._ledger.transition(
                    record.call_id, "unknown", IN_FLIGHT_STATES, note=f"found {record.state} at recovery"
                )
                self._ledger.set_recovered_from(record.call_id, record.state)
                turned.append(record.call_id)
        self._count("recovered", len(turned))
        return turned

    def calls(self, session_id: str) -> list[CallRecord]:
        """Every external call the session reached, oldest first."""
        return self._ledger.calls_of_session(session_id)

    def outbox(self, session_id: str | None = None) -> list[HeldEffect]:
        """Effects waiting for a commit, an operator, or a replay decision."""
        return self._ledger.held(session_id=session_id)

    def stats(self) -> FirewallStats:
        """Counters since start and the ledger's calls per state."""
        with self._counts_lock:
            counters = dict(self._counts)
        return FirewallStats(counters=counters, states=self._ledger.count_by_state())

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    # Replay branches ------------------------------------------------------------------------------

    def _branch_for(self, lineage: str, mode: Mode) -> str:
        if mode == "live":
            return self._live_branch(lineage)
        replay = self._open_replay(lineage)
        if replay is None:
            raise BranchStateError(lineage, None, "shadow mode needs an open replay: a revocation opens one")
        return replay.branch

    def _open_replay(self, lineage: str) -> BranchRow | None:
        return self._ledger.branch_with_status(lineage, "open") or self._ledger.branch_with_status(lineage,
                                                                                                   "committing")

    def _live_branch(self, lineage: str) -> str:
        live = self._ledger.branch_with_status(lineage, "live")
        return live.branch if live else self._ledger.create_branch(lineage, None, "live", None)

    def open_replay(self, lineage: str, from_turn: int | None = None) -> str:
        """Open a replay branch of the lineage and return its id: for a firewall used on its own (the daemon
        opens its replays as branch operations, `sandboxd.branch`, and calls `begin_replay`)."""
        with self._ledger.transaction():
            open_replay = self._open_replay(lineage)
            if open_replay is not None:
                raise BranchStateError(lineage, open_replay.branch, f"replay {open_replay.branch} is still open")
            branch = new_branch_id()
            self._ledger.open_operation(branch, lineage)
        self.begin_replay(branch, lineage, from_turn)
        return branch

    def begin_replay(self, branch: str, lineage: str, from_turn: int | None = None,
                     until: float | None = None) -> None:
        """Make the open branch operation `branch` a replay of the lineage's live branch: shadow calls count
        there. With `from_turn`, the calls of earlier turns count as reached (they are not replayed); with
        `until` (a rollback), the calls reached up to that instant do."""
        with self._ledger.transaction():
            parent = self._live_branch(lineage)
            self._ledger.attach_replay(branch, parent, from_turn if from_turn is not None else 0)
            if until is not None:
                self._ledger.inherit_until(parent, branch, until)
            elif from_turn is not None:
                self._ledger.inherit_prefix(parent, branch, from_turn)

    def after_point(self, lineage: str, at: float) -> list[CallRecord]:
        """The calls the lineage's live branch reached after instant `at` (what a rollback to it passes over)."""
        live = self._ledger.branch_with_status(lineage, "live")
        return [] if live is None else self._ledger.reached_after(live.branch, at)

    def fork_ledger(self, lineage: str, child: str, at: float) -> int:
        """Start the child lineage's live branch from the calls `lineage` reached up to `at` (inside a
        transaction); returns how many it inherited. Retried in the fork, they are answered, never fired."""
        live = self._ledger.branch_with_status(lineage, "live")
        branch = self._ledger.create_branch(child, live.branch if live else None, "live", None)
        return 0 if live is None else self._ledger.inherit_until(live.branch, branch, at, session_id=child)

    def compensate(self, call_id: str) -> FirewallResult:
        """Run the declared compensation of an orphaned call, at most once (see `sandboxd.firewall.compensation`)."""
        record, ran = self.compensator.run(call_id)
        self._count("compensated" if ran else "deduplicated")
        return FirewallResult(call_id=record.call_id, tool=record.tool, state=record.state, result=record.result,
                              deduplicated=not ran, occurrence=record.occurrence)

    def finish_replay(self, branch: str, commit: bool) -> ReplayReport:
        """Commit a replay branch (it becomes live; unreached fired calls are orphaned) or abandon it."""
        with self._ledger.transaction():
            info = self._ledger.branch(branch)
            if info is None or info.status not in _OPEN or info.parent is None:
                status = info.status if info else "absent"
                raise BranchStateError(info.lineage if info else "?", branch, f"branch {branch} is {status}")
            mine = self._ledger.held(branch=branch)
            staged = [held.call_id for held in mine if held.policy == "shadow"]
            kept = [held.call_id for held in mine if held.policy != "shadow"]
            report = ReplayReport(branch=branch, lineage=info.lineage, committed=commit, staged=staged, held=kept)
            if commit:
                self._supersede(info.parent, branch, report)
            else:
                for call_id in staged:
                    self._ledger.transition(call_id, "shadowed", ("staged",), note="replay abandoned")
                    self._ledger.unhold(call_id)
                for call_id in kept:
                    self._drop(call_id, "replay abandoned")
                self._ledger.set_branch_status(branch, "abandoned")
        self._count("orphaned", len(report.orphaned))
        return report

    def replay_status(self, branch: str) -> str | None:
        """The status of a replay branch in the ledger (None: the ledger never heard of it)."""
        info = self._ledger.branch(branch)
        return None if info is None else info.status

    def _supersede(self, parent: str, branch: str, report: ReplayReport) -> None:
        unreached = self._ledger.unreached(parent, branch, ("done", "staged", "unknown"))  # one read, in the lock
        for record in (r for r in unreached if r.state == "done"):
            self._ledger.transition(record.call_id, "orphaned", ("done",), note=f"not reached by {branch}")
            report.orphaned.append(record.call_id)
        for record in (r for r in unreached if r.state == "staged"):
            self._drop(record.call_id, f"not reached by {branch}")
            report.dropped.append(record.call_id)
        report.unresolved.extend(r.call_id for r in unreached if r.state == "unknown")
        self._ledger.set_branch_status(parent, "superseded")
        self._ledger.set_branch_status(branch, "live")

    def orphans(self, lineage: str, branch: str) -> list[str]:
        """Fired calls of the branch `branch` replays that it has not reached (orphaned once committed)."""
        info = self._ledger.branch(branch)
        if info is None or info.lineage != lineage:
            raise BranchStateError(lineage, branch, f"no branch {branch} in this lineage")
        if info.parent is None:
            return []
        states: tuple[CallState, ...] = ("done",) if info.status in _OPEN else ("orphaned",)
        return [record.call_id for record in self._ledger.unreached(info.parent, branch, states)]


def _hold_policy(policy: str) -> HoldPolicy:
    if policy not in ("on_commit", "manual", "shadow"):
        raise AssertionError(f"policy {policy!r} does not hold effects")
    return policy  # type: ignore[return-value]


def _hold_payload(record: CallRecord) -> dict[str, Any]:
    """What the agent sees for an effect that did not fire (yet)."""
    if record.policy == "shadow":
        why = "not sent: the call ran in shadow mode during a replay; an operator may release it"
        return {"status": "shadowed", "call_id": record.call_id, "message": why}
    why = (
        "held until this turn is committed" if record.policy == "on_commit" else "held for operator approval"
    )
    return {"status": "held", "policy": record.policy, "call_id": record.call_id, "message": why}
