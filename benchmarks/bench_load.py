"""Load and soak: concurrent sessions mixing tool calls, snapshots and restores, and the daemon's memory.

Each session is a thread with its own `Client` on the daemon's ipc socket: the driver starts its own
daemon on a throw-away state directory and takes no endpoint, so it never loads anything but this
machine. It is bounded in time (`--seconds`) and in count (`--max-ops` per session).

A session keeps what its workspace must hold: every acknowledged `write_file` is expected to read
back, a restore puts the expectation back to what it was at the snapshot. A read that differs is a
lost call. At the end every expected file is read once more. The daemon's VmRSS is sampled each
second; memory is called flat when the last sample is within +20% of the first one after warm-up.

    .venv/bin/python -m benchmarks.bench_load [--seconds 60] [--sessions 16]
    .venv/bin/python -m benchmarks.bench_load --seconds 300     # the soak
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from benchmarks._harness import daemon, pct
from sandboxd import protocol as p
from sandboxd.client import Client
from sandboxd.launcher import DaemonProcess

#: files per session, overwritten in turn, so the workspace does not grow with the run's length
FILES = 32
#: the op cycle of one session: most steps are tool calls, one in ten a snapshot, one in twenty a restore
CYCLE = 20
TOOL_OPS = ("shell", "write_file", "read_file")
FLAT_TOLERANCE = 0.20


@dataclass
class LoadReport:
    """What a load run measured."""

    seconds: float = 0.0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    verified: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: str, seconds: float) -> None:
        with self._lock:
            self.latencies.setdefault(op, []).append(seconds)

    def fail(self, kind: str, text: str) -> None:
        with self._lock:
            (self.lost if kind == "lost" else self.errors).append(text)

    def checked(self) -> None:
        with self._lock:
            self.verified += 1

    @property
    def ops(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    @property
    def tool_calls(self) -> int:
        return sum(len(self.latencies.get(op, [])) for op in TOOL_OPS)

    def rss_points(self, warmup_s: float) -> tuple[int, int, int, int]:
        """VmRSS (kB): first sample, first after warm-up, middle, last."""
        samples = self.rss_kb
        settled = next((kb for t, kb in samples if t >= warmup_s), samples[-1][1])
        return samples[0][1], settled, samples[len(samples) // 2][1], samples[-1][1]

    def rss_growth(self, warmup_s: float) -> float:
        """Last sample over the first after warm-up, minus one."""
        _, settled, _, last = self.rss_points(warmup_s)
        return last / settled - 1.0


#: every this many steps a session runs a revocation (the heaviest operation: restore, purge, scan)
REVOKE_EVERY = 40


class SessionLoad:
    """One session's loop: tool calls, snapshots, restores and revocations; no write may be lost."""

    def __init__(self, client: Client, index: int, report: LoadReport) -> None:
        self.client, self.index, self.report = client, index, report
        self.rng = random.Random(index)  # a fixed seed per session: the same mix on every run
        self.session_id = ""
        self.expected: dict[str, str] = {}
        self.snapshot: tuple[str, dict[str, str]] | None = None
        self.revoked = 0

    def open(self) -> None:
        self.session_id = self.client.open_session().session_id

    def run(self, deadline: float, max_ops: int) -> None:
        """Step until the deadline or `max_ops`, then read back every file this session should hold."""
        step = 0
        while time.monotonic() < deadline and step < max_ops:
            self.step(step)
            step += 1
        for path in sorted(self.expected):
            self.read_back(path, timed=False)

    def step(self, step: int) -> None:
        phase = step % CYCLE
        if step % REVOKE_EVERY == REVOKE_EVERY - 1:
            self.timed("revocation", self.revoke)
        elif phase == CYCLE // 2:
            old = self.snapshot
            self.timed("snapshot", self.take_snapshot)
            if old is not None and self.snapshot is not old:  # one snapshot per session, however long the run
                self.timed("delete_snapshot", partial(self.client.delete_snapshot, self.session_id, old[0]))
        elif phase == CYCLE - 1 and self.snapshot is not None:
            self.timed("restore", self.restore)
        elif step % 3 == 0 or not self.expected:
            self.timed("write_file", lambda: self.write(step))
        elif step % 3 == 1:
            self.read_back(self.rng.choice(sorted(self.expected)))
        else:
            self.timed("shell", self.echo)

    def revoke(self) -> None:
        """A whole revocation through the daemon, as an agent with nothing to replay would drive it.

        Checkpoint (the sandbox as it is), an input that carries a secret, revoke it, begin (restore,
        fingerprint, replay branch), commit (delete, purge, leak scan). The checkpoint is taken right
        before the input, so the restore changes no file this driver expects to read back.
        """
        c, sid, n = self.client, self.session_id, self.revoked
        c.checkpoint(sid, p.CheckpointRecord(checkpoint_id=f"cp-load-{n}", step=n, turn=0, token_offset=0,
                                             cache_handle="load", reason="turn"))
        secret = f"load-secret-{self.index}-{n}-{self.rng.getrandbits(32):08x}"
        c.record_artifacts(sid, [p.Artifact(artifact_id=f"user-{n + 1}", type="user", step=n + 1, content=secret)])
        raised = c.revoke(sid, f"user-{n + 1}")
        c.begin_revocation(raised.revocation.revocation_id)
        report = c.commit_revocation(p.CommitRevocationRequest(
            request_id=c._rid(), revocation_id=raised.revocation.revocation_id, tokens=p.TokenCounts(),
            transitions_replayed=1, final_step=n + 1))
        self.revoked += 1
        if report.leak_scan.get("hits"):
            self.report.fail("lost", f"{sid}: revoked value still found: {report.leak_scan}")

    def timed(self, op: str, action: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            action()
        except Exception as exc:  # counted, and the run goes on: the report says what failed
            self.report.fail("error", f"{self.session_id} {op}: {exc}")
            return
        self.report.record(op, time.perf_counter() - started)

    def write(self, step: int) -> None:
        path, content = f"f{step % FILES}.txt", f"{self.session_id}:{step}\n"
        self.expected.pop(path, None)  # unknown until acknowledged: an error leaves it unchecked
        self.client.call(self.session_id, "write_file", {"path": path, "content": content})
        self.expected[path] = content

    def read_back(self, path: str, timed: bool = True) -> None:
        def read() -> None:
            got = self.client.call(self.session_id, "read_file", {"path": path}).stdout
            if got != self.expected[path]:
                self.report.fail("lost", f"{self.session_id} {path}: {got!r} != {self.expected[path]!r}")
            self.report.checked()

        if timed:
            self.timed("read_file", read)
            return
        try:
            read()
        except Exception as exc:
            self.report.fail("error", f"{self.session_id} final read of {path}: {exc}")

    def echo(self) -> None:
        if self.client.call(self.session_id, "shell", {"command": "echo ok"}).stdout != "ok\n":
            raise AssertionError("shell echo answered something else")

    def take_snapshot(self) -> None:
        info = self.client.snapshot(self.session_id, label="load")
        self.snapshot = (info.snapshot_id, dict(self.expected))

    def restore(self) -> None:
        assert self.snapshot is not None
        self.client.restore(self.session_id, self.snapshot[0])
        self.expected = dict(self.snapshot[1])


def vm_rss_kb(pid: int) -> int:
    """The process's resident set (VmRSS) in kB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sample_rss(pid: int, report: LoadReport, stop: threading.Event, started: float) -> None:
    while not stop.is_set():
        report.rss_kb.append((time.monotonic() - started, vm_rss_kb(pid)))
        stop.wait(1.0)


def run_load(proc: DaemonProcess, sessions: int = 16, seconds: float = 60.0, max_ops: int = 100_000) -> LoadReport:
    """Drive `sessions` concurrent sessions against a running daemon for `seconds`."""
    assert proc.proc is not None and proc.endpoint.startswith("ipc://"), "the load driver stays on this machine"
    report = LoadReport()
    loads = [SessionLoad(proc.client(), i, report) for i in range(sessions)]
    opened = _in_threads([s.open for s in loads])
    if opened:
        raise RuntimeError(f"opening sessions failed: {opened[:3]}")
    stop, started = threading.Event(), time.monotonic()
    sampler = threading.Thread(target=sample_rss, args=(proc.proc.pid, report, stop, started), daemon=True)
    sampler.start()
    deadline = started + seconds
    report.errors += _in_threads([partial(s.run, deadline, max_ops) for s in loads])
    report.seconds = time.monotonic() - started
    stop.set()
    sampler.join()
    report.rss_kb.append((report.seconds, vm_rss_kb(proc.proc.pid)))
    report.errors += _in_threads([partial(s.client.close_session, s.session_id) for s in loads])
    return report


def _in_threads(actions: list[Callable[[], None]]) -> list[str]:
    """Run each action in its own thread; return the failures."""
    failures: list[str] = []

    def guarded(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:
            failures.append(repr(exc))

    threads = [threading.Thread(target=guarded, args=(a,)) for a in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def print_report(report: LoadReport, sessions: int, warmup_s: float) -> bool:
    """Print the figures; True when there were no errors, no lost calls and memory stayed flat."""
    print(f"{sessions} sessions, {report.seconds:.1f} s: {report.ops} ops ({report.ops / report.seconds:.1f}/s), "
          f"{report.tool_calls} tool calls ({report.tool_calls / report.seconds:.1f} calls/s)")
    for op, samples in sorted(report.latencies.items()):
        print(f"  {op:16s} n={len(samples):6d}  p50 {pct(samples, 50) * 1000:8.2f} ms  "
              f"p95 {pct(samples, 95) * 1000:8.2f} ms  p99 {pct(samples, 99) * 1000:8.2f} ms")
    print(f"errors: {len(report.errors)}" + "".join(f"\n  {e}" for e in report.errors[:10]))
    print(f"lost calls: {len(report.lost)} ({report.verified} reads checked)"
          + "".join(f"\n  {e}" for e in report.lost[:10]))
    first, settled, middle, last = report.rss_points(warmup_s)
    growth = report.rss_growth(warmup_s)
    flat = growth <= FLAT_TOLERANCE
    print(f"daemon VmRSS: start {first / 1024:.1f} MiB, after {warmup_s:.0f} s warm-up {settled / 1024:.1f} MiB, "
          f"middle {middle / 1024:.1f} MiB, end {last / 1024:.1f} MiB ({growth:+.1%}): "
          f"{'flat' if flat else 'GREW'} (limit +{FLAT_TOLERANCE:.0%})")
    return not report.errors and not report.lost and flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to drive load (soak: 300)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--max-ops", type=int, default=100_000, help="most ops per session")
    args = parser.parse_args()
    warmup = max(3.0, args.seconds * 0.2)
    with daemon() as proc:
        report = run_load(proc, args.sessions, args.seconds, args.max_ops)
    ok = print_report(report, args.sessions, warmup)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
