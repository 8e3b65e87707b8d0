"""Shared set-up for benchmarks: a daemon on a throw-away state directory, and percentiles."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sandboxd.launcher import DaemonProcess


@contextmanager
def daemon(extra_args: list[str] | None = None) -> Iterator[DaemonProcess]:
    """A running daemon, shut down and cleaned up on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-bench-"))
    proc = DaemonProcess(tmp / "state", extra_args)
    try:
        proc.start()
        yield proc
    finally:
        proc.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def pct(samples: list[float], q: float) -> float:
    """The q-th percentile (0-100) of samples, by linear interpolation."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1] if 0 < q < 100 else ordered[-1]
