"""Run a daemon as a child process (demo, benchmarks, tests) and take everything down afterwards."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
from sandboxd.client import Client, DaemonUnreachable
from sandboxd.sandbox.containers import LABEL_INSTANCE


class DaemonProcess:
    """A `sandboxd serve` subprocess on its own state directory; can be killed and started again."""

    def __init__(self, state_dir: Path, extra_args: list[str] | None = None, log: Path | None = None) -> None:
        self.state_dir = state_dir.resolve()
        self.endpoint = f"ipc://{self.state_dir / 'sandboxd.sock'}"
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = log or self.state_dir.parent / "daemon.stderr"
        self.clients: list[Client] = []

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the daemon and wait until it answers Health."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandboxd.cli", "serve", "--state-dir", str(self.state_dir),
                 *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=err,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with Client(self.endpoint, timeout_s=0.5) as probe:
                    probe.health()
                return
            except DaemonUnreachable:
                continue
        raise RuntimeError(f"daemon did not answer within {timeout_s:g} s: {self.log.read_text()[-2000:]}")

    def client(self, timeout_s: float = 120.0) -> Client:
        """A client of this daemon, closed when the daemon is killed."""
        client = Client(self.endpoint, timeout_s=timeout_s)
        self.clients.append(client)
        return client

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)
        for client in self.clients:
            client.close()

    def restart(self) -> None:
        """kill -9, then a new process on the same state."""
        self.kill()
        self.start()

    @property
    def runtime(self) -> str:
        """The OCI runtime of this daemon's sandboxes, as its command line sets it (runc by default)."""
        args = self.extra_args
        return args[args.index("--runtime") + 1] if "--runtime" in args[:-1] else "runc"

    @property
    def instance(self) -> str:
        return hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:16]

    def shutdown(self, close_sessions: bool = True) -> None:
        """Close sessions politely, stop the process, then remove by force whatever is left.

        `close_sessions=False` leaves the sessions open in the state (the demo's, for an operator to inspect):
        a daemon started on it again recreates their sandboxes."""
        if close_sessions and self.proc is not None and self.proc.poll() is None:
            try:
                with Client(self.endpoint, timeout_s=60) as client:
                    for session in client.sessions():
                        client.close_session(session.session_id)
            except Exception as exc:  # shutdown goes on; the forced clean-up below catches the rest
                print(f"shutdown: closing sessions failed: {exc}", file=sys.stderr)
        self.kill(signal.SIGTERM)
        engine = docker.from_env()
        for container in engine.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={self.instance}"}):
            container.remove(force=True, v=True)
        for point in mounts_under(self.state_dir):
            subprocess.run(["umount", "-l", point], check=False)


def mounts_under(root: Path) -> list[str]:
    """Mount points below `root`, deepest first."""
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return sorted((p for p in points if p.startswith(str(root))), key=len, reverse=True)
