"""One forgetting measurement, shared by bench_revocation and bench_long_sessions: B7, B5' and B5 at one tau.

- B7 (this system): a fresh original session in world A, `client.revoke(session, source=<o_tau>,
  target=None)` (the whole observation is z), then `agent.revocation.apply`: reads and independent
  model turns certified by the record are taken from it (`agent.replay`).
- B5' (the paper's prefix-cached control, run): another fresh original session in world A, the same
  revocation, `apply(..., certify=False)`: the cached prefix before tau is reused (model turns
  included: the live KV cache is cropped to the splice offset), every model turn of the suffix is
  decoded again, every tool re-executed.
- B5 (full reset, the reference): a fresh session in world B run from scratch on o^{-z} (z removed
  from the exogenous texts, `forget=[z]` for tool results) by the same scripted agent: its script is
  the original scenario's, as the replaying agent's is (a task whose text was revoked whole is then
  not recognized by its text in either run).

Tokens are the engine's meter (prefilled and decoded apart); wall is the client's perf_counter time of
`apply()` (B7, B5') and of the whole fresh run (B5; the engine is built outside the timers).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from agent.compare import agreement, final_state
from agent.harness import MailSink, Web, daemon_config, run_session
from agent.models.local import LocalBackend
from agent.revocation import apply
from agent.runtime import AgentSession, exogenous_inputs
from agent.scenario import Scenario
from agent.scenarios import VENDOR_PAGE
from sandboxd import protocol as p
from sandboxd.client import Client
from sandboxd.launcher import DaemonProcess

#: A firewall ledger id: it derives from the session's lineage, so world B's twin of a result has another one.
EFFECT_ID = re.compile(r"fx-[0-9a-f]{8,}")


def engine() -> LocalBackend:
    """The engine run_session would build; built outside the timers."""
    return LocalBackend.tiny(seed=0, max_positions=65536)


class Worlds(msgspec.Struct, kw_only=True):
    """World A (originals, B7 and B5') and world B (the reference), each a daemon with its own mail sink."""

    a: DaemonProcess
    b: DaemonProcess
    web: Web


@contextmanager
def worlds(pages: dict[str, str] | None = None) -> Iterator[Worlds]:
    """Both daemons and the outside world; everything is shut down and removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-bench-forgetting-"))
    mail_a, mail_b, web = MailSink(), MailSink(), Web(pages or {"/vendors": VENDOR_PAGE})
    world_a = DaemonProcess(tmp / "a" / "state", ["--config", str(daemon_config(tmp / "a.toml", mail_a, web))],
                            log=tmp / "a.log")
    world_b = DaemonProcess(tmp / "b" / "state", ["--config", str(daemon_config(tmp / "b.toml", mail_b, web))],
                            log=tmp / "b.log")
    try:
        world_a.start()
        world_b.start()
        yield Worlds(a=world_a, b=world_b, web=web)
    finally:
        world_a.shutdown()
        world_b.shutdown()
        for server in (mail_a, mail_b, web):
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def sources(client: Client, session_id: str) -> dict[int, p.Artifact]:
    """Observation step -> the exogenous artifact consumed there (user input, tool result, seeded memory)."""
    out: dict[int, p.Artifact] = {}
    for a in client.graph(session_id).artifacts:
        if a.type in ("user", "observation") or (a.type == "memory" and not a.parents):
            if a.step in out:
                raise RuntimeError(f"two observations at step {a.step}: {out[a.step].artifact_id}, {a.artifact_id}")
            out[a.step] = a
    return out


def without(scenario: Scenario, target: str) -> Scenario:
    """The scenario's exogenous texts with every occurrence of `target` removed (o^{-z} for user/memory)."""
    return msgspec.structs.replace(
        scenario, memories=[m.replace(target, "") for m in scenario.memories],
        tasks=[msgspec.structs.replace(t, text=t.text.replace(target, "")) for t in scenario.tasks])


def close(client: Client, *agents: AgentSession | None) -> None:
    for agent in agents:
        if agent is not None:
            try:
                client.close_session(agent.session_id)
            except Exception as exc:  # the daemon's shutdown removes what is left; say so
                print(f"   closing {agent.session_id} failed: {exc}", file=sys.stderr)


def _replayed(client: Client, scenario: Scenario, files: dict[str, str], tau: int, policy: str,
              certify: bool, make_engine: Callable[[], LocalBackend]
              ) -> tuple[AgentSession, p.Artifact, p.RevocationReport | None, float]:
    """A fresh original session, o_tau revoked whole, replayed; (agent, source, report, client ms)."""
    agent = run_session(client, scenario, files, engine=make_engine(), context_policy=policy)
    found = sources(client, agent.session_id)
    if tau not in found:
        close(client, agent)
        raise ValueError(f"no user input / tool result / memory at step {tau} (steps: {sorted(found)})")
    source = found[tau]
    if not source.content:
        return agent, source, None, 0.0
    for pending in client.pending_revocations(agent.session_id):
        if pending.source == source.artifact_id:
            # The daemon's detector flagged o_tau during the run (the vendor page) and revokes only what it
            # flagged; the benchmark forgets the whole of it, which the daemon refuses while that one waits.
            client.cancel_revocation(pending.revocation_id, "the benchmark revokes the whole observation")
    revocation = client.revoke(agent.session_id, source=source.artifact_id, target=None)
    started = time.perf_counter()
    report = apply(agent, revocation.revocation.revocation_id, certify=certify)
    return agent, source, report, (time.perf_counter() - started) * 1000


def _tokens(prefix: str, report: p.RevocationReport, ms: float) -> dict[str, Any]:
    return {f"{prefix}_recomputed": report.tokens.recomputed, f"{prefix}_prefilled": report.tokens.prefilled,
            f"{prefix}_decoded": report.tokens.decoded, f"{prefix}_client_ms": ms, f"{prefix}_wall_ms": report.wall_ms,
            f"{prefix}_reused_calls": int(report.calls.get("reused", 0)),
            f"{prefix}_prefilled_turns": report.tokens.turns_prefilled}


def measure(tau: int, world: Worlds, scenario: Scenario, files: dict[str, str], policy: str = "session",
            make_engine: Callable[[], LocalBackend] = engine) -> dict[str, Any]:
    """B7, B5' and B5 at one tau (see the module docstring); the row says what failed, if anything did."""
    client_a, client_b = world.a.client(), world.b.client()
    b7: AgentSession | None = None
    b5p: AgentSession | None = None
    ref: AgentSession | None = None
    row: dict[str, Any] = {"tau": tau}
    try:
        b7, source, report, b7_ms = _replayed(client_a, scenario, files, tau, policy, True, make_engine)
        target = source.content
        row.update(source=source.artifact_id, type=str(source.type), target_chars=len(target),
                   target_preview=target[:80])
        if report is None:
            row["status"] = "skipped: o_tau is empty, there is nothing to forget"
            return row
        b7_state = final_state(b7)
        b5p, _, b5p_report, b5p_ms = _replayed(client_a, scenario, files, tau, policy, False, make_engine)
        assert b5p_report is not None
        b5p_state = final_state(b5p)

        fresh = make_engine()
        started = time.perf_counter()
        # The same scripted agent (its script names the tasks) fed o^{-z}, as B7's replay is.
        ref = run_session(client_b, scenario, files, forget=[target], engine=fresh, context_policy=policy,
                          inputs=exogenous_inputs(without(scenario, target)))
        b5_ms = (time.perf_counter() - started) * 1000
        b5_state = final_state(ref)
        meter = ref.backend.meter
        agree, agree_p = agreement(b7_state, b5_state), agreement(b5p_state, b5_state)
        b7_tok = report.tokens.recomputed
        row.update(
            status="ok", T=report.T, T_original=report.T_original, tau_reported=report.tau,
            transitions_replayed=report.transitions_replayed, splice_offset=int(report.checkpoint["token_offset"]),
            **_tokens("b7", report, b7_ms), **_tokens("b5p", b5p_report, b5p_ms),
            b7_reused_prefix=report.tokens.reused_prefix,
            b5_recomputed=meter.recomputed, b5_prefilled=meter.prefilled, b5_decoded=meter.decoded, b5_ms=b5_ms,
            b5_over_b7=meter.recomputed / max(b7_tok, 1), b5p_over_b7=b5p_report.tokens.recomputed / max(b7_tok, 1),
            b5_over_b7_wall=b5_ms / max(b7_ms, 1e-9), b5p_over_b7_wall=b5p_ms / max(b7_ms, 1e-9),
            agreement=agree["all"], disagree=[k for k, v in agree.items() if not v and k != "all"],
            b5p_agreement=agree_p["all"],
            leak_hits=int(report.leak_scan.get("hits", 0)), leak_where=report.leak_scan.get("where", []),
            answer=b7_state.answer)
        if EFFECT_ID.search(target) and not (agree["all"] and agree_p["all"]):
            # Not a B7 failure: B5 here is not the counterfactual, so the comparison says nothing.
            row["agreement"] = row["b5p_agreement"] = None
            row["note"] = ("o_tau is an external call's result carrying a firewall ledger id, which differs in "
                           "world B, so B5's forget list cannot name world B's o_tau: B5 is not o^{-z} here, "
                           f"agreement not applicable (fields differing: {', '.join(row['disagree'])})")
        return row
    except Exception as exc:
        row.update(status=f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return row
    finally:
        close(client_a, b7, b5p)
        close(client_b, ref)
