"""What one revocation costs the daemon in work, not time: SQL statements, reads of the source artifact,
loads of the checkpoint list, taint-closure queries and fingerprintings of the target, per phase.

The session is the unit tests' (`tests/unit/test_core_service.py`: a read whose result holds the target,
a summary written from it) over `LocalSandbox`, so it needs no engine and its counts are exact, the same
on every machine. README's "What got simpler, measured" quotes them.

    .venv/bin/python -m benchmarks.bench_revocation_work
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Callable
from typing import Any

from sandboxd import db as database
from sandboxd import protocol as p
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation import erasure, forgotten
from tests.unit.test_core_service import art, daemon, history

counts: collections.Counter[str] = collections.Counter()


def _counted(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return fn(*args, **kwargs)
    return counted


def _instrument() -> None:
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(lambda _sql: counts.update(["SQL statements"]))
        return conn

    database.sqlite3.connect = traced  # type: ignore[assignment]
    for name, key in (("artifact", "source reads"), ("checkpoints", "checkpoint list loads"),
                      ("closure", "closure queries")):
        setattr(ProvenanceStore, name, _counted(key, getattr(ProvenanceStore, name)))
    for module in (erasure, forgotten):  # every fingerprinting of a target goes through these two
        module.fingerprints_for = _counted("fingerprintings", module.fingerprints_for)  # type: ignore[attr-defined]


def main() -> None:
    _instrument()
    secret = "key-measuredsecret123"
    phases: dict[str, dict[str, int]] = {}
    with daemon() as d:
        sid = d.open()
        history(d, sid, secret)
        counts.clear()
        rid = d.ask(p.RevokeRequest, session_id=sid, source="o2", target=secret).revocation.revocation_id
        phases["revoke"], _ = dict(counts), counts.clear()
        plan = d.ask(p.BeginRevocationRequest, revocation_id=rid)
        phases["begin"], _ = dict(counts), counts.clear()
        reread = d.ask(p.CallRequest, session_id=sid, tool="read_file", args={"path": "notes.txt"}, mode="shadow",
                       branch=plan.branch).result
        d.record(sid, art("m1", "model_turn", 1, 1, "read it", ["u1"]), art("t1", "tool_call", 1, 1, "read", ["m1"]),
                 art("o2", "observation", 2, 1, reread.stdout, ["t1"], tool="read_file"), branch=plan.branch)
        counts.clear()
        d.ask(p.CommitRevocationRequest, revocation_id=rid, tokens=p.TokenCounts(), transitions_replayed=1,
              final_step=2)
        phases["commit"] = dict(counts)
    keys = sorted({k for c in phases.values() for k in c})
    print(f"{'':24}" + "".join(f"{phase:>9}" for phase in [*phases, "total"]))
    for key in keys:
        row = [phases[phase].get(key, 0) for phase in phases]
        print(f"{key:24}" + "".join(f"{n:>9}" for n in [*row, sum(row)]))


if __name__ == "__main__":
    main()
