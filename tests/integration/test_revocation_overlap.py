"""Revocations of different sessions do not wait on each other.

Session A's revocation is held in the middle of its work, not by a timer: its sandbox is frozen
(`docker pause`), so beginning it blocks while it quiesces the sandbox, holding A's session lock. A
whole revocation of session B, begin to commit, must then finish while A's is still in flight: no lock,
queue or transaction of the daemon is shared across sessions for longer than a step. Then A goes on
and ends as clean as B.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

import docker
from sandboxd import protocol as p
from sandboxd.client import Client
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.docker


def raise_revocation(client: Client, session_id: str, secret: str) -> str:
    """A checkpoint, an input carrying `secret` after it, and its revocation; returns the revocation id."""
    client.call(session_id, "write_file", {"path": "notes.txt", "content": "kept\n"})
    client.checkpoint(session_id, p.CheckpointRecord(checkpoint_id=f"cp-{session_id}", step=0, turn=0,
                                                     token_offset=0, cache_handle="overlap", reason="turn"))
    client.record_artifacts(session_id, [p.Artifact(artifact_id="user-1", type="user", step=1, content=secret)])
    return client.revoke(session_id, "user-1").revocation.revocation_id


def commit(client: Client, revocation_id: str) -> p.RevocationReport:
    return client.commit_revocation(p.CommitRevocationRequest(
        request_id=f"commit-{revocation_id}", revocation_id=revocation_id, tokens=p.TokenCounts(),
        transitions_replayed=1, final_step=1))


def test_a_revocation_finishes_while_another_sessions_revocation_is_held(daemon: DaemonProcess,
                                                                         engine: docker.DockerClient) -> None:
    client = daemon.client()
    a, b = client.open_session(), client.open_session()
    assert a.container is not None
    held = raise_revocation(client, a.session_id, "overlap-secret-of-a-4f1d9c")
    other = raise_revocation(client, b.session_id, "overlap-secret-of-b-8e2a71")
    frozen = engine.containers.get(a.container)
    began: dict[str, p.BeginRevocationResponse | BaseException] = {}

    def begin_held() -> None:
        try:
            began["a"] = daemon.client().begin_revocation(held)  # a client of its own: sockets are per thread
        except BaseException as exc:
            began["a"] = exc

    frozen.pause()
    try:
        thread = threading.Thread(target=begin_held, daemon=True)
        thread.start()
        client.begin_revocation(other)
        report = commit(client, other)
        assert thread.is_alive() and "a" not in began, "session B's revocation waited for session A's"
    finally:
        frozen.unpause()
    thread.join(120)
    assert isinstance(began.get("a"), p.BeginRevocationResponse), began
    assert not report.leak_scan.get("hits"), report.leak_scan
    assert not commit(client, held).leak_scan.get("hits")
    for session in (a, b):
        assert client.call(session.session_id, "read_file", {"path": "notes.txt"}).stdout == "kept\n"


def stored_bytes(path: Path) -> Iterator[tuple[Path, bytes]]:
    """Every regular file under `path` with the bytes it stores (the data of sparse files, holes skipped)."""
    for root, _, names in os.walk(path):
        for name in names:
            file = Path(root) / name
            if not file.is_file() or file.is_symlink():
                continue
            with open(file, "rb") as fh:
                size, position, data = os.fstat(fh.fileno()).st_size, 0, []
                while position < size:
                    try:
                        start = os.lseek(fh.fileno(), position, os.SEEK_DATA)
                    except OSError:  # ENXIO: only a hole is left
                        break
                    end = os.lseek(fh.fileno(), start, os.SEEK_HOLE)
                    data.append(os.pread(fh.fileno(), end - start, start))
                    position = end
            yield file, b"".join(data)


def copies(state_dir: Path, values: Iterable[str]) -> list[tuple[str, str]]:
    """(file, value) for each value whose bytes (UTF-8 or UTF-16) some file under `state_dir` stores."""
    forms = [(value, form) for value in values for form in (value.encode(), value.encode("utf-16-le"))]
    return sorted({(str(file), value) for file, data in stored_bytes(state_dir) for value, form in forms
                   if form in data})


def test_two_revocations_committing_at_once_both_leave_no_copy_in_any_state_file(daemon: DaemonProcess) -> None:
    """Revocations that commit together share the checkpoint that empties the WAL (`Database.purge`); each is
    reported only once no copy of its value is left in the database, its WAL, the log or the snapshot store."""
    client = daemon.client()
    secrets = {"a": "grouped-secret-of-a-3b9e04d1c7", "b": "grouped-secret-of-b-61f2a8e590"}
    sessions = {name: client.open_session().session_id for name in secrets}
    raised = {name: raise_revocation(client, sessions[name], secret) for name, secret in secrets.items()}
    # The scan can see them: before the revocations each value is stored (its artifact's row, at least).
    assert {secret for _, secret in copies(daemon.state_dir, secrets.values())} == set(secrets.values())
    for revocation_id in raised.values():
        client.begin_revocation(revocation_id)
    barrier = threading.Barrier(len(raised))
    reports: dict[str, p.RevocationReport | BaseException] = {}

    def commit_at_once(name: str) -> None:
        own = daemon.client()  # sockets are per thread
        barrier.wait(30)
        try:
            reports[name] = commit(own, raised[name])
        except BaseException as exc:
            reports[name] = exc

    threads = [threading.Thread(target=commit_at_once, args=(name,), daemon=True) for name in raised]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name in secrets:
        report = reports.get(name)
        assert isinstance(report, p.RevocationReport), reports
        assert not report.leak_scan.get("hits"), report.leak_scan
    assert copies(daemon.state_dir, secrets.values()) == []
