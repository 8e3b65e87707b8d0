"""What keeping the state on PostgreSQL costs over the embedded SQLite file, measured side by side.

One firewall call of an external effect is three durable ledger commits (intent, fired, done) plus the
identity reads; the adapter here is in-process (it counts, sends nothing), so the figures are the
state's own cost. Both backends run interleaved call by call, at 1 and 8 concurrent callers, on a
PostgreSQL server this benchmark starts itself (initdb into a temporary directory, unix socket, fsync
on: the same durability as SQLite's synchronous=FULL). Two firewalls on the PostgreSQL database stand
for two daemons sharing it (the writer lock is then contended across them).

Run: `.venv/bin/python -m benchmarks.bench_state [--n 300] [--callers 1 8]` (needs `make postgres`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sandboxd.db import Database
from sandboxd.firewall import EffectAdapter, Firewall, FirewallConfig
from sandboxd.protocol import ToolManifest
from tests.pgserver import PgServer

NOTE = ToolManifest(name="note", description="Counts.", effect="external", intent_fields=["text"],
                    parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


class Counting(EffectAdapter):
    manifest = NOTE
    timeout_s = 5.0

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        return {"ok": True}


def run(firewalls: list[Firewall], callers: int, n: int, tag: str) -> tuple[list[float], float]:
    samples: list[float] = []
    lock = threading.Lock()

    def caller(k: int) -> None:
        firewall = firewalls[k % len(firewalls)]
        for i in range(n // callers):
            start = time.perf_counter()
            firewall.call(f"s{k}", f"lin-{tag}-{k}", "note", {"text": f"{tag} {k} {i}"})
            with lock:
                samples.append(time.perf_counter() - start)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples, len(samples) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per configuration")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8], help="concurrent callers, per row")
    args = parser.parse_args()
    server = PgServer()
    workdir = Path(tempfile.mkdtemp(prefix="bench-state-"))
    try:
        configs = {
            "sqlite": [Database(workdir / "state.db")],
            "postgresql": [Database(server.fresh_url(), node="a")],
        }
        url = server.fresh_url()
        configs["postgresql, 2 daemons"] = [Database(url, node="a"), Database(url, node="b")]
        print(f"{'state':24} {'callers':>7} {'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7}")
        for callers in args.callers:
            for name, dbs in configs.items():
                firewalls = [Firewall(FirewallConfig(), db, adapters=[Counting()]) for db in dbs]
                samples, rate = run(firewalls, callers, args.n, f"{callers}")
                cuts = statistics.quantiles(samples, n=100, method="inclusive")
                print(f"{name:24} {callers:>7} {rate:>8.0f} {cuts[49] * 1e3:>7.2f} {cuts[98] * 1e3:>7.2f}")
        for dbs in configs.values():
            for db in dbs:
                db.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
