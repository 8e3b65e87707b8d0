"""The one error root of sandboxd and its mapping to wire codes.

Every failure a client can see is a `SandboxdError` subclass carrying structured fields. The daemon
turns it into an `ErrorResponse` in exactly one place, `to_wire`, so codes never drift between
handlers.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(enum.StrEnum):
    """Codes carried by `ErrorResponse.code`; clients branch on these, never on messages."""

    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_FIELD = "invalid_field"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_CLOSED = "session_closed"
    UNKNOWN_TOOL = "unknown_tool"
    INVALID_ARGUMENTS = "invalid_arguments"
    PATH_ESCAPE = "path_escape"
    NOT_FOUND = "not_found"
    TOOL_TIMEOUT = "tool_timeout"
    RESOURCE_LIMIT = "resource_limit"
    EXTERNAL_UNAVAILABLE = "external_unavailable"
    CALL_ID_CONFLICT = "call_id_conflict"
    CALL_INTERRUPTED = "call_interrupted"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    SNAPSHOT_NOT_FOUND = "snapshot_not_found"
    SNAPSHOT_FAILED = "snapshot_failed"
    HOST_NOT_ALLOWED = "host_not_allowed"
    EFFECT_FAILED = "effect_failed"
    ADAPTER_TIMEOUT = "adapter_timeout"
    CALL_UNKNOWN = "call_unknown"
    INVALID_STATE = "invalid_state"
    TOOL_ERROR = "tool_error"
    UNAUTHORIZED = "unauthorized"
    FLOW_BLOCKED = "flow_blocked"
    DAEMON_UNREACHABLE = "daemon_unreachable"
    """Client side: the daemon did not answer (down, wrong endpoint, or a refused CURVE handshake)."""
    INTERNAL = "internal"


class SandboxdError(Exception):
    """Root of every error sandboxd reports to a client."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class ProtocolError(SandboxdError):
    """A frame that could not be decoded into a request."""

    def __init__(self, code: ErrorCode, message: str, **details: Any) -> None:
        super().__init__(message, **details)
        self.code = code


class UnknownSession(SandboxdError):
    code = ErrorCode.UNKNOWN_SESSION

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r}", session_id=session_id)


class SessionClosed(SandboxdError):
    code = ErrorCode.SESSION_CLOSED

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is closed", session_id=session_id)


class UnknownTool(SandboxdError):
    code = ErrorCode.UNKNOWN_TOOL

    def __init__(self, tool: str, known: list[str]) -> None:
        super().__init__(f"no tool {tool!r}; known tools: {', '.join(known)}", tool=tool, known=known)


class InvalidArguments(SandboxdError):
    code = ErrorCode.INVALID_ARGUMENTS

    def __init__(self, tool: str, problem: str, path: str = "$") -> None:
        super().__init__(f"{tool}: {problem} (at {path})", tool=tool, problem=problem, path=path)


class PathEscape(SandboxdError):
    code = ErrorCode.PATH_ESCAPE

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"path {path!r} is outside /workspace: {reason}", path=path, reason=reason)


class NotFound(SandboxdError):
    code = ErrorCode.NOT_FOUND


class ToolTimeout(SandboxdError):
    code = ErrorCode.TOOL_TIMEOUT

    def __init__(self, call_id: str, seconds: float, stdout: str = "", stderr: str = "") -> None:
        super().__init__(
            f"call {call_id} ran past its {seconds:g}s timeout and was killed",
            call_id=call_id,
            seconds=seconds,
            stdout=stdout,
            stderr=stderr,
        )


class ResourceLimit(SandboxdError):
    code = ErrorCode.RESOURCE_LIMIT

    def __init__(self, call_id: str, limit: str, message: str, **details: Any) -> None:
        super().__init__(message, call_id=call_id, limit=limit, **details)


class ExternalUnavailable(SandboxdError):
    code = ErrorCode.EXTERNAL_UNAVAILABLE


class CallIdConflict(SandboxdError):
    code = ErrorCode.CALL_ID_CONFLICT

    def __init__(self, call_id: str, reason: str) -> None:
        super().__init__(f"call id {call_id!r} was already used {reason}", call_id=call_id)


class CallInterrupted(SandboxdError):
    code = ErrorCode.CALL_INTERRUPTED

    def __init__(self, call_id: str) -> None:
        super().__init__(
            f"call {call_id!r} was cut off by a daemon restart; its effect on the sandbox is unknown. "
            "Restore a snapshot or retry under a new call id.",
            call_id=call_id,
        )


class SandboxUnavailable(SandboxdError):
    code = ErrorCode.SANDBOX_UNAVAILABLE


class SnapshotNotFound(SandboxdError):
    code = ErrorCode.SNAPSHOT_NOT_FOUND

    def __init__(self, snapshot_id: str, session_id: str) -> None:
        super().__init__(
            f"no snapshot {snapshot_id!r} in session {session_id!r}",
            snapshot_id=snapshot_id,
            session_id=session_id,
        )


class SnapshotInUse(SandboxdError):
    """A snapshot that checkpoints refer to: deleting it would break rollbacks, forks and revocations to them."""

    code = ErrorCode.INVALID_STATE

    def __init__(self, snapshot_id: str, checkpoints: list[str]) -> None:
        shown = ", ".join(checkpoints[:5]) + (f" and {len(checkpoints) - 5} more" if len(checkpoints) > 5 else "")
        super().__init__(f"snapshot {snapshot_id} holds the files of checkpoint(s) {shown}: deleting it would break "
                         "every rollback, fork and revocation that splices there; pass --force to delete it anyway",
                         snapshot_id=snapshot_id, checkpoints=checkpoints)


class OperationRefused(SandboxdError):
    """An operator's request that does not fit the state of what it names, with the reason in plain words."""

    code = ErrorCode.INVALID_STATE

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message, **details)


class SnapshotFailed(SandboxdError):
    code = ErrorCode.SNAPSHOT_FAILED


class ToolError(SandboxdError):
    """The executor could not carry out a call for a reason the tool's caller caused or can fix."""

    code = ErrorCode.TOOL_ERROR


class RecordedError(SandboxdError):
    """An error read back from the call record, re-raised unchanged when a call id is retried."""

    def __init__(self, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message, **details)
        self.code = ErrorCode(code)


def to_wire(error: BaseException) -> tuple[ErrorCode, str, dict[str, Any]]:
    """Map any exception to (code, message, details) for an error reply."""
    if isinstance(error, SandboxdError):
        return error.code, error.message, dict(error.details)
    return ErrorCode.INTERNAL, f"{type(error).__name__}: {error}", {}


# Side-effect firewall ------------------------------------------------------------------------


class HostNotAllowed(SandboxdError):
    code = ErrorCode.HOST_NOT_ALLOWED

    def __init__(self, host: str, allowlist: list[str]) -> None:
        shown = ", ".join(allowlist) if allowlist else "nothing"
        super().__init__(
            f"host {host!r} is not on the firewall allowlist (allowed: {shown})",
            host=host,
            allowlist=allowlist,
        )


class EffectFailed(SandboxdError):
    code = ErrorCode.EFFECT_FAILED

    def __init__(self, call_id: str, reason: str, state: str = "failed") -> None:
        if state == "unknown":
            message = (
                f"call {call_id}: {reason}; the effect may or may not have happened, "
                "so it will not be retried until an operator resolves it"
            )
        else:
            message = f"call {call_id} did not take effect: {reason}"
        super().__init__(message, call_id=call_id, reason=reason, state=state)


class AdapterTimeout(SandboxdError):
    """An adapter's timeout; `sent` says whether the request had left (bytes may have reached the far side)."""

    code = ErrorCode.ADAPTER_TIMEOUT

    def __init__(self, call_id: str, seconds: float, state: str = "unknown", sent: bool | None = None) -> None:
        sent = state == "unknown" if sent is None else sent
        if state == "unknown":
            tail = "after the request was sent, so its outcome is unknown until an operator resolves it"
        elif sent:
            tail = "after the request was sent, with no answer; it changes nothing there, so a retry is safe"
        else:
            tail = "before anything was sent, so a retry may fire it"
        super().__init__(
            f"call {call_id} timed out after {seconds:g}s {tail}",
            call_id=call_id,
            seconds=seconds,
            state=state,
            sent=sent,
        )


class HeldByClosedSession(SandboxdError):
    """Releasing a held effect of a closed session: it would act for an agent that no longer runs."""

    code = ErrorCode.SESSION_CLOSED

    def __init__(self, call_id: str, session_id: str) -> None:
        super().__init__(
            f"call {call_id} is held for session {session_id!r}, which is closed: releasing it fires an effect "
            "for an agent that no longer runs; drop it, or release it with --force (force=true) if it must go",
            call_id=call_id, session_id=session_id,
        )


class CallUnknown(SandboxdError):
    code = ErrorCode.CALL_UNKNOWN

    def __init__(self, call_id: str) -> None:
        super().__init__(
            f"call {call_id} is in state unknown (it may or may not have fired); it is never fired "
            "again until an operator resolves it as done or failed",
            call_id=call_id,
        )


class InvalidState(SandboxdError):
    code = ErrorCode.INVALID_STATE

    def __init__(self, call_id: str, state: str, wanted: str, reason: str = "") -> None:
        message = f"call {call_id} is {state}, wanted {wanted}"
        super().__init__(f"{message}: {reason}" if reason else message, call_id=call_id, state=state, wanted=wanted)


class BranchStateError(SandboxdError):
    """A replay-branch operation that does not fit the branch's state (no replay open, already closed)."""

    code = ErrorCode.INVALID_STATE

    def __init__(self, lineage: str, branch: str | None, reason: str) -> None:
        super().__init__(f"lineage {lineage!r}: {reason}", lineage=lineage, branch=branch, reason=reason)


# Authentication ------------------------------------------------------------------------------


class FlowBlocked(SandboxdError):
    """Information-flow control: an external call's argument carries text of a flagged observation."""

    code = ErrorCode.FLOW_BLOCKED

    def __init__(self, tool: str, path: str, source: str) -> None:
        super().__init__(f"{tool} refused by flow control: {path} carries text of the flagged observation {source}",
                         tool=tool, path=path, source=source)


class Unauthorized(SandboxdError):
    """The peer is neither the session's owner nor an operator (session_id None: an operator-only request)."""

    code = ErrorCode.UNAUTHORIZED

    def __init__(self, session_id: str | None, request: str = "") -> None:
        if session_id is None:
            message = f"{request} is for operators only"
        else:
            message = f"session {session_id!r} belongs to another client; only its owner or an operator may use it"
        super().__init__(message, session_id=session_id, request=request)
