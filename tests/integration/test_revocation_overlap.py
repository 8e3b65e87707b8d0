"""Revocations of different sessions do not wait on each other.

Session A's revocation is held in the middle of its work, not by a timer: its sandbox is frozen
(`docker pause`), so beginning it blocks while it quiesces the sandbox, holding A's session lock. A
whole revocation of session B, begin to commit, must then finish while A's is still in flight: no lock,
queue or transaction of the daemon is shared across sessions for longer than a step. Then A goes on
and ends as clean as B.
"""

from __future__ import annotations

import threading

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
