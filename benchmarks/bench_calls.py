"""Tool calls through the daemon against a raw `docker exec` of the same command, in one run.

Targets (issue 19): a read-class call (read_file, list_dir) p50 <= 0.5 ms and a shell call p50 <= 1.5 ms
at the client, and the shell call >= 25x faster than `docker exec` at p50. The in-container executor
replaces a `docker exec` per call with a socket round trip and a fork, and a call's two records are
committed to the WAL without waiting for an fsync (see sandboxd.db: they survive `kill -9` all the same).

    .venv/bin/python -m benchmarks.bench_calls [--n 200]
    .venv/bin/python -m benchmarks.bench_call_parts       # the daemon side of a call, part by part
    SANDBOXD_PROFILE=out/calls.svg .venv/bin/python -m benchmarks.bench_calls   # py-spy flame graph
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable

import docker
from benchmarks._harness import daemon, pct

COMMAND = "echo ok"
READ_P50_MS, SHELL_P50_MS, RATIO = 0.5, 1.5, 25.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    with daemon() as proc:
        client = proc.client()
        info = client.open_session()
        assert info.container is not None
        sid = info.session_id
        client.call(sid, "write_file", {"path": "note.txt", "content": "ok\n"})
        container = docker.from_env().containers.get(info.container)
        calls: dict[str, Callable[[], object]] = {
            "daemon shell": lambda: client.call(sid, "shell", {"command": COMMAND}).stdout == "ok\n",
            "daemon read_file": lambda: client.call(sid, "read_file", {"path": "note.txt"}).stdout == "ok\n",
            "daemon list_dir": lambda: "note.txt" in client.call(sid, "list_dir", {"path": "."}).stdout,
            "docker exec (SDK)": lambda: container.exec_run(["/bin/sh", "-c", COMMAND]).output == b"ok\n",
        }
        for _ in range(5):  # warm-up
            for call in calls.values():
                assert call()
        timings: dict[str, list[float]] = {name: [] for name in calls} | {"docker exec (CLI)": []}
        # Interleaved, so machine noise hits every kind alike.
        for i in range(args.n):
            for name, call in calls.items():
                start = time.perf_counter()
                assert call(), name
                timings[name].append(time.perf_counter() - start)
            if i % 4 == 0:
                start = time.perf_counter()
                subprocess.run(["docker", "exec", info.container, "/bin/sh", "-c", COMMAND], check=True,
                               capture_output=True)
                timings["docker exec (CLI)"].append(time.perf_counter() - start)
        # The same calls one kind at a time: no docker exec leaving dockerd, containerd and runc busy on the
        # same cores between them.
        alone: dict[str, list[float]] = {name: [] for name in calls if name.startswith("daemon")}
        for name, samples in alone.items():
            for _ in range(args.n):
                start = time.perf_counter()
                assert calls[name](), name
                samples.append(time.perf_counter() - start)
    print(f"tool calls, n={args.n} each (CLI n={len(timings['docker exec (CLI)'])}), at the client")
    for name, samples in timings.items():
        print(f"  {name:20s} p50 {pct(samples, 50) * 1000:7.2f} ms   p95 {pct(samples, 95) * 1000:7.2f} ms")
    p50 = {name: pct(samples, 50) * 1000 for name, samples in timings.items()}
    read = max(p50["daemon read_file"], p50["daemon list_dir"])
    ratio = p50["docker exec (SDK)"] / p50["daemon shell"]
    print("  targets:")
    print(f"    read-class call p50 {read:.2f} ms <= {READ_P50_MS} ms: {_met(read <= READ_P50_MS)}")
    print(f"    shell call p50 {p50['daemon shell']:.2f} ms <= {SHELL_P50_MS} ms: "
          f"{_met(p50['daemon shell'] <= SHELL_P50_MS)}")
    print(f"    shell {ratio:.1f}x faster than docker exec (SDK) >= {RATIO:g}x: {_met(ratio >= RATIO)}"
          f" (CLI: {p50['docker exec (CLI)'] / p50['daemon shell']:.1f}x)")
    print(f"each kind alone, n={args.n} each, at the client")
    for name, samples in alone.items():
        print(f"  {name:20s} p50 {pct(samples, 50) * 1000:7.2f} ms   p95 {pct(samples, 95) * 1000:7.2f} ms")
    read_alone = max(pct(alone["daemon read_file"], 50), pct(alone["daemon list_dir"], 50)) * 1000
    shell_alone = pct(alone["daemon shell"], 50) * 1000
    print(f"    alone: read-class call p50 {read_alone:.2f} ms <= {READ_P50_MS} ms: {_met(read_alone <= READ_P50_MS)};"
          f" shell call p50 {shell_alone:.2f} ms <= {SHELL_P50_MS} ms: {_met(shell_alone <= SHELL_P50_MS)}")


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
