"""Authenticated transport and session ownership against a live daemon on tcp:// with CURVE.

Keys come from `sandboxd keys`. The daemon admits the allowlisted agents A and B and the operator;
a stranger's key, a client without CURVE and a client pinning the wrong server key get nothing but
a timeout. A session is its opener's: the other agent is refused with `unauthorized` on every
request that names it, an operator (or the ipc socket's owner) is not.
"""

from __future__ import annotations

import json
import shutil
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sandboxd import protocol as p
from sandboxd.auth import read_public_key
from sandboxd.cli import main as cli
from sandboxd.client import Client, DaemonUnreachable, RemoteError
from sandboxd.config import load_config
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.docker

NAMES = ("server", "agent-a", "agent-b", "operator", "stranger")


@dataclass
class Keys:
    root: Path
    allowlist: Path

    def public(self, name: str) -> Path:
        return self.root / name / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.root / name / f"{name}.key_secret"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """A keypair per party, each in its own directory; the allowlist holds the two agents' public keys."""
    root = tmp_path_factory.mktemp("keys")
    for name in NAMES:
        cli(["keys", "--dir", str(root / name), "--name", name])
    allowlist = root / "allowlist"
    allowlist.mkdir()
    for name in ("agent-a", "agent-b"):
        shutil.copy(root / name / f"{name}.key", allowlist)
    return Keys(root, allowlist)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class CurveDaemon:
    daemon: DaemonProcess
    endpoint: str
    keys: Keys

    def client(self, name: str, server: str = "server", timeout_s: float = 30.0) -> Client:
        client = Client.with_key_files(self.endpoint, self.keys.public(server), self.keys.secret(name), timeout_s)
        self.daemon.clients.append(client)  # closed with the daemon
        return client


@pytest.fixture
def curve(daemon_factory: Callable[..., DaemonProcess], keys: Keys, tmp_path: Path) -> CurveDaemon:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "sandboxd.toml"
    config.write_text(f'endpoint = "{endpoint}"\n\n[auth]\n'
                      f'server_secret_key_file = "{keys.secret("server")}"\n'
                      f'client_keys_dir = "{keys.allowlist}"\n'
                      f'operator_keys = ["{keys.public("operator")}"]\n')
    return CurveDaemon(daemon_factory(["--config", str(config)]), endpoint, keys)


def log_lines(daemon: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (daemon.state_dir / "sandboxd.log").read_text().splitlines()]


# Keys and configuration ----------------------------------------------------------------------


def test_keys_writes_a_public_file_and_an_owner_only_secret_file(keys: Keys) -> None:
    secret, public = keys.secret("agent-a"), keys.public("agent-a")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert 'secret-key = "' in secret.read_text() and "secret-key" not in public.read_text()
    assert read_public_key(secret) == read_public_key(public)
    with pytest.raises(SystemExit, match="exists"):
        cli(["keys", "--dir", str(secret.parent), "--name", "agent-a"])


def test_tcp_without_curve_refuses_to_start(tmp_path: Path, keys: Keys) -> None:
    with pytest.raises(SystemExit, match="without CURVE authentication"):
        cli(["serve", "--state-dir", str(tmp_path / "state"), "--endpoint", "tcp://127.0.0.1:1"])
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[auth]\nserver_secret_key_file = "{keys.public("server")}"\n'
                   f'client_keys_dir = "{keys.allowlist}"\n')
    with pytest.raises(SystemExit, match="holds no secret-key"):
        cli(["serve", "--config", str(bad), "--state-dir", str(tmp_path / "state"), "--endpoint", "tcp://127.0.0.1:1"])


def test_curve_lifts_the_loopback_only_rule(tmp_path: Path, keys: Keys) -> None:
    config = load_config(None, state_dir=str(tmp_path), endpoint="tcp://0.0.0.0:5555",
                         auth={"server_secret_key_file": str(keys.secret("server")),
                               "client_keys_dir": str(keys.allowlist)})
    assert config.auth.curve and config.local_endpoint == f"ipc://{tmp_path.resolve()}/sandboxd.sock"


# Transport -----------------------------------------------------------------------------------


def test_allowlisted_client_is_served_and_the_ipc_socket_is_owner_only(curve: CurveDaemon,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    a = curve.client("agent-a")
    assert a.health().protocol == p.PROTOCOL_VERSION
    session = a.open_session().session_id
    assert a.call(session, "shell", {"command": "echo hi"}).stdout == "hi\n"
    capsys.readouterr()
    cli(["session", "list", "--json", "--endpoint", curve.endpoint, "--server-key", str(curve.keys.public("server")),
         "--client-key", str(curve.keys.secret("agent-a"))])
    assert [s["session_id"] for s in json.loads(capsys.readouterr().out)] == [session]
    assert stat.S_IMODE((curve.daemon.state_dir / "sandboxd.sock").stat().st_mode) == 0o600
    assert stat.S_IMODE(curve.daemon.state_dir.stat().st_mode) == 0o700


def test_strangers_are_refused_and_logged(curve: CurveDaemon) -> None:
    stranger = curve.client("stranger", timeout_s=1.5)
    with pytest.raises(DaemonUnreachable, match="authentication"):
        stranger.health()
    key = read_public_key(curve.keys.public("stranger"))
    deadline = time.monotonic() + 5
    while not any(line.get("peer_key") == key for line in log_lines(curve.daemon)):
        assert time.monotonic() < deadline, "the refusal was not logged"
        time.sleep(0.1)
    refusals = [line for line in log_lines(curve.daemon) if line.get("peer_key") == key]
    assert refusals[0]["level"] == "warning" and key in refusals[0]["msg"]
    assert len(refusals) == 1, "a retrying client must not flood the log"

    plain = Client(curve.endpoint, timeout_s=1.5)
    with pytest.raises(DaemonUnreachable, match="requires CURVE authentication"):
        plain.health()
    plain.close()
    impostor = curve.client("agent-a", server="agent-b", timeout_s=1.5)  # pins a key that is not the daemon's
    with pytest.raises(DaemonUnreachable, match="authentication"):
        impostor.health()
    assert curve.client("agent-a").health().protocol == p.PROTOCOL_VERSION


def test_removing_a_key_file_shuts_that_client_out(curve: CurveDaemon) -> None:
    assert curve.client("agent-b").health()
    removed = curve.keys.allowlist / "agent-b.key"
    saved = removed.read_bytes()
    removed.unlink()
    try:
        with pytest.raises(DaemonUnreachable, match="authentication"):
            curve.client("agent-b", timeout_s=1.5).health()
    finally:
        removed.write_bytes(saved)


# Ownership -----------------------------------------------------------------------------------


def _revocable(client: Client, session: str) -> str:
    """A revocation raised in `session`: a checkpoint, then a user input to revoke."""
    client.record_artifacts(session, [p.Artifact(artifact_id="sys", type="system", content="be helpful")])
    client.checkpoint(session, p.CheckpointRecord(checkpoint_id="cp-0", step=0, turn=0, token_offset=0,
                                                  cache_handle="none", reason="start", manifest=["sys"]),
                      snapshot=False)
    client.record_artifacts(session, [p.Artifact(artifact_id="user-1", type="user", parents=["sys"], step=1,
                                                 content="my password is hunter2")])
    return client.revoke(session, "user-1", "hunter2").revocation.revocation_id


def test_agents_cannot_touch_each_others_sessions_but_operators_can(curve: CurveDaemon) -> None:
    a, b, operator = curve.client("agent-a"), curve.client("agent-b"), curve.client("operator")
    session = a.open_session().session_id
    mine = b.open_session().session_id
    for attempt in (lambda: b.call(session, "shell", {"command": "id"}), lambda: b.snapshot(session),
                    lambda: b.revoke(session, "user-1"), lambda: b.graph(session),
                    lambda: b.close_session(session)):
        with pytest.raises(RemoteError) as refused:
            attempt()
        assert refused.value.wire_code == "unauthorized" and refused.value.details["session_id"] == session
    assert [s.session_id for s in b.sessions()] == [mine]
    assert [s.session_id for s in a.sessions()] == [session]
    assert {s.session_id for s in operator.sessions()} == {session, mine}

    revocation = _revocable(operator, session)
    assert operator.call(session, "shell", {"command": "echo op"}).stdout == "op\n"
    assert operator.snapshot(session).session_id == session
    assert {x.artifact_id for x in operator.graph(session).artifacts} == {"sys", "user-1"}
    assert a.revocation_status(revocation).revocation.session_id == session
    with pytest.raises(RemoteError, match="belongs to another client"):
        b.revocation_status(revocation)
    with pytest.raises(RemoteError, match="for operators only"):
        b.outbox()
    local = curve.daemon.client()  # the ipc socket's owner is an operator too
    assert {s.session_id for s in local.sessions()} == {session, mine}


# What each session-naming request needs besides its session (or revocation) to be well-formed.
SAMPLE_FIELDS: dict[str, dict[str, Any]] = {
    "CloseSessionRequest": {}, "ListToolsRequest": {}, "ListCallsRequest": {}, "OutboxRequest": {},
    "GraphRequest": {}, "PendingRevocationsRequest": {}, "SnapshotRequest": {}, "ListSnapshotsRequest": {},
    "CallRequest": {"tool": "shell", "args": {"command": "touch /workspace/owned"}},
    "RestoreRequest": {"snapshot_id": "snap-x"}, "DeleteSnapshotRequest": {"snapshot_id": "snap-x"},
    "CommitTurnRequest": {"turn": 1}, "DropTurnRequest": {"turn": 1}, "WaitEventsRequest": {"timeout_s": 0},
    "RecordArtifactsRequest": {"artifacts": [{"artifact_id": "evil", "type": "user"}]},
    "CheckpointRequest": {"checkpoint": {"checkpoint_id": "cp-x", "step": 0, "turn": 0, "token_offset": 0,
                                         "cache_handle": "x", "reason": "start"}},
    "ProvenanceRequest": {"source": "user-1"}, "RevokeRequest": {"source": "user-1"},
    "BeginRevocationRequest": {}, "RevocationStatusRequest": {},
    "CommitRevocationRequest": {"tokens": {}, "transitions_replayed": 0, "final_step": 0},
    "WorldResetRequest": {"injections": {"v": "x"}}, "WorldStateRequest": {},
    "CopyInRequest": {"path": "owned", "data": b"x"}, "CopyOutRequest": {"path": "owned"},
    "CallOutputRequest": {"call_id": "c-1", "timeout_s": 0},
    "RollbackRequest": {"turn": 0}, "ForkRequest": {"checkpoint": "cp-x"}, "ListRevocationsRequest": {},
    "CancelRevocationRequest": {"reason": "not mine"}, "AdoptSessionRequest": {},
}


def _names_a_session(cls: type[Any]) -> bool:
    return bool({"session_id", "revocation_id"} & set(cls.__struct_fields__))


def test_every_request_naming_a_session_is_refused_to_others(curve: CurveDaemon) -> None:
    a, b = curve.client("agent-a"), curve.client("agent-b")
    session = a.open_session().session_id
    revocation = _revocable(a, session)
    kinds = sorted(name for name, cls in p.REQUEST_TYPES.items() if _names_a_session(cls))
    assert sorted(SAMPLE_FIELDS) == kinds, "a new request names a session: add it to SAMPLE_FIELDS"
    for name in kinds:
        cls = p.REQUEST_TYPES[name]
        ids = {"session_id": session} if "session_id" in cls.__struct_fields__ else {"revocation_id": revocation}
        request = msgspec.convert({"request_id": f"r-{name}", **ids, **SAMPLE_FIELDS[name]}, cls)
        reply = b.send_raw(p.encode(request))
        assert isinstance(reply, p.ErrorResponse) and reply.code == "unauthorized", (name, reply)
    for name in ("ReleaseCallRequest", "DropCallRequest", "ResolveCallRequest"):
        fields = {"outcome": "done"} if name == "ResolveCallRequest" else {}
        request = msgspec.convert({"request_id": "r", "call_id": "fx-1", **fields}, p.REQUEST_TYPES[name])
        reply = b.send_raw(p.encode(request))
        assert isinstance(reply, p.ErrorResponse) and reply.code == "unauthorized", (name, reply)
    # The outside world is the operator's: not even a session's owner resets it or reads it whole.
    for name in ("WorldResetRequest", "WorldStateRequest"):
        request = msgspec.convert({"request_id": "r", "session_id": session}, p.REQUEST_TYPES[name])
        reply = a.send_raw(p.encode(request))
        assert isinstance(reply, p.ErrorResponse) and reply.code == "unauthorized", (name, reply)
    # Nothing the refused requests asked for happened.
    assert a.call(session, "shell", {"command": "ls /workspace"}).stdout == ""
    assert [s.state for s in a.sessions()] == ["open"]
    assert {x.artifact_id for x in a.graph(session).artifacts} == {"sys", "user-1"}
    assert a.revocation_status(revocation).revocation.state == "pending"
