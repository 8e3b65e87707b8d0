"""Fixtures that run a real daemon process against the real Docker engine.

Every daemon gets its own state directory; teardown closes its sessions, kills the process, removes
any container it labelled and unmounts what its snapshot store mounted, so nothing outlives a test.

Daemons run their sandboxes under runc unless a test is parametrized over `RUNTIMES` (see
`both_runtimes`): the modules that cover the sandbox, snapshots, revocation, forgetting, crashes and
hardening run under gVisor's runsc as well.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import docker
from agent.compare import TREE_LISTING
from sandboxd.client import Client
from sandboxd.launcher import DaemonProcess
from tests.sinks import HttpSink, MailSink

__all__ = ["DaemonProcess", "RUNTIMES", "both_runtimes", "tree_listing_code"]

pytestmark = pytest.mark.docker

RUNTIMES = ("runc", "runsc")
both_runtimes = pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
"""Run a test (or, as a module's pytestmark, every test of it) once per runtime."""


@pytest.fixture
def runtime(request: pytest.FixtureRequest) -> str:
    """The OCI runtime the test's daemons run sandboxes under: runc unless parametrized."""
    return str(getattr(request, "param", "runc"))


@pytest.fixture(scope="session")
def engine() -> docker.DockerClient:
    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture
def daemon_factory(engine: docker.DockerClient, runtime: str) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons on fresh state directories, under the test's runtime; all are cleaned up after it."""
    made: list[tuple[DaemonProcess, Path]] = []

    def make(extra_args: list[str] | None = None) -> DaemonProcess:
        tmp = Path(tempfile.mkdtemp(prefix="sandboxd-test-"))
        daemon = DaemonProcess(tmp / "state", ["--runtime", runtime, *(extra_args or [])])
        made.append((daemon, tmp))
        daemon.start()
        return daemon

    yield make
    for daemon, tmp in made:
        daemon.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def client(daemon: DaemonProcess) -> Client:
    return daemon.client()


@pytest.fixture
def session(client: Client) -> str:
    return client.open_session().session_id


def tree_listing_code() -> str:
    """Python run inside a sandbox that prints its workspace tree: path, type, mode, size, digest."""
    return TREE_LISTING


# The outside world of the firewall's tests: one fixture each, shared (a test wanting a slow relay
# overrides `smtp` with a MailSink subclass).

@pytest.fixture
def smtp() -> Iterator[MailSink]:
    sink = MailSink()
    yield sink
    sink.close()


@pytest.fixture
def http() -> Iterator[HttpSink]:
    """An HTTP sink whose paths under /slow answer after 3 s (longer than the adapters' timeouts)."""
    sink = HttpSink(delay=3.0)
    yield sink
    sink.close()
