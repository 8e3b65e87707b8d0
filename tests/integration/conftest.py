"""Fixtures that run a real daemon process against the real Docker engine.

Every daemon gets its own state directory; teardown closes its sessions, kills the process, removes
any container it labelled and unmounts what its snapshot store mounted, so nothing outlives a test.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from sandboxd.client import Client, DaemonUnreachable
from sandboxd.sandbox.containers import LABEL_INSTANCE

pytestmark = pytest.mark.docker


class DaemonProcess:
    """A `sandboxd serve` subprocess that tests can kill -9 and start again on the same state."""

    def __init__(self, state_dir: Path, extra_args: list[str] | None = None) -> None:
        self.state_dir = state_dir
        self.endpoint = f"ipc://{state_dir / 'sandboxd.sock'}"
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = state_dir.parent / "daemon.stderr"
        self.clients: list[Client] = []

    def start(self) -> None:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandboxd.cli", "serve", "--state-dir", str(self.state_dir),
                 *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=err,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with Client(self.endpoint, timeout_s=0.5) as probe:
                    probe.health()
                return
            except DaemonUnreachable:
                continue
        raise RuntimeError(f"daemon did not answer within 30 s: {self.log.read_text()[-2000:]}")

    def client(self, timeout_s: float = 120.0) -> Client:
        client = Client(self.endpoint, timeout_s=timeout_s)
        self.clients.append(client)
        return client

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        for client in self.clients:
            client.close()

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def instance(self) -> str:
        return hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:16]


def _mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return sorted((p for p in points if p.startswith(str(root))), key=len, reverse=True)


def cleanup_daemon(daemon: DaemonProcess) -> None:
    """Close sessions politely, then remove whatever is left by force."""
    if daemon.proc is not None and daemon.proc.poll() is None:
        try:
            with Client(daemon.endpoint, timeout_s=30) as client:
                for session in client.sessions():
                    client.close_session(session.session_id)
        except Exception as exc:  # teardown must go on; the forced cleanup below catches the rest
            print(f"teardown: polite close failed: {exc}", file=sys.stderr)
    daemon.kill(signal.SIGTERM)
    engine = docker.from_env()
    for container in engine.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={daemon.instance}"}):
        container.remove(force=True, v=True)
    for point in _mounts_under(daemon.state_dir):
        subprocess.run(["umount", "-l", point], check=False)


@pytest.fixture(scope="session")
def engine() -> docker.DockerClient:
    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture
def daemon_factory(engine: docker.DockerClient) -> Iterator[type[DaemonProcess]]:
    """Start daemons on fresh state directories; all are cleaned up after the test."""
    made: list[tuple[DaemonProcess, Path]] = []

    def make(extra_args: list[str] | None = None) -> DaemonProcess:
        tmp = Path(tempfile.mkdtemp(prefix="sandboxd-test-"))
        daemon = DaemonProcess(tmp / "state", extra_args)
        made.append((daemon, tmp))
        daemon.start()
        return daemon

    yield make  # type: ignore[misc]
    for daemon, tmp in made:
        cleanup_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:  # type: ignore[no-untyped-def]
    return daemon_factory()


@pytest.fixture
def client(daemon: DaemonProcess) -> Client:
    return daemon.client()


@pytest.fixture
def session(client: Client) -> str:
    return client.open_session().session_id


def tree_listing_code() -> str:
    """Python run inside a sandbox that prints its workspace tree: path, type, mode, size, digest."""
    return (
        "import hashlib, json, os, stat\n"
        "out = []\n"
        "for base, dirs, files in os.walk('/workspace/', followlinks=False):\n"
        "    for name in sorted(dirs + files):\n"
        "        full = os.path.join(base, name); st = os.lstat(full)\n"
        "        kind = 'link' if stat.S_ISLNK(st.st_mode) else 'dir' if stat.S_ISDIR(st.st_mode) else 'file'\n"
        "        digest = os.readlink(full) if kind == 'link' else (\n"
        "            hashlib.sha256(open(full, 'rb').read()).hexdigest() if kind == 'file' else '')\n"
        "        out.append([os.path.relpath(full, '/workspace'), kind, oct(st.st_mode), st.st_size, digest])\n"
        "print(json.dumps(sorted(out)))\n"
    )


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the overlay snapshot store and the Docker engine need root; run the tests as root")
