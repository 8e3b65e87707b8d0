"""The fleet, measured in one run: calls/s and p50/p99 through the front door with 1, 2 and 3 Ray
nodes at 16 and 64 sessions; the door's added latency (the same calls sent straight to the session's
node); PostgreSQL's added latency (one daemon on SQLite against one on PostgreSQL, no door).

Everything runs on this machine: a `ray.cluster_utils.Cluster` whose nodes join one by one, a
PostgreSQL server started here (initdb in a temporary directory), every node's daemon on the one
Docker engine. So the node counts measure the fleet's own overhead and routing, not more hardware:
on one machine more nodes cannot add cores. The workload: every session writes a file once, then each
of its `--calls` calls reads it back (`read_file`, a real exec in its sandbox), all sessions at once.

With `--tcp` the node daemons listen on tcp:// with CURVE (a fleet key directory), as on several hosts,
and the straight-to-the-nodes run connects with the door's key: the cost of tcp+CURVE over ipc.

Run: `.venv/bin/python -m benchmarks.bench_fleet [--sessions 16 64] [--calls 5] [--nodes 3] [--tcp]
[--no-baseline | --daemons-only]` (needs the tool image, `make postgres` and the `fleet` extra).
`--daemons-only` runs the last rows alone (no Ray): one daemon on SQLite against one on PostgreSQL,
at the first `--sessions`; `--no-baseline` skips them.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from sandboxd.client import Client
from sandboxd.db import Database
from sandboxd.fleet.door import Fleet, serve
from sandboxd.fleet.nodes import NodeSpec
from sandboxd.launcher import DaemonProcess
from tests.pgserver import PgServer


def workload(endpoint_of: Callable[[str], str], sessions: list[str], calls: int,
             connect: Callable[[str], Client] = lambda endpoint: Client(endpoint, timeout_s=300),
             ) -> tuple[list[float], float]:
    samples: list[float] = []
    lock = threading.Lock()

    def one(sid: str) -> None:
        with connect(endpoint_of(sid)) as client:
            for _ in range(calls):
                start = time.perf_counter()
                client.call(sid, "read_file", {"path": "f.txt"})
                with lock:
                    samples.append(time.perf_counter() - start)

    threads = [threading.Thread(target=one, args=(sid,)) for sid in sessions]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples, len(samples) / (time.perf_counter() - start)


def open_sessions(endpoint: str, n: int) -> list[str]:
    opened: list[str] = []
    lock = threading.Lock()

    def one(_: int) -> None:
        with Client(endpoint, timeout_s=300) as client:
            sid = client.open_session().session_id
            client.call(sid, "write_file", {"path": "f.txt", "content": "x" * 100})
            with lock:
                opened.append(sid)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return opened


def close_sessions(endpoint: str, sessions: list[str]) -> None:
    with Client(endpoint, timeout_s=300) as client:
        for sid in sessions:
            client.close_session(sid)


def node_client(fleet: Fleet) -> Callable[[str], Client]:
    """How to reach a node's daemon as the door does: with the door's CURVE key on tcp nodes."""
    server, public, secret = fleet.curve or (None, None, None)
    return lambda endpoint: Client(endpoint, timeout_s=300, server_public_key=server, public_key=public,
                                   secret_key=secret)


def row(name: str, samples: list[float], rate: float) -> None:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    print(f"{name:44} {len(samples):>6} {rate:>8.1f} {cuts[49] * 1e3:>8.1f} {cuts[98] * 1e3:>8.1f}", flush=True)


def one_daemon_rows(root: Path, server: PgServer, n: int, calls: int) -> None:
    """One daemon on SQLite, then one on PostgreSQL, no door: what the state's backend costs a call."""
    for name, extra in (("one daemon, SQLite", []), ("one daemon, PostgreSQL", ["--state", server.fresh_url()])):
        daemon = DaemonProcess(root / name.replace(" ", "-").replace(",", "") / "state", extra)
        daemon.start()
        try:
            sessions = open_sessions(daemon.endpoint, n)
            samples, rate = workload(lambda _sid: daemon.endpoint, sessions, calls)  # noqa: B023
            row(f"{name}, {n} sessions", samples, rate)
            close_sessions(daemon.endpoint, sessions)
        finally:
            daemon.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--calls", type=int, default=5, help="calls per session")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--tcp", action="store_true", help="node daemons on tcp:// with CURVE (a fleet key directory)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-daemon SQLite/PostgreSQL runs")
    parser.add_argument("--daemons-only", action="store_true", help="only the one-daemon rows (no Ray)")
    args = parser.parse_args()
    if args.daemons_only:
        root = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        server = PgServer()
        try:
            print(f"{'configuration':44} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8}", flush=True)
            one_daemon_rows(root, server, args.sessions[0], args.calls)
        finally:
            server.stop()
            shutil.rmtree(root, ignore_errors=True)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    server = PgServer()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 16, "include_dashboard": False})
    started: list[Fleet] = []
    ready = threading.Event()
    door_endpoint = f"ipc://{root / 'door.sock'}"
    url = server.fresh_url()
    spec = NodeSpec(state=url, state_root=str(root / "nodes"), keys_dir=str(root / "keys") if args.tcp else "")
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        threading.Thread(target=serve, args=(cluster.address, spec, door_endpoint, str(root / "door")),
                         kwargs={"cpus": 0.1, "memory_mb": 64, "ready": lambda f: (started.append(f), ready.set())},
                         daemon=True).start()
        assert ready.wait(300)
        fleet = started[0]
        state = Database(url)
        print(f"{'configuration':44} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8}", flush=True)
        for k in range(1, args.nodes + 1):
            if k > 1:
                cluster.add_node(num_cpus=16)
                while len(fleet.nodes) < k:
                    time.sleep(0.2)
            for n in args.sessions:
                sessions = open_sessions(door_endpoint, n)
                spread = len({state.value("SELECT node FROM sessions WHERE session_id = ?", [s]) for s in sessions})
                samples, rate = workload(lambda _sid: door_endpoint, sessions, args.calls)
                row(f"door, {k} node(s), {n} sessions (on {spread} nodes)", samples, rate)
                if k == args.nodes and n == args.sessions[0]:
                    def direct(sid: str) -> str:
                        return fleet.nodes[str(state.value("SELECT node FROM sessions WHERE session_id = ?", [sid]))]
                    samples, rate = workload(direct, sessions, args.calls, connect=node_client(fleet))
                    row(f"straight to the nodes, {k} node(s), {n} sessions", samples, rate)
                close_sessions(door_endpoint, sessions)
        state.close()
        fleet.server.stop()  # type: ignore[attr-defined]
        if not args.no_baseline:
            one_daemon_rows(root, server, args.sessions[0], args.calls)
    finally:
        time.sleep(2)
        for state_dir in (root / "nodes").iterdir() if (root / "nodes").exists() else []:
            if state_dir.is_dir():
                DaemonProcess(state_dir).shutdown()
        ray.shutdown()
        cluster.shutdown()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
