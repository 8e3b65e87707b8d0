"""The agent's half of a revocation: take the event, restore the cache, replay the suffix, commit.

The daemon restores the sandbox and hands over the plan (the checkpoint, its context, the sanitized
exogenous inputs that follow it); the agent crops its model cache to the checkpoint's offset
(Lemma 1: nothing before tau is recomputed), then runs its ordinary loop under a replay branch:
recorded inputs are re-fed by prefill, model turns decoded again, tools called again with external
ones in shadow mode. With `certify` (the default) what the record certifies is taken from it instead
(`agent.replay`): reads nothing changed under, and model turns the graph shows independent of z,
prefilled from their recorded tokens. Without it the replay is the paper's B5': the cached prefix
before tau reused, every model turn of the suffix decoded again. What it cost is metered by the
backend and sent with the commit.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from agent.replay import ReplayPlan
from agent.runtime import AgentSession, Exogenous
from sandboxd import protocol as p
from sandboxd.client import RemoteError

log = logging.getLogger("agent")


def apply_pending(session: AgentSession) -> list[p.RevocationReport]:
    """Apply every revocation waiting for this session, oldest first. One the daemon cannot begin is failed
    there, with its reason (`sandboxd revocations`), and the next one is taken."""
    reports = []
    for info in session.client.pending_revocations(session.session_id):
        try:
            reports.append(apply(session, info.revocation_id))
        except RemoteError as exc:
            if exc.wire_code in ("sandbox_unavailable", "session_closed", "unknown_session"):
                raise
            log.warning("revocation %s failed: %s", info.revocation_id, exc)
    return reports


def apply(session: AgentSession, revocation_id: str, *, flush_cache: bool = False,
          certify: bool = True) -> p.RevocationReport:
    """Replay the session from the splice checkpoint without the revoked input; returns the daemon's report.
    `certify` False recomputes everything after the splice (the B5' control)."""
    session.flush()
    plan = session.client.begin_revocation(revocation_id)
    replay = replay_plan(session, plan) if certify else None
    before = session.conversation.meter if session.conversation is not None else session.backend.meter
    session.resume(plan.checkpoint, session.context_of(plan.checkpoint),
                   [Exogenous(type=i.type, text=i.text) for i in plan.inputs])
    session.branch, session.mode = plan.branch, "shadow"
    session.source_result = (plan.source_call, plan.source_result or "") if plan.source_call else None
    session.calls_made = []
    session.replay = replay
    try:
        session.run()
    finally:
        session.branch, session.mode, session.source_result, session.replay = "", "live", None, None
    assert session.conversation is not None
    used = session.conversation.meter - before
    made = session.calls_made
    counts = {
        "reexecuted": sum(1 for r in made if session.effect(r.tool) != "external"),
        "reused": replay.reused if replay else 0,
        "shadowed": sum(1 for r in made if r.shadowed or r.deduplicated),
        "deduplicated": sum(1 for r in made if r.deduplicated),
    }
    final_step = session.step
    notes = _forget_server_cache(session, flush_cache) + _inference_notes(session)
    return session.client.commit_revocation(p.CommitRevocationRequest(
        request_id=session.client._rid(), revocation_id=revocation_id,
        tokens=p.TokenCounts(reused_prefix=plan.checkpoint.token_offset, prefilled=used.prefilled,
                             decoded=used.decoded, full_reset=len(session.conversation),
                             turns_prefilled=replay.prefilled_turns if replay else 0),
        transitions_replayed=final_step - plan.checkpoint.step, final_step=final_step, answer=session.answer(),
        call_counts=counts, agent_notes=notes,
    ))


def replay_plan(session: AgentSession, plan: p.BeginRevocationResponse) -> ReplayPlan:
    """What the replay may take from the record: the original's graph (its live branch, still whole until
    the commit), the daemon's sanitized results, and the tools' effect classes."""
    tools = session.client.tools(session.session_id)
    return ReplayPlan(session.client.graph(session.session_id).artifacts, plan, {t.name: t.effect for t in tools},
                      [t.name for t in tools if t.effect == "read" and not t.open_world])


def _forget_server_cache(session: AgentSession, flush: bool) -> list[str]:
    """A remote radix cache still holds the old suffix: never be served it again, or flush it."""
    backend: Any = session.backend
    if not hasattr(backend, "set_cache_salt"):
        return []  # the local engine's cache was cropped: the old suffix's keys and values are gone
    if flush:
        backend.flush_cache()
        return []
    # Rotated after the replay, not before: the replay itself still reuses the clean prefix; the next
    # request pays one recompute under the new salt.
    backend.set_cache_salt(secrets.token_hex(8))
    return ["SGLang radix-cache entries of the old suffix stay on the server until evicted; the agent "
            "rotated its cache_salt so they are never served again (pass flush_cache to flush them)"]


def _inference_notes(session: AgentSession) -> list[str]:
    """What the replay's agreement with a fresh run rests on: greedy or seeded decoding, and for a server
    whether it ran deterministic inference (batch-invariant kernels) or not."""
    backend: Any = session.backend
    notes = [f"decoding: {'greedy' if session.sampling.greedy else f'sampled, seed {session.sampling.seed}'}"]
    info = getattr(backend, "deterministic_inference", None)
    if callable(info):
        state = info()
        notes.append("server deterministic inference: " + ("on" if state else "off (a replay may diverge from a "
                                                            "fresh run by batch-dependent numerics)" if state is False
                                                            else "unknown (the server does not say)"))
    return notes
