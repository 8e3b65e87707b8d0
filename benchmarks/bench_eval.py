"""Forgetting cost on AgentDojo's suites: B7 against B5 and B5', tokens recomputed and wall time, as ratios.

Every pair of each suite (or the first `--limit`) runs through `agent.eval` with the methods B5, B5'
and B7, on two daemons that hold the suite's world:

- B7: `agent.revocation.apply` on the detector's revocation of the original session; tokens from the
  revocation report, wall the client's time around `apply()` (the original run is not counted).
- B5: a fresh session from scratch that never sees the injection; tokens the engine's meter, wall
  the whole run (opening the sandbox and setting up its world included).
- B5': run, on another fresh copy of the original session: the same replay with nothing taken from the
  record (`apply(..., certify=False)`, see `agent.eval.baselines.PrefixCachedReplay`): the cached prefix
  reused, every suffix turn decoded again; tokens from its report, wall the client's time of `apply()`.

Ratios are pooled (sum over pairs of B5 over sum of B7) and also given as the median per-pair ratio,
all from one run (the machines are shared: compare ratios, not absolute times).

    .venv/bin/python -m benchmarks.bench_eval [--suite banking --suite slack] [--limit N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from agent.eval.runner import evaluate

METHODS = ["B5", "B5'", "B7"]


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Pooled and median per-pair ratios of B5 and B5' over B7, from one suite's results."""
    rows = {m: {r["pair"]: r for r in results[m]["rows"] if "error" not in r} for m in METHODS}
    pairs = sorted(set(rows["B5"]) & set(rows["B5'"]) & set(rows["B7"]))
    if not pairs:
        raise SystemExit("no pair ran for every method")

    def total(method: str, column: str) -> float:
        return sum(rows[method][p][column] for p in pairs)

    def median(method: str, column: str) -> float:
        return statistics.median(rows[method][p][column] / max(rows["B7"][p][column], 1e-9) for p in pairs)

    return {
        "pairs": len(pairs),
        "tokens": {m: total(m, "tokens_recomputed") for m in METHODS},
        "wall_s": {m: total(m, "wall_s") for m in METHODS},
        "tokens_B5_over_B7": total("B5", "tokens_recomputed") / total("B7", "tokens_recomputed"),
        "tokens_B5p_over_B7": total("B5'", "tokens_recomputed") / total("B7", "tokens_recomputed"),
        "wall_B5_over_B7": total("B5", "wall_s") / total("B7", "wall_s"),
        "wall_B5p_over_B7": total("B5'", "wall_s") / total("B7", "wall_s"),
        "median_tokens_B5_over_B7": median("B5", "tokens_recomputed"),
        "median_tokens_B5p_over_B7": median("B5'", "tokens_recomputed"),
        "median_wall_B5_over_B7": median("B5", "wall_s"),
        "b7_agrees": sum(rows["B7"][p]["agreement"] == 1.0 and rows["B7"][p]["cad"] == 0 for p in pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", action="append", help="repeatable (default banking and slack)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--release-policy", default="immediate", choices=("immediate", "on_commit"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    print("| suite | pairs | B7 agrees | tokens B5 / B7 | tokens B5' / B7 | wall B5 / B7 | wall B5' / B7 | per-pair "
          "median (tokens B5, B5', wall B5 over B7) |\n|---|---|---|---|---|---|---|---|")
    for suite in args.suite or ["banking", "slack"]:
        results = evaluate(suite, METHODS, args.release_policy, args.limit,
                           lambda line: print(line, file=sys.stderr, flush=True))
        r = out[suite] = ratios(results)
        print(f"| {suite} | {r['pairs']} | {r['b7_agrees']} | {r['tokens_B5_over_B7']:.2f}x "
              f"({r['tokens']['B5']:.0f} / {r['tokens']['B7']:.0f}) | {r['tokens_B5p_over_B7']:.2f}x | "
              f"{r['wall_B5_over_B7']:.2f}x ({r['wall_s']['B5']:.1f} s / {r['wall_s']['B7']:.1f} s) | "
              f"{r['wall_B5p_over_B7']:.2f}x | "
              f"{r['median_tokens_B5_over_B7']:.2f}x, {r['median_tokens_B5p_over_B7']:.2f}x, "
              f"{r['median_wall_B5_over_B7']:.2f}x |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
