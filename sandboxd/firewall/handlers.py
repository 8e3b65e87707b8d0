"""The daemon's requests that the firewall serves: external calls, turn commits, the outbox, the ledger.

External tools never reach a container: `sandboxd.calls.Calls.call` hands them here, and they run in the
daemon through the effect adapters. Sandbox calls and ledgered effects are listed together for the
operator, oldest first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, get_args

import msgspec

from sandboxd import protocol as p
from sandboxd.auth import Peer
from sandboxd.branch import Branch
from sandboxd.errors import BranchStateError, HeldByClosedSession, InvalidState
from sandboxd.firewall.approvals import Describer
from sandboxd.firewall.ledger import CallRecord, CallState
from sandboxd.firewall.service import Firewall, FirewallResult


class FirewallHandlers:
    """Handlers for the firewall's requests, dispatched by the service."""

    def __init__(self, firewall: Firewall, check_open: Callable[[str], object], known: Callable[[str], Any],
                 sandbox_calls: Callable[[str | None], list[p.LedgerCall]],
                 holds_effects: Callable[[str], bool] = lambda _sid: False) -> None:
        self.firewall = firewall
        self.check_open = check_open
        self.known = known
        """A session's row (its `state` is read), or UnknownSession."""
        self.sandbox_calls = sandbox_calls
        """A session's sandbox calls; None: every session's."""
        ledger = firewall.ledger
        self.describe = Describer(firewall.target, ledger.decisions, ledger.agent_ids)
        self.holds_effects = holds_effects
        """Whether a session's effects are all held for release (a fork's, by default)."""

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        """Request type -> handler, for the service's dispatch table."""
        return {
            p.CommitTurnRequest: self.commit_turn,
            p.DropTurnRequest: self.drop_turn,
            p.ListCallsRequest: self.list_calls,
            p.OutboxRequest: self.outbox,
            p.CompensateRequest: self.compensate,
        }

    def peer_handlers(self) -> dict[type[Any], Callable[[Any, Peer], p.Response]]:
        """The operator's decisions, recorded with who made them."""
        return {
            p.ReleaseCallRequest: self.release,
            p.DropCallRequest: self.drop,
            p.ResolveCallRequest: self.resolve,
        }

    def serves(self, tool: str) -> bool:
        return any(m.name == tool for m in self.firewall.manifests())

    def call(self, req: p.CallRequest, lineage: str) -> p.CallResult:
        """An external (or http_get) call, through the ledger."""
        outcome = self.firewall.call(req.session_id, lineage, req.tool, req.args, call_id=req.call_id,
                                     mode=req.mode, turn=req.turn, clock=req.clock, branch=req.branch,
                                     hold=self.holds_effects(req.session_id))
        return call_result(outcome)

    def commit_turn(self, req: p.CommitTurnRequest) -> p.CommitTurnResponse:
        self.check_open(req.session_id)
        released = [call_result(r) for r in self.firewall.commit(req.session_id, req.turn)]
        return p.CommitTurnResponse(request_id=req.request_id, released=released)

    def drop_turn(self, req: p.DropTurnRequest) -> p.DropTurnResponse:
        self.check_open(req.session_id)
        return p.DropTurnResponse(request_id=req.request_id, dropped=self.firewall.drop_turn(req.session_id, req.turn))

    def list_calls(self, req: p.ListCallsRequest) -> p.ListCallsResponse:
        if req.session_id is not None:
            self.known(req.session_id)
            records = self.firewall.calls(req.session_id) + self.firewall.compensator.of_session(req.session_id)
        else:
            records = self.firewall.ledger.in_states(get_args(CallState))
        calls = self.sandbox_calls(req.session_id) + [ledger_call(record) for record in records]
        calls.sort(key=lambda c: (c.created_at, c.call_id))
        return p.ListCallsResponse(request_id=req.request_id, calls=self.describe.calls(calls))

    def outbox(self, req: p.OutboxRequest) -> p.OutboxResponse:
        if req.session_id is not None:
            self.known(req.session_id)  # a mistyped session is an error, not an empty outbox
        states: dict[str, str] = {}
        held = []
        for h in self.firewall.outbox(req.session_id):
            state = states.setdefault(h.session_id, self.known(h.session_id).state)
            held.append(p.HeldCall(call_id=h.call_id, session_id=h.session_id, tool=h.tool, policy=h.policy,
                                   turn=h.turn, held_at=h.held_at, args=h.args,
                                   replay=h.branch if self.firewall.in_open_replay(h) else None,
                                   session_state="open" if state == "open" else "closed"))
        unknown = [ledger_call(r) for r in self.firewall.ledger.in_states(("unknown",))
                   if req.session_id is None or r.session_id == req.session_id]
        return p.OutboxResponse(request_id=req.request_id, held=self.describe.held(held),
                                unknown=self.describe.calls(unknown))

    def release(self, req: p.ReleaseCallRequest, peer: Peer) -> p.ReleaseCallResponse:
        record = self.firewall.ledger.get(req.call_id)
        if record is None:
            raise InvalidState(req.call_id, "absent", "staged", "no such call in the ledger")
        if not req.force and record.state == "staged" and self.known(record.session_id).state != "open":
            raise HeldByClosedSession(req.call_id, record.session_id)
        result = self.firewall.release(req.call_id, actor=peer.key, reason=req.reason)
        return p.ReleaseCallResponse(request_id=req.request_id, result=call_result(result))

    def drop(self, req: p.DropCallRequest, peer: Peer) -> p.DropCallResponse:
        self.firewall.drop(req.call_id, actor=peer.key, reason=req.reason)
        return p.DropCallResponse(request_id=req.request_id, call_id=req.call_id)

    def compensate(self, req: p.CompensateRequest) -> p.CompensateResponse:
        return p.CompensateResponse(request_id=req.request_id, call_id=req.call_id,
                                    result=call_result(self.firewall.compensate(req.call_id)))

    def resolve(self, req: p.ResolveCallRequest, peer: Peer) -> p.ResolveCallResponse:
        record = self.firewall.resolve(req.call_id, req.outcome, req.result, actor=peer.key, reason=req.reason)
        return p.ResolveCallResponse(request_id=req.request_id, call=self.describe.calls([ledger_call(record)])[0])


class FirewallParticipant:
    """The ledger as a branch participant: a branch's shadow calls count in a replay branch of the ledger.

    It is the last participant (see `sandboxd.branch.Branches`): committing makes the branch the ledger's
    live one, which ends the operation."""

    name = "firewall"

    def __init__(self, firewall: Firewall) -> None:
        self.firewall = firewall

    def begin(self, branch: Branch) -> None:
        # A replay re-decides whole turns; a rollback keeps exactly what was reached before its point.
        until = branch.splice.created_at if branch.kind == "rollback" else None
        self.firewall.begin_replay(branch.id, branch.session_id, from_turn=branch.from_turn, until=until)

    def commit(self, branch: Branch) -> dict[str, Any]:
        """Orphaned, dropped, unresolved, staged and held calls of the replay (nothing once it is live)."""
        if self.firewall.replay_status(branch.id) not in ("open", "committing"):
            return {}
        report = self.firewall.finish_replay(branch.id, commit=True)
        return msgspec.to_builtins(report)

    def abandon(self, branch: Branch) -> None:
        if self.firewall.replay_status(branch.id) not in ("open", "committing"):
            return
        try:
            self.firewall.finish_replay(branch.id, commit=False)
        except BranchStateError:
            pass  # opened by the operation but never attached to the ledger (a crash in between): nothing to undo


def result_text(data: dict[str, Any] | None) -> str:
    """The text the agent reads for an effect's data: a world tool's `output`, else the data as JSON.

    Non-ASCII characters stay as they are (a model reads `Ü`, not an escape of it)."""
    if data is None:
        return ""
    if isinstance(data.get("output"), str):
        return str(data["output"])
    return json.dumps(data, sort_keys=True, ensure_ascii=False)


def call_result(outcome: FirewallResult) -> p.CallResult:
    """A firewall outcome as the CallResult every tool returns; the effect's data doubles as stdout."""
    data = outcome.result
    failed = outcome.error is not None
    return p.CallResult(
        call_id=outcome.call_id, tool=outcome.tool, exit_code=1 if failed else 0,
        stdout=result_text(data),
        stderr=outcome.error or "", state=outcome.state, data=data, deduplicated=outcome.deduplicated,
        shadowed=outcome.shadowed, held=outcome.held, replayed=outcome.deduplicated, simulated=outcome.simulated,
    )


def ledger_call(record: CallRecord) -> p.LedgerCall:
    return p.LedgerCall(
        call_id=record.call_id, session_id=record.session_id, tool=record.tool, effect="external",
        state=record.state, args=record.args, result=record.result, simulated=record.simulated,
        error=record.error, turn=record.turn,
        occurrence=record.occurrence, policy=record.policy, created_at=record.created_at,
        updated_at=record.updated_at,
    )

