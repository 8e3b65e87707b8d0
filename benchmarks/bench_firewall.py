"""What the side-effect firewall costs, measured side by side in one run.

1. Added latency on an external call: `send_email` through `Firewall.call` (schema check, canonical
   intent, three durable ledger commits: intent, fired, done) against `SmtpAdapter.fire` alone, both
   delivering to the same local aiosmtpd sink, interleaved call by call so drift hits both equally.
2. Answering a retry from the ledger (no delivery) for comparison.
3. Ledger throughput with durable writes (WAL, synchronous=FULL): held calls (one commit each) through
   the facade, and bare intent inserts through the `Ledger`.

Run: `.venv/bin/python benchmarks/bench_firewall.py [--n 300] [--intents 2000] [--dir PATH]`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiosmtpd.controller import Controller  # noqa: E402

from sandboxd.db import Database  # noqa: E402
from sandboxd.firewall import Firewall, FirewallConfig, SmtpAdapter, SmtpConfig  # noqa: E402
from sandboxd.firewall.ledger import CallRecord  # noqa: E402


class CountingSink:
    def __init__(self) -> None:
        self.count = 0

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.count += 1
        return "250 OK"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentiles(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[94]


def email(i: int, tag: str) -> dict[str, Any]:
    return {"to": ["bench@example.com"], "subject": f"bench {tag}", "body": f"message {i}"}


def measure_latency(firewall: Firewall, adapter: SmtpAdapter, n: int, run: str) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"direct": [], "firewall": [], "dedupe": []}
    for i in range(n):
        start = time.perf_counter()
        adapter.fire(email(i, f"direct {run}"), f"direct-{run}-{i}")
        samples["direct"].append(time.perf_counter() - start)
        start = time.perf_counter()
        firewall.call("bench", "bench-lineage", "send_email", email(i, run), call_id=f"{run}-{i}")
        samples["firewall"].append(time.perf_counter() - start)
        start = time.perf_counter()
        firewall.call("bench", "bench-lineage", "send_email", email(i, run), call_id=f"{run}-{i}")
        samples["dedupe"].append(time.perf_counter() - start)
    return samples


def measure_throughput(workdir: Path, intents: int) -> tuple[float, float]:
    db = Database(str(workdir / "throughput.db"))
    firewall = Firewall(
        FirewallConfig(smtp=SmtpConfig(port=1), release={"send_email": "manual"}), db
    )
    start = time.perf_counter()
    for i in range(intents):
        firewall.call("tp", "tp-lineage", "send_email", email(i, "held"))
    held_rate = intents / (time.perf_counter() - start)
    ledger = firewall.ledger
    start = time.perf_counter()
    for i in range(intents):
        record = CallRecord(
            call_id=f"raw-{i}", tool="send_email", state="intent", session_id="tp", lineage="tp",
            branch="tp#0", occurrence=0, intent_key=f"k{i}", intent={"i": i}, args={"i": i},
            policy="immediate",
        )  # fmt: skip
        with ledger.transaction():
            ledger.insert_call(record)
    raw_rate = intents / (time.perf_counter() - start)
    firewall.close()
    db.close()
    return held_rate, raw_rate


def filesystem_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="external calls per side")
    parser.add_argument("--intents", type=int, default=2000, help="intents for the throughput runs")
    parser.add_argument("--dir", type=Path, default=None, help="ledger directory (default: temp)")
    args = parser.parse_args()

    sink = CountingSink()
    port = free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=port)
    controller.start()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)
        db = Database(str(workdir / "latency.db"))
        smtp = SmtpConfig(port=port)
        firewall = Firewall(FirewallConfig(smtp=smtp), db)
        adapter = SmtpAdapter(smtp, 5.0)
        try:
            # Warm-up: imports, page cache, first connections.
            measure_latency(firewall, adapter, 20, "warmup")
            before = sink.count
            samples = measure_latency(firewall, adapter, args.n, "run")
            delivered = sink.count - before
            held_rate, raw_rate = measure_throughput(workdir, args.intents)
        finally:
            firewall.close()
            db.close()
            controller.stop()
        report(args, workdir, samples, delivered, held_rate, raw_rate)


def report(
    args: argparse.Namespace,
    workdir: Path,
    samples: dict[str, list[float]],
    delivered: int,
    held_rate: float,
    raw_rate: float,
) -> None:
    ms = {name: tuple(v * 1000 for v in percentiles(values)) for name, values in samples.items()}
    direct, fw, dedupe = ms["direct"], ms["firewall"], ms["dedupe"]
    print(f"ledger dir: {workdir} ({filesystem_of(workdir)}), WAL, synchronous=FULL, pid {os.getpid()}")
    print(f"external call, send_email to local aiosmtpd, n={args.n} each side, interleaved")
    print(f"  adapter direct      p50 {direct[0]:7.3f} ms   p95 {direct[1]:7.3f} ms")
    print(f"  through firewall    p50 {fw[0]:7.3f} ms   p95 {fw[1]:7.3f} ms")
    print(f"  added by firewall   p50 {fw[0] - direct[0]:+7.3f} ms   p95 {fw[1] - direct[1]:+7.3f} ms"
          f"   (ratio p50 {fw[0] / direct[0]:.2f}x)")  # fmt: skip
    print(f"  retry from ledger   p50 {dedupe[0]:7.3f} ms   p95 {dedupe[1]:7.3f} ms   (no delivery)")
    print(f"  messages the sink received: {delivered} (expected {2 * args.n}: retries were not re-sent)")
    print(f"ledger throughput, durable commits, {args.intents} intents each")
    print(f"  held calls via Firewall.call (1 commit/call)  {held_rate:9.0f} intents/s")
    print(f"  bare Ledger.insert_call     (1 commit/call)  {raw_rate:9.0f} intents/s")


if __name__ == "__main__":
    main()
