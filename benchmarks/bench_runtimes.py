"""runc against runsc (gVisor), side by side in one run: what the second kernel boundary costs.

Two daemons, one per runtime, run at the same time and every measurement alternates between them
round by round, so the machine's noise falls on both alike. Measured, in ms:

- session open: `open_session` to its answer (container created, executor answering), then closed;
- trivial call: a `shell` call of `true` (a fork and exec in the sandbox) and a `read_file`
  (no process at all: the executor's own file access, through gVisor's file proxy under runsc); and
  a heavier one, a shell loop of 100 `/bin/true` (what gVisor's ptrace platform makes dearest);
- snapshot and restore on the 1,000-file / 50 MB workspace of bench_snapshots (each round changes a
  file first), as the daemon times them and as the client sees them (which adds quiescing the sandbox);
- a revocation: the demo's finance session run by the scripted policy, then its detector-raised
  revocation applied (`agent.revocation.apply_pending`): the report's `wall_ms` (daemon side) and the
  client's time around it (restore, replay of the suffix in the sandbox, commit, leak scan).

Each prints p50 and p95 per runtime and the runsc/runc ratio of the p50s.

    .venv/bin/python -m benchmarks.bench_runtimes [--rounds 20] [--files 1000] [--revocations 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from agent.harness import MailSink, Web, daemon_config, run_session
from agent.revocation import apply_pending
from agent.scenarios import VENDOR_PAGE, WORKSPACE, finance
from benchmarks._harness import daemon, pct
from benchmarks.bench_snapshots import FILL
from sandboxd.client import Client
from sandboxd.config import Runtime

RUNTIMES: tuple[Runtime, ...] = ("runc", "runsc")
EXECS = "for i in $(seq 100); do /bin/true; done"
"""A fork-and-exec-heavy tool: what gVisor's ptrace platform makes dearest."""
Results = dict[str, dict[str, list[float]]]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def sessions_and_calls(clients: dict[str, Client], rounds: int, results: Results) -> None:
    sessions = {rt: client.open_session().session_id for rt, client in clients.items()}
    for rt, client in clients.items():
        client.call(sessions[rt], "write_file", {"path": "hello.txt", "content": "hello"})
        client.call(sessions[rt], "shell", {"command": "true"})  # warm the executor and the page cache
    for _ in range(rounds):
        for rt, client in clients.items():
            results[rt]["session open"].append(timed(lambda c=client, r=rt: sessions.setdefault(
                f"{r}-extra", c.open_session().session_id)))
            client.close_session(sessions.pop(f"{rt}-extra"))
            results[rt]["call: shell true"].append(
                timed(lambda c=client, s=sessions[rt]: c.call(s, "shell", {"command": "true"})))
            results[rt]["call: read_file"].append(
                timed(lambda c=client, s=sessions[rt]: c.call(s, "read_file", {"path": "hello.txt"})))
            results[rt]["call: 100 execs"].append(
                timed(lambda c=client, s=sessions[rt]: c.call(s, "shell", {"command": EXECS})))
    for rt, client in clients.items():
        client.close_session(sessions[rt])


def snapshots(clients: dict[str, Client], rounds: int, files: int, results: Results) -> None:
    sessions = {rt: client.open_session().session_id for rt, client in clients.items()}
    taken: dict[str, list[str]] = {rt: [] for rt in clients}
    for rt, client in clients.items():
        client.call(sessions[rt], "python", {"code": FILL.format(files=files), "timeout_s": 600})
        size = client.call(sessions[rt], "shell", {"command": "du -sm data | cut -f1; find data -type f | wc -l"})
        print(f"[{rt}] workspace: {' MB, '.join(size.stdout.split())} files")
    for r in range(rounds):
        for rt, client in clients.items():
            client.call(sessions[rt], "shell", {"command": f"echo round {r} >> data/d00/f0000.bin; touch round-{r}"})
            start = time.perf_counter()
            info = client.snapshot(sessions[rt])
            results[rt]["snapshot (client)"].append((time.perf_counter() - start) * 1000)
            results[rt]["snapshot"].append(info.elapsed_ms)
            taken[rt].append(info.snapshot_id)
    for r in range(rounds):
        for rt, client in clients.items():
            start = time.perf_counter()
            done = client.restore(sessions[rt], taken[rt][(r * 7) % rounds])
            results[rt]["restore (client)"].append((time.perf_counter() - start) * 1000)
            results[rt]["restore"].append(done.elapsed_ms)
    for rt, client in clients.items():
        # The restored tree is the snapshot's, under gVisor's caches as under runc's page cache.
        rounds_seen = client.call(sessions[rt], "shell", {"command": "ls round-* | wc -l"}).stdout.strip()
        assert int(rounds_seen) == ((rounds - 1) * 7) % rounds + 1, (rt, rounds_seen)
        client.close_session(sessions[rt])


def revocations(clients: dict[str, Client], web: Web, count: int, results: Results) -> None:
    for _ in range(count):
        for rt, client in clients.items():
            agent = run_session(client, finance(web.url("/vendors")), WORKSPACE)
            start = time.perf_counter()
            [report] = apply_pending(agent)
            results[rt]["revocation (client)"].append((time.perf_counter() - start) * 1000)
            results[rt]["revocation"].append(report.wall_ms)
            assert report.leak_scan["hits"] == 0 and report.calls["fired_twice"] == 0, (rt, report.leak_scan)
            client.close_session(agent.session_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--revocations", type=int, default=3)
    args = parser.parse_args()
    results: Results = {rt: {} for rt in RUNTIMES}
    for per_runtime in results.values():
        for op in ("session open", "call: shell true", "call: read_file", "call: 100 execs", "snapshot",
                   "snapshot (client)", "restore", "restore (client)", "revocation", "revocation (client)"):
            per_runtime[op] = []
    with ExitStack() as stack:
        mail = MailSink()
        stack.callback(mail.close)
        web = Web({"/vendors": VENDOR_PAGE})
        stack.callback(web.close)
        config = daemon_config(Path(tempfile.mkdtemp(prefix="sandboxd-bench-")) / "sandboxd.toml", mail, web)
        clients = {rt: stack.enter_context(daemon(["--config", str(config), "--runtime", rt])).client()
                   for rt in RUNTIMES}
        sessions_and_calls(clients, args.rounds, results)
        snapshots(clients, args.rounds, args.files, results)
        revocations(clients, web, args.revocations, results)
    print(f"\nrunc against runsc (gVisor), alternating round by round, in ms ({args.rounds} rounds; "
          f"{args.files} files x 50 KB; {args.revocations} revocations)")
    print(f"  {'':22s} {'runc p50':>10s} {'p95':>8s} {'runsc p50':>10s} {'p95':>8s} {'runsc/runc':>11s}")
    for op in results["runc"]:
        runc, runsc = results["runc"][op], results["runsc"][op]
        ratio = pct(runsc, 50) / pct(runc, 50) if pct(runc, 50) > 0 else float("nan")
        print(f"  {op:22s} {pct(runc, 50):10.1f} {pct(runc, 95):8.1f} {pct(runsc, 50):10.1f} "
              f"{pct(runsc, 95):8.1f} {ratio:10.2f}x")


if __name__ == "__main__":
    main()
