"""A trivial tool call through the daemon against a raw `docker exec` of the same command, in one run.

Target: the daemon at least 5x faster at p50, because the in-container executor replaces a
`docker exec` per call with a socket round trip and a fork.

    .venv/bin/python benchmarks/bench_calls.py [--n 200]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import docker
from benchmarks._harness import daemon, pct

COMMAND = "echo ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    with daemon() as proc:
        client = proc.client()
        info = client.open_session()
        assert info.container is not None
        container = docker.from_env().containers.get(info.container)
        timings: dict[str, list[float]] = {"daemon call": [], "docker exec (SDK)": [], "docker exec (CLI)": []}
        for _ in range(5):  # warm-up
            client.call(info.session_id, "shell", {"command": COMMAND})
            container.exec_run(["/bin/sh", "-c", COMMAND])
        # Interleaved, so machine noise hits all three alike.
        for i in range(args.n):
            start = time.perf_counter()
            assert client.call(info.session_id, "shell", {"command": COMMAND}).stdout == "ok\n"
            timings["daemon call"].append(time.perf_counter() - start)
            start = time.perf_counter()
            assert container.exec_run(["/bin/sh", "-c", COMMAND]).output == b"ok\n"
            timings["docker exec (SDK)"].append(time.perf_counter() - start)
            if i % 4 == 0:
                start = time.perf_counter()
                subprocess.run(["docker", "exec", info.container, "/bin/sh", "-c", COMMAND], check=True,
                               capture_output=True)
                timings["docker exec (CLI)"].append(time.perf_counter() - start)
    print(f"trivial call `{COMMAND}`, n={args.n} (CLI n={len(timings['docker exec (CLI)'])})")
    for name, samples in timings.items():
        print(f"  {name:20s} p50 {pct(samples, 50) * 1000:7.2f} ms   p95 {pct(samples, 95) * 1000:7.2f} ms")
    base = pct(timings["daemon call"], 50)
    for name in ("docker exec (SDK)", "docker exec (CLI)"):
        print(f"  daemon is {pct(timings[name], 50) / base:5.1f}x faster at p50 than {name} (target >= 5x)")


if __name__ == "__main__":
    main()
