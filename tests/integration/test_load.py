"""A short run of the load driver (`benchmarks/bench_load.py`): 16 sessions for ~15 s, so CI exercises it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.bench_load import print_report, run_load
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.docker

SESSIONS = 16
SECONDS = 15.0
WARMUP_S = 5.0
#: looser than the soak's +20%: fifteen seconds leave little time after warm-up for RSS to settle
RSS_GROWTH_LIMIT = 0.5


def test_sixteen_sessions_under_load_lose_nothing(daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    report = run_load(daemon, sessions=SESSIONS, seconds=SECONDS)
    print_report(report, SESSIONS, WARMUP_S)  # shown by pytest -rA or on failure
    assert report.errors == []
    assert report.lost == []
    assert report.verified > SESSIONS, "the run checked too few reads to mean anything"
    assert {"shell", "write_file", "read_file", "snapshot", "restore", "revocation"} <= set(report.latencies)
    assert report.rss_growth(WARMUP_S) <= RSS_GROWTH_LIMIT
