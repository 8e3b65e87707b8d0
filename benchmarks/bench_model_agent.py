"""A model-driven session, in one run: free-generation throughput, and a revocation's cost against B5.

    .venv/bin/python -m benchmarks.bench_model_agent

The fixture model (agent/models/fixture) plays the built-in finance scenario on the local backend,
greedy, in a real sandbox; the page hijacks it; the detector's revocation is replayed; B5 (a fresh
session that never sees the injection) runs in a second world. Printed: the session's wall time,
tokens per second of wall time (tool calls in the sandbox included), and the tokens the revocation recomputed
against B5's.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from agent.harness import MailSink, Web, daemon_config, run_model_session
from agent.models.fixture_data import FIXTURE_HOST
from agent.revocation import apply_pending
from agent.scenarios import INJECTION, VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-model-"))
    mails, web = [MailSink(), MailSink()], Web({"/vendors": VENDOR_PAGE}, name=FIXTURE_HOST)
    daemons = [DaemonProcess(tmp / f"{n}-state", ["--config", str(daemon_config(tmp / f"{n}.toml", m, web))],
                             log=tmp / f"{n}.log") for n, m in zip("ab", mails, strict=True)]
    try:
        for daemon in daemons:
            daemon.start()
        scenario = finance(web.url("/vendors"), compact_every=0)
        started = time.perf_counter()
        agent = run_model_session(daemons[0].client(), scenario, WORKSPACE)
        wall = time.perf_counter() - started
        assert agent.conversation is not None
        meter = agent.conversation.meter
        calls = len(agent.calls_made)
        [report] = apply_pending(agent)
        started = time.perf_counter()
        reference = run_model_session(daemons[1].client(), scenario, WORKSPACE, forget=[INJECTION])
        b5_wall = time.perf_counter() - started
        assert reference.conversation is not None
        b5 = reference.conversation.meter.recomputed
        result = {
            "session_wall_s": round(wall, 2), "turns": agent.turn, "tool_calls": calls,
            "decoded_tokens": meter.decoded, "prefilled_tokens": meter.prefilled,
            "decoded_per_s_wall": round(meter.decoded / wall, 1),
            "tokens_per_s_wall": round(meter.recomputed / wall, 1),
            "hijacked": "q3 figures" in mails[0].subjects(),
            "b7_recomputed": report.tokens.recomputed, "b7_reused_prefix": report.tokens.reused_prefix,
            "b7_wall_s": round(report.wall_ms / 1000, 2), "b5_recomputed": b5, "b5_wall_s": round(b5_wall, 2),
            "b5_over_b7": round(b5 / max(report.tokens.recomputed, 1), 2),
        }
        print(json.dumps(result, indent=2))
    finally:
        for daemon in daemons:
            daemon.shutdown()
        for server in (*mails, web):
            server.close()


if __name__ == "__main__":
    main()
