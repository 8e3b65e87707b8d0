"""Forgetting cost: this system (B7) against a full reset (B5) and a prefix-cached full replay (B5'), in one run.

The demo's session family (`finance(web, compact_every=0)`: seeded memories, six tasks, ~19
observation steps), run by the scripted policy on the local engine against real daemons and Docker
sandboxes. For every tau in the sweep, the whole observation o_tau (a user input, a seeded memory or
a tool result) is the forget target z:

- B7 (this system): a fresh original session in world A (its own daemon and mail sink), then
  `client.revoke(session, source=<artifact id of o_tau>, target=None)` and
  `agent.revocation.apply(agent, revocation_id)`. Tokens recomputed: the report's
  `tokens.recomputed`; wall: the report's `wall_ms` (daemon side, begin to commit) and the client's
  perf_counter time around `apply()`.
- B5 (full reset, the reference): a fresh session in world B (a second daemon and mail sink, the same
  web server) run from scratch on the counterfactual stream o^{-z}: the scenario with z removed from
  every exogenous text (memories, user tasks), and `forget=[z]` so the daemon excises z from every
  tool result (which is how a tool-result o_tau becomes o_tau minus z). Tokens recomputed: the fresh
  engine's `meter.recomputed`; wall: perf_counter time of `run_session` (opening and seeding the
  sandbox included; building the model engine is not, for B5 as for B7).
- B5' (prefix-cached full replay that re-decodes the whole suffix; the paper's control): not run,
  derived from the B5 run's own blocks. B5' recomputed = B5 recomputed minus the prefilled tokens of
  the non-model blocks (system, memory, user, observation: everything that is not decoded) whose
  token span ends at or before B7's splice offset `checkpoint.token_offset`: the tokens a radix
  (prefix) cache would serve a full replay. Model turns are re-decoded in full, prefix ones included.
  Its wall is not measured (shown as "-").

Every B7 final state is compared with its B5 (`agent.compare.final_state` / `agreement`); the table
shows it, and the benchmark exits non-zero if any measured tau disagrees or fails. Where o_tau is an
external call's result (the emails, steps 10 and 16; only with `--all`) it carries a firewall ledger
id that differs in world B, so `forget=[z]` cannot name world B's o_tau: B5 is not the counterfactual
there, and agreement is shown as n/a with the differing fields, not counted as a pass or a failure.
The `leak` column is the B7 report's leak-scan hit count: z still found in daemon state, e.g. when
o_tau is a file's content (steps 6, 14) and the file stays in the sandbox, as it does in B5's world.

Paper (Table 1): B7 recomputes 9.3x fewer tokens than a full reset (133 vs 1235) and 1.5x fewer than B5'.

    .venv/bin/python -m benchmarks.bench_revocation [--taus 1,5,9,15,19 | --all] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from agent.compare import agreement, final_state
from agent.harness import MailSink, Web, daemon_config, run_session
from agent.models.local import LocalBackend
from agent.revocation import apply
from agent.runtime import AgentSession
from agent.scenario import Scenario
from agent.scenarios import VENDOR_PAGE, WORKSPACE, finance
from sandboxd import protocol as p
from sandboxd.client import Client
from sandboxd.launcher import DaemonProcess

DEFAULT_TAUS = "1,5,9,15,19"
MODEL_TYPES = ("model_turn", "summary")
#: A firewall ledger id: it derives from the session's lineage, so world B's twin of a result has another one.
EFFECT_ID = re.compile(r"fx-[0-9a-f]{8,}")


def engine() -> LocalBackend:
    """The engine run_session would build; built outside the timers."""
    return LocalBackend.tiny(seed=0, max_positions=65536)


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


def prefix_served(blocks: list[Any], offset: int) -> int:
    """Prefilled tokens of non-model blocks ending at or before `offset`: what a prefix cache serves B5'."""
    return sum(b.span[1] - b.span[0] for b in blocks if b.type not in MODEL_TYPES and b.span[1] <= offset)


def close(client: Client, *agents: AgentSession | None) -> None:
    for agent in agents:
        if agent is not None:
            try:
                client.close_session(agent.session_id)
            except Exception as exc:  # the daemon's shutdown removes what is left; say so
                print(f"   closing {agent.session_id} failed: {exc}", file=sys.stderr)


def measure(tau: int, world_a: DaemonProcess, world_b: DaemonProcess, scenario: Scenario) -> dict[str, Any]:
    """One tau: original session + revocation in world A (B7), fresh counterfactual in world B (B5, B5')."""
    client_a, client_b = world_a.client(), world_b.client()
    agent: AgentSession | None = None
    ref: AgentSession | None = None
    row: dict[str, Any] = {"tau": tau}
    try:
        agent = run_session(client_a, scenario, WORKSPACE, engine=engine())
        found = sources(client_a, agent.session_id)
        if tau not in found:
            raise ValueError(f"no user input / tool result / memory at step {tau} (steps: {sorted(found)})")
        source = found[tau]
        target = source.content
        row.update(source=source.artifact_id, type=str(source.type), target_chars=len(target),
                   target_preview=target[:80])
        if not target:
            row["status"] = "skipped: o_tau is empty, there is nothing to forget"
            return row
        cross_world = bool(EFFECT_ID.search(target))

        # B7: revoke the whole observation and let the agent replay the suffix.
        revocation = client_a.revoke(agent.session_id, source=source.artifact_id, target=None)
        started = time.perf_counter()
        report = apply(agent, revocation.revocation.revocation_id)
        b7_client_ms = (time.perf_counter() - started) * 1000
        b7_state = final_state(agent)

        # B5: from scratch, in a world of its own, on o^{-z}.
        fresh = engine()
        started = time.perf_counter()
        ref = run_session(client_b, without(scenario, target), WORKSPACE, forget=[target], engine=fresh)
        b5_ms = (time.perf_counter() - started) * 1000
        b5_state = final_state(ref)
        b5 = ref.backend.meter.recomputed

        offset = int(report.checkpoint["token_offset"])
        served = prefix_served(ref.blocks, offset)
        splice = [c for c in client_a.graph(agent.session_id).checkpoints if c.checkpoint_id == report.checkpoint["id"]]
        if splice:  # cross-check: the blocks before the offset are the splice's manifest
            by_id = sum(b.span[1] - b.span[0] for b in ref.blocks
                        if b.artifact_id in set(splice[0].manifest) and b.type not in MODEL_TYPES)
            if by_id != served:
                print(f"   tau={tau}: B5' prefix by offset ({served}) != by manifest ({by_id})", file=sys.stderr)
        agree = agreement(b7_state, b5_state)
        b7 = report.tokens.recomputed
        row.update(
            status="ok", T=report.T, T_original=report.T_original, tau_reported=report.tau,
            transitions_replayed=report.transitions_replayed, splice_offset=offset,
            b7_recomputed=b7, b7_prefilled=report.tokens.prefilled, b7_decoded=report.tokens.decoded,
            b7_reused_prefix=report.tokens.reused_prefix, b7_wall_ms=report.wall_ms, b7_client_ms=b7_client_ms,
            b5_recomputed=b5, b5_prefilled=ref.backend.meter.prefilled, b5_decoded=ref.backend.meter.decoded,
            b5_wall_ms=b5_ms, b5p_prefix_served=served, b5p_recomputed=b5 - served,
            b5_over_b7=b5 / max(b7, 1), b5p_over_b7=(b5 - served) / max(b7, 1),
            b5_over_b7_wall=b5_ms / max(b7_client_ms, 1e-9),
            agreement=agree["all"], disagree=[k for k, v in agree.items() if not v and k != "all"],
            leak_hits=int(report.leak_scan.get("hits", 0)), leak_where=report.leak_scan.get("where", []),
            answer=b7_state.answer)
        if cross_world and not agree["all"]:
            # Not a B7 failure: B5 here is not the counterfactual, so the comparison says nothing.
            row["agreement"] = None
            row["note"] = ("o_tau is an external call's result carrying a firewall ledger id, which differs in "
                           "world B, so B5's forget list cannot name world B's o_tau: B5 is not o^{-z} here, "
                           f"agreement not applicable (fields differing: {', '.join(row['disagree'])})")
        return row
    except Exception as exc:
        row.update(status=f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return row
    finally:
        close(client_a, agent)
        close(client_b, ref)


def agree_cell(row: dict[str, Any]) -> str:
    if row["agreement"] is None:
        return "n/a (see note)"
    return "yes" if row["agreement"] else "NO: " + ",".join(row["disagree"])


def table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'tau':>3} {'source':>8} {'T':>3} {'repl':>4} | {'B7':>5} {'B5':>5} {'B5p':>5} | "
            f"{'B5/B7':>6} {'B5p/B7':>6} | {'B7 ms':>7} {'B7 cli':>7} {'B5 ms':>7} {'B5p ms':>6} | {'leak':>4} | agree")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['tau']:>3} {r.get('source', '?'):>8}  {r.get('status')}")
            continue
        print(f"{r['tau']:>3} {r['source']:>8} {r['T']:>3} {r['transitions_replayed']:>4} | "
              f"{r['b7_recomputed']:>5} {r['b5_recomputed']:>5} {r['b5p_recomputed']:>5} | "
              f"{r['b5_over_b7']:>5.2f}x {r['b5p_over_b7']:>5.2f}x | "
              f"{r['b7_wall_ms']:>7.0f} {r['b7_client_ms']:>7.0f} {r['b5_wall_ms']:>7.0f} {'-':>6} | "
              f"{r['leak_hits']:>4} | {agree_cell(r)}")
        if r.get("note"):
            print(f"      note: {r['note']}")
        if r["leak_hits"]:
            print(f"      leak scan: z found in {r['leak_hits']} place(s), e.g. {r['leak_where'][:3]}")


def summary(rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    agreeing = [r for r in ok if r["agreement"] is True]
    for label, sel in (("all measured", ok), ("agreeing with B5", agreeing)):
        if not sel:
            continue
        mean = statistics.fmean
        tok = (mean(r["b7_recomputed"] for r in sel), mean(r["b5_recomputed"] for r in sel),
               mean(r["b5p_recomputed"] for r in sel))
        print(f"mean over {len(sel)} tau ({label}): B7 {tok[0]:.0f}, B5 {tok[1]:.0f}, B5' {tok[2]:.0f} tokens; "
              f"mean B5/B7 {mean(r['b5_over_b7'] for r in sel):.2f}x, "
              f"mean B5'/B7 {mean(r['b5p_over_b7'] for r in sel):.2f}x "
              f"(ratio of means {tok[1] / max(tok[0], 1):.2f}x, {tok[2] / max(tok[0], 1):.2f}x); "
              f"wall B7 {mean(r['b7_client_ms'] for r in sel):.0f} ms (client) / "
              f"{mean(r['b7_wall_ms'] for r in sel):.0f} ms (daemon), B5 {mean(r['b5_wall_ms'] for r in sel):.0f} ms, "
              f"B5/B7 wall {mean(r['b5_over_b7_wall'] for r in sel):.2f}x")
    print("paper (Table 1): B7 recomputes 9.3x fewer tokens than a full reset B5 (133 vs 1235) "
          "and 1.5x fewer than B5'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--taus", default=DEFAULT_TAUS, help=f"comma-separated steps (default {DEFAULT_TAUS})")
    parser.add_argument("--all", action="store_true", help="every step whose observation is exogenous")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-bench-revocation-"))
    mail_a, mail_b, web = MailSink(), MailSink(), Web({"/vendors": VENDOR_PAGE})
    world_a = DaemonProcess(tmp / "a" / "state", ["--config", str(daemon_config(tmp / "a.toml", mail_a, web))],
                            log=tmp / "a.log")
    world_b = DaemonProcess(tmp / "b" / "state", ["--config", str(daemon_config(tmp / "b.toml", mail_b, web))],
                            log=tmp / "b.log")
    scenario = finance(web.url("/vendors"), compact_every=0)
    rows: list[dict[str, Any]] = []
    try:
        world_a.start()
        world_b.start()
        if args.all:
            probe_client = world_a.client()
            probe = run_session(probe_client, scenario, WORKSPACE, engine=engine())
            taus = sorted(sources(probe_client, probe.session_id))
            close(probe_client, probe)
        else:
            taus = [int(t) for t in args.taus.split(",") if t.strip()]
        print(f"finance scenario (compact_every=0), taus {taus}; the whole o_tau is revoked (target=None)")
        for tau in taus:
            row = measure(tau, world_a, world_b, scenario)
            rows.append(row)
            print(f"  tau={tau:>2} {row.get('source', '?'):>8}: {row.get('status')}"
                  + (f", B7 {row['b7_recomputed']} / B5 {row['b5_recomputed']} tokens, agreement {row['agreement']}"
                     if row.get("status") == "ok" else ""), flush=True)
    finally:
        world_a.shutdown()
        world_b.shutdown()
        for server in (mail_a, mail_b, web):
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)

    print("\ntokens recomputed (prefilled + decoded) and wall time per method; repl = transitions replayed by B7")
    print("B7: revocation report (ms = daemon begin..commit, cli = client time of apply()); B5: fresh run on o^{-z};")
    print("B5p = B5': B5 minus the prefilled tokens of non-model blocks (system/memory/user/observation) whose span")
    print("ends at or before B7's splice offset checkpoint.token_offset (a prefix cache serves them); every model")
    print("turn re-decoded. B5' wall is not measured.\n")
    table(rows)
    print()
    summary(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2, sort_keys=True))
        print(f"wrote {args.json}")
    failed = [r["tau"] for r in rows if r.get("status") != "ok" and not str(r.get("status")).startswith("skipped")]
    disagree = [r["tau"] for r in rows if r.get("status") == "ok" and r["agreement"] is False]
    not_applicable = [r["tau"] for r in rows if r.get("status") == "ok" and r["agreement"] is None]
    if not_applicable:
        print(f"agreement not applicable at tau {not_applicable} (B5 cannot be built there, see the notes)")
    if failed or disagree:
        print(f"FAILED: errors at tau {failed}, B7 disagrees with B5 at tau {disagree}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
