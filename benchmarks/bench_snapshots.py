"""Snapshot and restore times on a workspace of 1,000 files / 50 MB, overlay and copy backends side by side.

Targets (overlay, issue 19): snapshot p50 <= 3 ms and restore p50 <= 1.5 ms at the server (the store's
own time); the client figures, which add the round trip and quiescing the sandbox, are printed beside.
Each round changes a few files, so a snapshot has something to freeze, as it would between agent steps.

    .venv/bin/python -m benchmarks.bench_snapshots [--rounds 20] [--backends overlay,copy]
"""

from __future__ import annotations

import argparse
import time

from benchmarks._harness import daemon, pct

SNAPSHOT_MS, RESTORE_MS = 3.0, 1.5
FILL = """
import os
os.makedirs('data', exist_ok=True)
chunk = os.urandom(50 * 1024)
for i in range({files}):
    d = f'data/d{{i // 100:02d}}'
    os.makedirs(d, exist_ok=True)
    with open(f'{{d}}/f{{i:04d}}.bin', 'wb') as fh:
        fh.write(chunk[i % 97:] + chunk[:i % 97])
"""


def measure(backend: str, rounds: int, files: int) -> dict[str, list[float]]:
    with daemon(["--snapshot-backend", backend]) as proc:
        client = proc.client()
        sid = client.open_session().session_id
        client.call(sid, "python", {"code": FILL.format(files=files), "timeout_s": 300})
        size = client.call(sid, "shell", {"command": "du -sm data | cut -f1; find data -type f | wc -l"}).stdout
        print(f"[{backend}] workspace: {' MB, '.join(size.split())} files")
        res: dict[str, list[float]] = {"snapshot": [], "restore": [], "snapshot (client)": [],
                                       "restore (client)": []}
        ids = []
        for r in range(rounds):
            client.call(sid, "shell", {"command": f"echo round {r} >> data/d00/f0000.bin; touch round-{r}"})
            start = time.perf_counter()
            info = client.snapshot(sid)
            res["snapshot (client)"].append((time.perf_counter() - start) * 1000)
            res["snapshot"].append(info.elapsed_ms)
            ids.append(info.snapshot_id)
        for r in range(rounds):
            start = time.perf_counter()
            res["restore"].append(client.restore(sid, ids[(r * 7) % len(ids)]).elapsed_ms)
            res["restore (client)"].append((time.perf_counter() - start) * 1000)
        check = client.call(sid, "shell", {"command": "ls round-* | wc -l"}).stdout.strip()
        assert int(check) == (((rounds - 1) * 7) % len(ids)) + 1, check
        return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--backends", default="overlay,copy")
    args = parser.parse_args()
    results = {b: measure(b, args.rounds, args.files) for b in args.backends.split(",")}
    print(f"\n{args.files} files x 50 KB, {args.rounds} rounds, in ms"
          " (the client figures add the round trip and quiescing the sandbox)")
    for backend, res in results.items():
        for op, samples in res.items():
            print(f"  {backend:8s} {op:18s} p50 {pct(samples, 50):8.2f}   p95 {pct(samples, 95):8.2f}")
    if "overlay" in results and "copy" in results:
        for op in ("snapshot", "restore"):
            ratio = pct(results["copy"][op], 50) / pct(results["overlay"][op], 50)
            print(f"  overlay {op} is {ratio:.1f}x faster than a full copy at p50")
    if "overlay" in results:
        s, r = pct(results["overlay"]["snapshot"], 50), pct(results["overlay"]["restore"], 50)
        sc, rc = pct(results["overlay"]["snapshot (client)"], 50), pct(results["overlay"]["restore (client)"], 50)
        print(f"  targets (server): snapshot p50 {s:.2f} <= {SNAPSHOT_MS} ms {'met' if s <= SNAPSHOT_MS else 'MISSED'}"
              f" (client {sc:.1f} ms); restore p50 {r:.2f} <= {RESTORE_MS} ms "
              f"{'met' if r <= RESTORE_MS else 'MISSED'} (client {rc:.1f} ms)")


if __name__ == "__main__":
    main()
