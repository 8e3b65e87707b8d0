"""Shared set-up for benchmarks: a daemon on a throw-away state directory, and percentiles.

With SANDBOXD_PROFILE=path, py-spy records the daemon for as long as it runs (every thread, idle ones
included, so waits show): path.svg a flame graph, any other name py-spy's raw collapsed stacks.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
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
    spy = None
    try:
        proc.start()
        if (profile := os.environ.get("SANDBOXD_PROFILE")) and proc.proc is not None:
            spy = subprocess.Popen(
                [shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy", "record",
                 "--pid", str(proc.proc.pid), "--output", profile, "--rate", "500", "--idle", "--threads",
                 *([] if profile.endswith(".svg") else ["--format", "raw"])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield proc
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it recorded and exits
            spy.wait(60)
        proc.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def pct(samples: list[float], q: float) -> float:
    """The q-th percentile (0-100) of samples, by linear interpolation."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1] if 0 < q < 100 else ordered[-1]
