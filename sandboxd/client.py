"""The Python client: the daemon's operations for programs, over a ZeroMQ DEALER socket.

Over ipc:// nothing is needed beyond access to the socket file. A tcp:// daemon speaks only CURVE:
pin its public key and present an allowlisted keypair (`Client.with_key_files`, or the CLI's
`--server-key` / `--client-key`). A refused handshake is silent, so refusal shows as a timeout.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq

from sandboxd import protocol as p
from sandboxd.auth import read_public_key, read_secret_key
from sandboxd.config import default_endpoint, default_state_dir
from sandboxd.errors import ErrorCode, SandboxdError

R = TypeVar("R")


class RemoteError(SandboxdError):
    """An error reply from the daemon; `code` is the wire code."""

    def __init__(self, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message, **details)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.INTERNAL
        self.wire_code = code


class DaemonUnreachable(SandboxdError):
    """No reply from the daemon: it is down, the endpoint is wrong, or it refused a CURVE handshake."""

    code = ErrorCode.DAEMON_UNREACHABLE


class FrameTooLarge(SandboxdError):
    """A request the client refuses to send: bigger than the daemon accepts, which would drop it unanswered."""

    code = ErrorCode.FRAME_TOO_LARGE


class Client:
    """A connection to one daemon. Not thread-safe: use one client per thread."""

    def __init__(self, endpoint: str | None = None, timeout_s: float = 120.0, *,
                 server_public_key: str | bytes | None = None, public_key: str | bytes | None = None,
                 secret_key: str | bytes | None = None, connect_timeout_s: float | None = None,
                 max_frame: int = p.DEFAULT_MAX_FRAME) -> None:
        self.endpoint = endpoint or default_endpoint(default_state_dir())
        self.timeout_ms = int(timeout_s * 1000)
        self.connect_timeout_s = connect_timeout_s
        """With a value: a fresh connection first asks Health and gives up after this long, so a daemon that is
        down is reported at once instead of after the whole reply wait."""
        self.max_frame = max_frame
        """Requests bigger than this are refused here: the daemon drops such a frame without a reply."""
        self._probed = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if server_public_key is not None:
            if secret_key is None:
                raise ValueError("CURVE needs the client's secret key as well as the server's public key")
            secret = _key_bytes(secret_key)
            public = _key_bytes(public_key) if public_key is not None else zmq.curve_public(secret)
            self._curve = (_key_bytes(server_public_key), public, secret)

    @classmethod
    def with_key_files(cls, endpoint: str | None, server_key_file: Path, client_key_file: Path,
                       timeout_s: float = 120.0, connect_timeout_s: float | None = None) -> Client:
        """A CURVE client: the daemon's NAME.key pinned, this client's NAME.key_secret presented."""
        public, secret = read_secret_key(client_key_file)
        return cls(endpoint, timeout_s, server_public_key=read_public_key(server_key_file), public_key=public,
                   secret_key=secret, connect_timeout_s=connect_timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._probed = False

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                server, public, secret = self._curve
                sock.setsockopt(zmq.CURVE_SERVERKEY, server)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def send_raw(self, frame: bytes, timeout_ms: int | None = None) -> p.Response:
        """Send one raw frame and return the next reply (for tests of malformed input)."""
        sock = self._socket()
        sock.send(frame)
        wait_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        if not sock.poll(wait_ms):
            # The reply may still come; a fresh socket keeps a late answer from matching the next request.
            self.close()
            raise DaemonUnreachable(f"no reply from {self.endpoint} within {wait_ms / 1000:g}s{self._hint()}")
        return p.decode_response(sock.recv(), max_frame=1 << 31)

    def _hint(self) -> str:
        """Why a tcp daemon may be silent: CURVE refusals drop the connection without a word."""
        if self._curve is not None:
            return ("; the daemon is down or refused this client's CURVE authentication (check that the "
                    "client key is in its client_keys_dir and the server key is the daemon's own)")
        if self.endpoint.startswith("tcp://"):
            return ("; a tcp:// daemon requires CURVE authentication: give its public key and a client key "
                    "(--server-key, --client-key)")
        return ""

    def _probe(self) -> None:
        """Ask Health with the short connect wait, once per connection, when one is set."""
        if self.connect_timeout_s is None or self._probed:
            return
        health = p.HealthRequest(request_id=self._rid())
        wait_ms = int(self.connect_timeout_s * 1000)
        sock = self._socket()
        sock.send(p.encode(health))
        if not sock.poll(wait_ms):
            self.close()
            raise DaemonUnreachable(f"the daemon at {self.endpoint} did not answer within {wait_ms / 1000:g}s: "
                                    f"is `sandboxd serve` running there?{self._hint()}", endpoint=self.endpoint)
        reply = p.decode_response(sock.recv(), max_frame=1 << 31)
        if isinstance(reply, p.HealthResponse) and reply.max_frame:
            self.max_frame = reply.max_frame  # the daemon's own limit, whatever it was configured to
        self._probed = True

    def request(self, req: Any, expect: type[R]) -> R:
        """Send a request; return its typed reply or raise RemoteError for an error reply."""
        frame = p.encode(req)
        if len(frame) > self.max_frame:
            raise FrameTooLarge(f"{type(req).__name__} of {len(frame)} bytes exceeds the daemon's "
                                f"{self.max_frame}-byte frame limit; not sent (pass big arguments as a file "
                                "copied in with `sandboxd cp`)",
                                size=len(frame), limit=self.max_frame)
        self._probe()
        reply = self.send_raw(frame)
        if reply.request_id != req.request_id:
            self.close()
            raise DaemonUnreachable(f"reply for {reply.request_id!r} while waiting for {req.request_id!r}")
        if isinstance(reply, p.ErrorResponse):
            raise RemoteError(reply.code, reply.message, reply.details)
        if not isinstance(reply, expect):
            raise DaemonUnreachable(f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    @staticmethod
    def _rid() -> str:
        return uuid.uuid4().hex

    # Operations --------------------------------------------------------------------------------

    def health(self) -> p.HealthResponse:
        return self.request(p.HealthRequest(request_id=self._rid()), p.HealthResponse)

    def open_session(self, image: str | None = None, forget: list[str] | None = None,
                     idle_timeout_s: float | None = None, ttl_s: float | None = None) -> p.SessionInfo:
        req = p.OpenSessionRequest(request_id=self._rid(), image=image, forget=forget or [],
                                   idle_timeout_s=idle_timeout_s, ttl_s=ttl_s)
        return self.request(req, p.OpenSessionResponse).session

    def adopt_session(self, session_id: str) -> p.AdoptSessionResponse:
        """Operator: re-create a lost node's session (a fleet's front door picks the node; see `sandboxd.fleet`)."""
        return self.request(p.AdoptSessionRequest(request_id=self._rid(), session_id=session_id),
                            p.AdoptSessionResponse)

    def close_session(self, session_id: str) -> None:
        self.request(p.CloseSessionRequest(request_id=self._rid(), session_id=session_id), p.CloseSessionResponse)

    def sessions(self, include_closed: bool = False) -> list[p.SessionInfo]:
        req = p.ListSessionsRequest(request_id=self._rid(), include_closed=include_closed)
        return self.request(req, p.ListSessionsResponse).sessions

    def tools(self, session_id: str | None = None) -> list[p.ToolManifest]:
        req = p.ListToolsRequest(request_id=self._rid(), session_id=session_id)
        return self.request(req, p.ListToolsResponse).tools

    def call(self, session_id: str, tool: str, args: dict[str, Any], call_id: str | None = None,
             timeout_s: float | None = None, clock: float | None = None, mode: str = "live",
             turn: int | None = None, branch: str = "", stream: bool = False) -> p.CallResult:
        req = p.CallRequest(request_id=self._rid(), session_id=session_id, tool=tool, args=args,
                            call_id=call_id, timeout_s=timeout_s, clock=clock, mode=mode,  # type: ignore[arg-type]
                            turn=turn, branch=branch, stream=stream)
        return self.request(req, p.CallResponse).result

    def call_output(self, session_id: str, call_id: str, stdout_offset: int = 0, stderr_offset: int = 0,
                    timeout_s: float = 5.0) -> p.CallOutputResponse:
        """What a streamed call has written after these offsets; waits up to `timeout_s` for something new."""
        req = p.CallOutputRequest(request_id=self._rid(), session_id=session_id, call_id=call_id,
                                  stdout_offset=stdout_offset, stderr_offset=stderr_offset, timeout_s=timeout_s)
        return self.request(req, p.CallOutputResponse)

    def copy_in(self, session_id: str, path: str, data: bytes, append: bool = False) -> p.CopyInResponse:
        """Write bytes into a workspace file (append: add to it)."""
        req = p.CopyInRequest(request_id=self._rid(), session_id=session_id, path=path, data=data, append=append)
        return self.request(req, p.CopyInResponse)

    def copy_out(self, session_id: str, path: str, offset: int = 0, length: int = 4 << 20) -> p.CopyOutResponse:
        """Up to `length` bytes of a workspace file from `offset`, and the file's size."""
        req = p.CopyOutRequest(request_id=self._rid(), session_id=session_id, path=path, offset=offset,
                               length=length)
        return self.request(req, p.CopyOutResponse)

    def commit_turn(self, session_id: str, turn: int) -> list[p.CallResult]:
        """Release the effects held for a committed turn."""
        req = p.CommitTurnRequest(request_id=self._rid(), session_id=session_id, turn=turn)
        return self.request(req, p.CommitTurnResponse).released

    def drop_turn(self, session_id: str, turn: int) -> list[str]:
        """Drop the effects held for a turn that will never commit."""
        req = p.DropTurnRequest(request_id=self._rid(), session_id=session_id, turn=turn)
        return self.request(req, p.DropTurnResponse).dropped

    def record_artifacts(self, session_id: str, artifacts: list[p.Artifact], branch: str = "") -> int:
        req = p.RecordArtifactsRequest(request_id=self._rid(), session_id=session_id, artifacts=artifacts,
                                       branch=branch)
        return self.request(req, p.RecordArtifactsResponse).recorded

    def checkpoint(self, session_id: str, checkpoint: p.CheckpointRecord, branch: str = "",
                   snapshot: bool = True) -> p.CheckpointRecord:
        req = p.CheckpointRequest(request_id=self._rid(), session_id=session_id, checkpoint=checkpoint,
                                  branch=branch, snapshot=snapshot)
        return self.request(req, p.CheckpointResponse).checkpoint

    def provenance(self, session_id: str, source: str) -> p.ProvenanceResponse:
        return self.request(p.ProvenanceRequest(request_id=self._rid(), session_id=session_id, source=source),
                            p.ProvenanceResponse)

    def graph(self, session_id: str) -> p.GraphResponse:
        return self.request(p.GraphRequest(request_id=self._rid(), session_id=session_id), p.GraphResponse)

    def revoke(self, session_id: str, source: str, target: str | None = None) -> p.RevokeResponse:
        req = p.RevokeRequest(request_id=self._rid(), session_id=session_id, source=source, target=target)
        return self.request(req, p.RevokeResponse)

    def pending_revocations(self, session_id: str) -> list[p.RevocationInfo]:
        req = p.PendingRevocationsRequest(request_id=self._rid(), session_id=session_id)
        return self.request(req, p.PendingRevocationsResponse).revocations

    def begin_revocation(self, revocation_id: str) -> p.BeginRevocationResponse:
        req = p.BeginRevocationRequest(request_id=self._rid(), revocation_id=revocation_id)
        return self.request(req, p.BeginRevocationResponse)

    def commit_revocation(self, req: p.CommitRevocationRequest) -> p.RevocationReport:
        return self.request(req, p.CommitRevocationResponse).report

    def wait_events(self, session_id: str, after: int = 0, epoch: str = "",
                    timeout_s: float = 30.0) -> p.WaitEventsResponse:
        """Wait (up to `timeout_s`) for the session's events after `after`; the reply's epoch and last seq are
        what to pass next time."""
        req = p.WaitEventsRequest(request_id=self._rid(), session_id=session_id, after=after, epoch=epoch,
                                  timeout_s=timeout_s)
        reply = self.send_raw(p.encode(req), timeout_ms=int((timeout_s + 30.0) * 1000))
        if isinstance(reply, p.ErrorResponse):
            raise RemoteError(reply.code, reply.message, reply.details)
        if not isinstance(reply, p.WaitEventsResponse) or reply.request_id != req.request_id:
            self.close()
            raise DaemonUnreachable(f"expected the WaitEventsResponse of {req.request_id}, got {type(reply).__name__}")
        return reply

    def revocation_status(self, revocation_id: str) -> p.RevocationStatusResponse:
        req = p.RevocationStatusRequest(request_id=self._rid(), revocation_id=revocation_id)
        return self.request(req, p.RevocationStatusResponse)

    def calls(self, session_id: str | None) -> list[p.LedgerCall]:
        """A session's calls, sandbox and external, oldest first; None: every session's (operators)."""
        req = p.ListCallsRequest(request_id=self._rid(), session_id=session_id)
        return self.request(req, p.ListCallsResponse).calls

    def outbox(self, session_id: str | None = None) -> list[p.HeldCall]:
        return self.approvals(session_id).held

    def approvals(self, session_id: str | None = None) -> p.OutboxResponse:
        """What waits for an operator: held effects, and effects whose outcome is unknown."""
        return self.request(p.OutboxRequest(request_id=self._rid(), session_id=session_id), p.OutboxResponse)

    def release(self, call_id: str, reason: str = "", force: bool = False) -> p.CallResult:
        """Fire a held effect now; `force` for one a closed session held."""
        req = p.ReleaseCallRequest(request_id=self._rid(), call_id=call_id, reason=reason, force=force)
        return self.request(req, p.ReleaseCallResponse).result

    def world_reset(self, session_id: str, injections: dict[str, str] | None = None,
                    user_task: str | None = None) -> bytes:
        """Operator: a fresh world environment for the session; returns it pickled (the pre-environment)."""
        req = p.WorldResetRequest(request_id=self._rid(), session_id=session_id, injections=injections or {},
                                  user_task=user_task)
        return self.request(req, p.WorldResponse).environment

    def world_state(self, session_id: str) -> bytes:
        """Operator: the session's world environment, pickled."""
        return self.request(p.WorldStateRequest(request_id=self._rid(), session_id=session_id),
                            p.WorldResponse).environment

    def drop(self, call_id: str, reason: str = "") -> None:
        self.request(p.DropCallRequest(request_id=self._rid(), call_id=call_id, reason=reason), p.DropCallResponse)

    def resolve(self, call_id: str, outcome: str, result: dict[str, Any] | None = None,
                reason: str = "") -> p.LedgerCall:
        req = p.ResolveCallRequest(request_id=self._rid(), call_id=call_id, outcome=outcome,  # type: ignore[arg-type]
                                   result=result, reason=reason)
        return self.request(req, p.ResolveCallResponse).call

    def snapshot(self, session_id: str, label: str | None = None) -> p.SnapshotInfo:
        req = p.SnapshotRequest(request_id=self._rid(), session_id=session_id, label=label)
        return self.request(req, p.SnapshotResponse).snapshot

    def restore(self, session_id: str, snapshot_id: str) -> p.RestoreResponse:
        req = p.RestoreRequest(request_id=self._rid(), session_id=session_id, snapshot_id=snapshot_id)
        return self.request(req, p.RestoreResponse)

    def snapshots(self, session_id: str) -> list[p.SnapshotInfo]:
        req = p.ListSnapshotsRequest(request_id=self._rid(), session_id=session_id)
        return self.request(req, p.ListSnapshotsResponse).snapshots

    def delete_snapshot(self, session_id: str, snapshot_id: str, force: bool = False) -> list[str]:
        """Delete a snapshot; one that checkpoints refer to only with `force`. Returns the checkpoints it broke."""
        req = p.DeleteSnapshotRequest(request_id=self._rid(), session_id=session_id, snapshot_id=snapshot_id,
                                      force=force)
        return self.request(req, p.DeleteSnapshotResponse).broken

    # Operator verbs over a whole session (dicts: the web console reads them as JSON) ----------------

    def rollback(self, session_id: str, *, checkpoint: str | None = None, snapshot: str | None = None,
                 turn: int | None = None, compensate: bool = False, force: bool = False) -> dict[str, Any]:
        """Operator: roll the session back to one point; returns the rollback report."""
        req = p.RollbackRequest(request_id=self._rid(), session_id=session_id, checkpoint=checkpoint,
                                snapshot=snapshot, turn=turn, compensate=compensate, force=force)
        return msgspec.to_builtins(self.request(req, p.RollbackResponse).report)

    def fork(self, session_id: str, checkpoint: str, *, live_effects: bool = False) -> dict[str, Any]:
        """Operator: a new session from a checkpoint; returns the fork report (its "session_id" is the new one)."""
        req = p.ForkRequest(request_id=self._rid(), session_id=session_id, checkpoint=checkpoint,
                            live_effects=live_effects)
        reply = self.request(req, p.ForkResponse)
        return {**msgspec.to_builtins(reply.report), "session": msgspec.to_builtins(reply.session)}

    def compensate(self, call_id: str) -> dict[str, Any]:
        """Operator: run an orphaned call's declared compensation (at most once); returns its call result."""
        reply = self.request(p.CompensateRequest(request_id=self._rid(), call_id=call_id), p.CompensateResponse)
        return {"call_id": reply.call_id, "compensation": msgspec.to_builtins(reply.result)}

    def revocations(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Revocations of a session (of every session: operators), oldest first, with their states."""
        req = p.ListRevocationsRequest(request_id=self._rid(), session_id=session_id)
        return [msgspec.to_builtins(r) for r in self.request(req, p.ListRevocationsResponse).revocations]

    def cancel_revocation(self, revocation_id: str, reason: str | None = None) -> dict[str, Any]:
        """Cancel a pending revocation; returns it as it is now."""
        req = p.CancelRevocationRequest(request_id=self._rid(), revocation_id=revocation_id, reason=reason)
        return msgspec.to_builtins(self.request(req, p.CancelRevocationResponse).revocation)


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key
