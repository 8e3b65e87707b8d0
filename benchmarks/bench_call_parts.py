"""Where a tool call's time goes in the daemon: its parts timed in-process, and the executor's round trip.

A daemon's service is built in this process (no ZeroMQ, no socket thread), a session opened, and each part
of `Calls.call` wrapped with a timer; then the executor channel alone, against the run time the executor
reports for the same command. What `bench_calls` sees at the client on top of this is ZeroMQ and the
hand-offs between the daemon's socket thread and its workers.

    .venv/bin/python -m benchmarks.bench_call_parts [--n 300]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._harness import pct
from sandboxd import protocol as p
from sandboxd.auth import LOCAL_PEER
from sandboxd.config import load_config
from sandboxd.daemon import build
from sandboxd.tools.builtin import executor_request

CALLS = {"shell": {"command": "echo ok"}, "read_file": {"path": "note.txt"}, "list_dir": {"path": "."}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-parts-"))
    service, _server = build(load_config(state_dir=str(tmp / "state")))
    parts: dict[str, list[float]] = defaultdict(list)
    calls = service.calls
    for owner, name, label in ((calls.tools, "validate", "argument validation"),
                               (calls.sessions, "check_open", "session check"),
                               (calls, "_begin", "ledger: running record"),
                               (calls.sessions, "executor", "executor (or host read)"),
                               (calls, "sanitized", "forgetting filter"),
                               (calls, "_finish", "ledger: result record"),
                               (service.metrics, "observe", "metrics"),
                               (service.events, "publish", "event")):
        _timed(owner, name, parts[label].append)
    sid = service.handle(p.OpenSessionRequest(request_id="open"), LOCAL_PEER).session.session_id  # type: ignore[attr-defined]
    try:
        service.handle(p.CallRequest(request_id="w", session_id=sid, tool="write_file",
                                     args={"path": "note.txt", "content": "ok\n"}), LOCAL_PEER)
        print(f"daemon side of a call, in-process, n={args.n} each (p50, ms)")
        for tool, tool_args in CALLS.items():
            whole = _handle_many(service, sid, tool, tool_args, args.n, parts)
            print(f"  {tool:10s} whole {whole:6.3f}: " + ", ".join(
                f"{label} {pct(samples, 50) * 1000:.3f}" for label, samples in parts.items() if samples))
        print("executor channel alone (p50, ms)")
        for tool, tool_args in CALLS.items():
            payload = {**executor_request(tool, tool_args), "timeout": 60.0, "output_bytes": 65536,
                       "max_bytes": 1 << 20}
            wall, inside = [], []
            for i in range(args.n + 20):
                started = time.perf_counter()
                reply = service.sessions.executor(sid, dict(payload), 70.0)
                if i >= 20:
                    wall.append(time.perf_counter() - started)
                    inside.append(float(reply.get("duration_ms", 0.0)) / 1000)
            print(f"  {tool:10s} round trip {pct(wall, 50) * 1000:6.3f}"
                  + (f", of which the executor's run_process {pct(inside, 50) * 1000:6.3f}" if any(inside) else ""))
    finally:
        service.handle(p.CloseSessionRequest(request_id="close", session_id=sid), LOCAL_PEER)
        service.sessions.stop_all()  # as the daemon stops: the store's mounts go, then its directory can
        service.db.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _handle_many(service: Any, sid: str, tool: str, tool_args: dict[str, Any], n: int,
                 parts: dict[str, list[float]]) -> float:
    for _ in range(20):  # warm-up
        service.handle(p.CallRequest(request_id="warm", session_id=sid, tool=tool, args=tool_args), LOCAL_PEER)
    for samples in parts.values():
        samples.clear()
    whole = []
    for _ in range(n):
        request = p.CallRequest(request_id=uuid.uuid4().hex, session_id=sid, tool=tool, args=tool_args)
        started = time.perf_counter()
        reply = service.handle(request, LOCAL_PEER)
        whole.append(time.perf_counter() - started)
        assert isinstance(reply, p.CallResponse), reply
    return pct(whole, 50) * 1000


def _timed(owner: Any, name: str, record: Callable[[float], None]) -> None:
    """Wrap owner.name so each call's duration goes to `record`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    setattr(owner, name, timed)


if __name__ == "__main__":
    main()
