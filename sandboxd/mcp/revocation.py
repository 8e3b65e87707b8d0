"""An MCP session's half of a revocation: splice at the checkpoint, keep nothing of the suffix, tell the client.

The agent runtime replays the suffix: it decodes its turns again on the counterfactual stream. An MCP
server cannot: the model and its context live in the client, out of sight. Replaying the recorded calls
instead would repeat decisions taken by a model that had read the revoked input, which is exactly what
must not happen. So the MCP server takes the revocation the way Algorithm 1 runs on a graph whose whole
suffix is tainted (every later call may have been decided on the source): the daemon restores the
sandbox to the splice checkpoint (the source's own call has run, nothing after it) and opens the replay
branch; the server re-records the source's result with the target excised (what the call would have
returned in the counterfactual world) and replays nothing else; the commit discards the suffix, drops
held effects the suffix made and lists fired ones as orphaned.

What the server cannot do is edit the client's context. The notice it hands the client (in front of the
next tool result, and in the report's `not_erased`) names every call and result the client must forget
and the source's result as it now reads; the report's leak scan covers the daemon and the sandbox, never
the client. Only artifact and call ids go into the report: the daemon stores it, and it must not carry
the target back in.

`sandboxd rollback` (a branch operation without a counterfactual input) takes the same path with no
result to re-record: `splice_to` is the seam it calls.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from sandboxd import protocol as p
from sandboxd.client import Client
from sandboxd.mcp.provenance import OBSERVATION_PREFIX, CallRecorder
from sandboxd.mcp.tools import Outcome

log = logging.getLogger("sandboxd.mcp")

T = TypeVar("T")


class AnsweredCall(Protocol):
    """A call of the session a retry may be answered from (`sandboxd.mcp.session.PendingCall`)."""

    call_artifact: str
    outcome: Outcome | None


class McpSession(Protocol):
    """What a revocation needs of an MCP session (`sandboxd.mcp.session.McpSession`, which calls in here:
    named by what it offers, not imported, so the two modules do not import each other)."""

    session_id: str
    recorder: CallRecorder

    @property
    def pending(self) -> Mapping[str, AnsweredCall]: ...

    def daemon(self, fn: Callable[[Client], T]) -> Awaitable[T]: ...

    def discard(self, artifact_ids: list[str]) -> list[str]: ...


def splice_to(session: McpSession, checkpoint: p.CheckpointRecord) -> tuple[list[str], list[str]]:
    """Put the session's record back at `checkpoint`; returns (discarded artifact ids, their agent call ids)."""
    discarded = session.recorder.splice(checkpoint)
    return discarded, session.discard(discarded)


async def take_revocation(session: McpSession, info: p.RevocationInfo) -> dict[str, Any]:
    """Apply one pending revocation (the caller holds the session's call lock); returns the client's notice."""
    plan = await session.daemon(lambda c: c.begin_revocation(info.revocation_id))
    discarded, agent_ids = splice_to(session, plan.checkpoint)
    refed: str | None = None
    if plan.source_call is not None and plan.source_call in session.recorder.recorded:
        observation = session.recorder.observation(
            plan.source_call, plan.source_result or "", {"revoked_by": info.revocation_id}, branch=plan.branch)
        await session.daemon(lambda c: c.record_artifacts(session.session_id, [observation], branch=plan.branch))
        refed = observation.artifact_id
        _sanitize_answer(session, plan.source_call, plan.source_result or "", refed)
    forget = [aid for aid in discarded if aid != refed]
    notes = [f"the MCP client's context is out of sandboxd's sight: the client must forget the results and calls "
             f"{', '.join(forget) or '(none)'} and read {refed or info.source} as it is now (the revoked part cut "
             "out); the leak scan did not cover the client"]
    report = await session.daemon(lambda c: c.commit_revocation(p.CommitRevocationRequest(
        request_id=c._rid(), revocation_id=info.revocation_id, tokens=p.TokenCounts(),
        transitions_replayed=1 if refed else 0, final_step=session.recorder.step, answer=None,
        call_counts={"reexecuted": 0, "reused": 0, "shadowed": 0, "deduplicated": 0},
        agent_notes=notes)))
    log.warning("revocation %s of %s taken: %d artifacts discarded, sandbox restored to %s", info.revocation_id,
                info.source, len(discarded), plan.checkpoint.checkpoint_id)
    return _notice(info, report, forget, refed, plan.source_result if refed else None, agent_ids)


def _sanitize_answer(session: McpSession, call_artifact: str, text: str, observation: str) -> None:
    """A retry of the source's call is answered as the counterfactual call was, never with the target."""
    for call in session.pending.values():
        if call.call_artifact == call_artifact and call.outcome is not None:
            structured = {k: v for k, v in call.outcome.structured.items() if k not in ("data", "stderr")}
            call.outcome = replace(call.outcome, text=text, structured=structured, observation=observation)


def _notice(info: p.RevocationInfo, report: p.RevocationReport, forget: list[str], refed: str | None,
            source_text: str | None, agent_ids: list[str]) -> dict[str, Any]:
    observations = [aid for aid in forget if aid.startswith(OBSERVATION_PREFIX)]
    text = (f"[sandboxd] Revocation {info.revocation_id}: the tool result {info.source} was revoked. The sandbox "
            f"was restored to before it was read, and {len(forget)} later calls and results were discarded "
            f"({', '.join(forget) or 'none'}). Forget them and anything you concluded from them")
    if refed is not None:
        text += f"; the result {refed} now reads: {source_text!r}"
    if report.calls.get("orphaned"):
        text += f". {report.calls['orphaned']} external effects had already happened and cannot be undone"
    return {"text": text + ".", "revocation_id": info.revocation_id, "source": info.source, "forget": forget,
            "forget_results": observations, "result_now": refed, "orphaned": report.calls.get("orphaned", 0),
            "dropped_calls": agent_ids, "report": {"tau": report.tau, "T": report.T, "checkpoint": report.checkpoint,
                                                   "not_erased": report.not_erased}}
