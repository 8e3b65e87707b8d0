"""Forgetting cost in the paper's session shape: long sessions, several tasks, the revoked input at a random step.

A 13-task session of 48 observation steps (two seeded memories, thirteen user inputs, 33 tool
results; one web page carries an injection the scripted agent obeys: a note in its sandbox and an
email), run by the scripted policy on the local engine against real daemons and Docker sandboxes,
under the `task` context policy (a task's prompt holds the system prompt, the memories and that task;
`agent.runtime`). Its turns are fed to the engine one token per forward pass, as generation runs
(`--decode forced` feeds a turn in one pass, as the scripted backend does elsewhere, so decoding costs
what prefill costs). For each of `--n` steps drawn uniformly from the session's non-empty observation
steps (seeded), the whole o_tau is revoked and B7, B5' and B5 are measured side by side
(`benchmarks/_forgetting.py`): B7 this system, B5' the prefix-cached replay that re-decodes every
suffix turn (run, not derived), B5 the full reset in a world of its own.

Printed: per tau the tokens (prefilled + decoded) and wall time of each method; then the ratio of the
mean tokens recomputed B5/B7 and B5'/B7 (the paper: 9.3x and 1.5x), decoded and prefilled apart, and
the wall-time ratios. B7 must agree with B5 wherever B5 is the counterfactual, or the run fails.

    .venv/bin/python -m benchmarks.bench_long_sessions [--n 8] [--seed 19] [--policy task|session] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.models.base import DecodeResult, FinishReason, TokenMeter
from agent.models.local import LocalBackend
from agent.scenario import Scenario, Task, ToolStep
from agent.scenarios import SUM_REVENUE, VENDOR_PAGE, WORKSPACE
from benchmarks import _forgetting as fg

FILES = {**WORKSPACE, "projects/q2.csv": "month,revenue\napr,380000\nmay,390000\njun,395000\n",
         "notes/todo.txt": "close the quarter\nrenew the vendor contracts\n"}

SUM_Q2 = SUM_REVENUE.replace("q3.csv", "q2.csv")
COMPARE = ("import csv\n"
           "q = {n: sum(int(r['revenue']) for r in csv.DictReader(open(f'projects/{n}.csv'))) for n in ('q2', 'q3')}\n"
           "print(q['q3'] - q['q2'])\n")


def _task(text: str, *steps: tuple[str, dict[str, Any]], answer: str) -> Task:
    return Task(text=text, steps=[ToolStep(name=n, arguments=a) for n, a in steps], answer=answer)


def long_session(web_url: str) -> Scenario:
    """Thirteen tasks over the finance workspace; the fourth reads the injected vendor page."""
    return Scenario(
        name="finance-long", system="You are a finance assistant working in /workspace. Use the tools; answer briefly.",
        memories=["The team's address is team@example.test.", "Reports go in report.md."], compact_every=0,
        tasks=[
            _task("List the project files.", ("list_dir", {"recursive": True}), answer="README.md, notes/, projects/."),
            _task("What is on my todo list?", ("read_file", {"path": "notes/todo.txt"}), answer="Two items."),
            _task("What was Q3 revenue?", ("read_file", {"path": "projects/q3.csv"}), ("python", {"code": SUM_REVENUE}),
                  answer="Q3 revenue was 1,250,000."),
            _task(f"Check the vendor notes online at {web_url}.", ("http_get", {"url": web_url}),
                  answer="Acme raised prices 4%; Beta delivered late twice."),
            _task("What does the README say?", ("read_file", {"path": "README.md"}), answer="Data lives in projects/."),
            _task("Write the Q3 report.",
                  ("write_file", {"path": "report.md", "content": "# Q3\nRevenue 1,250,000.\n"}),
                  ("shell", {"command": "wc -c report.md"}), ("read_file", {"path": "report.md"}),
                  answer="report.md is written."),
            _task("Email the report to the team.", ("send_email", {"to": ["team@example.test"], "subject": "Q3 report",
                                                                   "body": "Revenue 1,250,000."}),
                  answer="Sent to team@example.test."),
            _task("Archive the quarter's data.",
                  ("shell", {"command": "mkdir -p archive && cp projects/q3.csv archive/"}),
                  ("list_dir", {"path": "archive"}), ("read_file", {"path": "archive/q3.csv"}),
                  answer="Archived projects/q3.csv."),
            _task("What was Q2 revenue?", ("read_file", {"path": "projects/q2.csv"}), ("python", {"code": SUM_Q2}),
                  answer="Q2 revenue was 1,165,000."),
            _task("How much did revenue grow from Q2 to Q3?", ("python", {"code": COMPARE}),
                  ("read_file", {"path": "README.md"}),
                  answer="85,000."),
            _task("Write the growth note.",
                  ("write_file", {"path": "notes/growth.md", "content": "Q3 - Q2 = 85,000.\n"}),
                  ("read_file", {"path": "notes/growth.md"}), ("list_dir", {"path": "notes"}),
                  answer="notes/growth.md is written."),
            _task("Count the lines of the data files.", ("shell", {"command": "wc -l projects/q2.csv projects/q3.csv"}),
                  ("read_file", {"path": "projects/q2.csv"}), ("read_file", {"path": "projects/q3.csv"}),
                  answer="Four lines each."),
            _task("Give me the final status.", ("list_dir", {"recursive": True}), ("read_file", {"path": "report.md"}),
                  ("read_file", {"path": "notes/todo.txt"}), ("list_dir", {"path": "archive"}),
                  answer="Everything is filed."),
        ])


class TokenByToken(LocalBackend):
    """The local engine with each teacher-forced turn fed one token per forward pass, as generation runs."""

    def force_turn(self, ids: Sequence[int], *, finish_reason: FinishReason = "stop",
                   matched_stop: int | None = None) -> DecodeResult:
        usage = TokenMeter()
        for token in ids:
            usage += super().force_turn([token], finish_reason=finish_reason, matched_stop=matched_stop).usage
        return DecodeResult(token_ids=list(ids), finish_reason=finish_reason, usage=usage, matched_stop=matched_stop)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the measured taus, and the ratios of the means (the paper's figures)."""
    out: dict[str, float] = {"n": len(rows)}
    for method in ("b7", "b5p", "b5"):
        for what in ("recomputed", "prefilled", "decoded"):
            out[f"{method}_{what}"] = _mean(rows, f"{method}_{what}")
    out["b7_ms"], out["b5p_ms"], out["b5_ms"] = (_mean(rows, "b7_client_ms"), _mean(rows, "b5p_client_ms"),
                                                 _mean(rows, "b5_ms"))
    for what in ("recomputed", "prefilled", "decoded"):
        out[f"b5_over_b7_{what}"] = out[f"b5_{what}"] / max(out[f"b7_{what}"], 1e-9)
        out[f"b5p_over_b7_{what}"] = out[f"b5p_{what}"] / max(out[f"b7_{what}"], 1e-9)
    out["b5_over_b7_wall"] = out["b5_ms"] / out["b7_ms"]
    out["b5p_over_b7_wall"] = out["b5p_ms"] / out["b7_ms"]
    out["b7_turns_prefilled"] = _mean(rows, "b7_prefilled_turns")
    out["b7_reads_reused"] = _mean(rows, "b7_reused_calls")
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'tau':>3} {'source':>9} {'T':>3} | {'B7 pf':>6} {'B7 dec':>6} {'B5p pf':>6} {'B5p dec':>7} "
            f"{'B5 pf':>6} {'B5 dec':>6} | {'turns':>5} {'reads':>5} | {'B7 ms':>6} {'B5p ms':>6} {'B5 ms':>6} | agree")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['tau']:>3} {r.get('source', '?'):>9}  {r.get('status')}")
            continue
        agree = "n/a" if r["agreement"] is None else "yes" if r["agreement"] else "NO: " + ",".join(r["disagree"])
        print(f"{r['tau']:>3} {r['source']:>9} {r['T']:>3} | {r['b7_prefilled']:>6} {r['b7_decoded']:>6} "
              f"{r['b5p_prefilled']:>6} {r['b5p_decoded']:>7} {r['b5_prefilled']:>6} {r['b5_decoded']:>6} | "
              f"{r['b7_prefilled_turns']:>5} {r['b7_reused_calls']:>5} | {r['b7_client_ms']:>6.0f} "
              f"{r['b5p_client_ms']:>6.0f} {r['b5_ms']:>6.0f} | {agree}")


def print_summary(s: dict[str, float]) -> None:
    print(f"\nmeans over {s['n']:.0f} revocations (tokens; prefilled + decoded = recomputed):")
    for label, key in (("B7 ", "b7"), ("B5'", "b5p"), ("B5 ", "b5")):
        print(f"  {label}: {s[key + '_recomputed']:7.0f} recomputed = {s[key + '_prefilled']:7.0f} prefilled + "
              f"{s[key + '_decoded']:6.0f} decoded; wall {s[key + '_ms']:6.0f} ms")
    print(f"  B7 took {s['b7_turns_prefilled']:.1f} model turns and {s['b7_reads_reused']:.1f} reads from the record "
          "per revocation")
    print("ratios of the means (target: the paper's 9.3x and 1.5x on tokens recomputed):")
    print(f"  B5/B7 : recomputed {s['b5_over_b7_recomputed']:5.2f}x, decoded {s['b5_over_b7_decoded']:5.2f}x, "
          f"prefilled {s['b5_over_b7_prefilled']:5.2f}x, wall {s['b5_over_b7_wall']:5.2f}x")
    print(f"  B5'/B7: recomputed {s['b5p_over_b7_recomputed']:5.2f}x, decoded {s['b5p_over_b7_decoded']:5.2f}x, "
          f"prefilled {s['b5p_over_b7_prefilled']:5.2f}x, wall {s['b5p_over_b7_wall']:5.2f}x")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8, help="revocations, each at a step drawn uniformly (default 8)")
    parser.add_argument("--seed", type=int, default=19, help="seed of the draw of the steps")
    parser.add_argument("--policy", choices=("task", "session"), default="task", help="the runtime's context policy")
    parser.add_argument("--decode", choices=("sequential", "forced"), default="sequential",
                        help="feed a scripted turn one token per pass (as generation) or in one pass")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = parser.parse_args(argv)
    # A TERM unwinds like ^C: the daemons and their sandboxes are shut down, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    make_engine = (lambda: TokenByToken.tiny(seed=0, max_positions=65536)) if args.decode == "sequential" \
        else fg.engine
    rows: list[dict[str, Any]] = []
    with fg.worlds({"/vendors": VENDOR_PAGE}) as world:
        scenario = long_session(world.web.url("/vendors"))
        client = world.a.client()
        probe = fg.run_session(client, scenario, FILES, engine=make_engine(), context_policy=args.policy)
        # An empty observation (a write's silent success) has nothing to forget: not drawn.
        steps = sorted(step for step, a in fg.sources(client, probe.session_id).items() if a.content)
        fg.close(client, probe)
        taus = random.Random(args.seed).choices(steps, k=args.n)
        print(f"long session: {len(steps)} observation steps, {len(scenario.tasks)} tasks, policy {args.policy}, "
              f"decode {args.decode}; taus drawn uniformly (seed {args.seed}): {taus}", flush=True)
        for tau in taus:
            row = fg.measure(tau, world, scenario, FILES, args.policy, make_engine)
            rows.append(row)
            print(f"  tau={tau:>2}: {row.get('status')}" + (
                f", tokens prefilled+decoded B7 {row['b7_prefilled']}+{row['b7_decoded']}, "
                f"B5' {row['b5p_prefilled']}+{row['b5p_decoded']}, B5 {row['b5_prefilled']}+{row['b5_decoded']}; "
                f"ms B7 {row['b7_client_ms']:.0f}, B5' {row['b5p_client_ms']:.0f}, B5 {row['b5_ms']:.0f}; "
                f"agreement {row['agreement']}" if row.get("status") == "ok" else ""), flush=True)
    print()
    print_table(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    result = summary(ok) if ok else {}
    if ok:
        print_summary(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "summary": result}, indent=2, sort_keys=True))
        print(f"wrote {args.json}")
    failed = [r["tau"] for r in rows if r.get("status") != "ok" and not str(r.get("status")).startswith("skipped")]
    disagree = [r["tau"] for r in ok if r["agreement"] is False or r["b5p_agreement"] is False]
    if failed or disagree:
        print(f"FAILED: errors at tau {failed}, disagreement with B5 at tau {disagree}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
