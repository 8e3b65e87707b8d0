"""The wire contract: every message that crosses the daemon's ZeroMQ socket.

A frame is one MessagePack map whose `type` field names the struct. Requests end in `Request`,
replies in `Response`; every request carries a `request_id` that its reply echoes. Decoding is
strict: an unknown type, a missing or ill-typed field, an unknown field or an oversized frame is a
`ProtocolError` with its own code, never a crash. Nothing on the socket is ever pickled.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from sandboxd.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1

EffectClass = Literal["read", "write", "external"]


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Base of every wire message; the tag is the class name."""


class _Request(_Message):
    request_id: str


class _Response(_Message):
    request_id: str


# Shared value types --------------------------------------------------------------------------


class ToolManifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool as the model sees it (OpenAI function-tool format) plus its effect class."""

    name: str
    description: str
    parameters: dict[str, Any]
    effect: EffectClass
    intent_fields: list[str] = []

    def openai_format(self) -> dict[str, Any]:
        """The manifest as an OpenAI `tools[]` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class SessionInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    session_id: str
    image: str
    state: Literal["open", "closed"]
    created_at: float
    container: str | None = None


class SnapshotInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    snapshot_id: str
    session_id: str
    created_at: float
    label: str | None = None
    layers: int = 1
    elapsed_ms: float = 0.0


class CallResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a tool call produced. `replayed` is true when it was answered from the record.

    External tools fill `state` (the ledger state), `data` (the effect's recorded result) and the
    firewall flags; their `stdout` is `data` as JSON so a model can read it like any observation.
    """

    call_id: str
    tool: str
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0
    replayed: bool = False
    state: str = "done"
    data: dict[str, Any] | None = None
    deduplicated: bool = False
    shadowed: bool = False
    held: bool = False


class LedgerCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One call as the operator sees it: a sandbox call or a ledgered external effect."""

    call_id: str
    session_id: str
    tool: str
    effect: EffectClass
    state: str
    args: dict[str, Any]
    result: dict[str, Any] | None = None
    error: str | None = None
    turn: int | None = None
    occurrence: int | None = None
    policy: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


class HeldCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An external effect waiting in the outbox."""

    call_id: str
    session_id: str
    tool: str
    policy: str
    turn: int | None
    held_at: float
    args: dict[str, Any]


# Requests ------------------------------------------------------------------------------------


class HealthRequest(_Request):
    pass


class OpenSessionRequest(_Request):
    image: str | None = None


class CloseSessionRequest(_Request):
    session_id: str


class ListSessionsRequest(_Request):
    include_closed: bool = False


class ListToolsRequest(_Request):
    session_id: str | None = None


class CallRequest(_Request):
    session_id: str
    tool: str
    args: dict[str, Any]
    call_id: str | None = None
    timeout_s: float | None = None
    clock: float | None = None
    """Virtual wall-clock time (Unix seconds) the tool sees; replay passes the recorded one."""
    mode: Literal["live", "shadow"] = "live"
    """shadow: an external effect is never fired, only deduplicated against the ledger or staged."""
    turn: int | None = None
    """The agent's turn, which an on_commit effect waits for."""


class CommitTurnRequest(_Request):
    session_id: str
    turn: int


class DropTurnRequest(_Request):
    session_id: str
    turn: int


class ListCallsRequest(_Request):
    session_id: str


class OutboxRequest(_Request):
    session_id: str | None = None


class ReleaseCallRequest(_Request):
    call_id: str


class DropCallRequest(_Request):
    call_id: str


class BeginReplayRequest(_Request):
    """Open a replay branch: shadow calls in it count intent occurrences from zero again."""

    session_id: str
    from_turn: int | None = None


class FinishReplayRequest(_Request):
    """Commit the replay branch (it becomes the live one) or abandon it."""

    session_id: str
    branch: str
    commit: bool


class ResolveCallRequest(_Request):
    call_id: str
    outcome: Literal["done", "failed"]
    result: dict[str, Any] | None = None


class SnapshotRequest(_Request):
    session_id: str
    label: str | None = None


class RestoreRequest(_Request):
    session_id: str
    snapshot_id: str


class ListSnapshotsRequest(_Request):
    session_id: str


class DeleteSnapshotRequest(_Request):
    session_id: str
    snapshot_id: str


# Responses -----------------------------------------------------------------------------------


class HealthResponse(_Response):
    version: str
    protocol: int
    open_sessions: int
    uptime_s: float


class OpenSessionResponse(_Response):
    session: SessionInfo


class CloseSessionResponse(_Response):
    session_id: str


class ListSessionsResponse(_Response):
    sessions: list[SessionInfo]


class ListToolsResponse(_Response):
    tools: list[ToolManifest]


class CallResponse(_Response):
    result: CallResult


class SnapshotResponse(_Response):
    snapshot: SnapshotInfo


class RestoreResponse(_Response):
    session_id: str
    snapshot_id: str
    elapsed_ms: float


class ListSnapshotsResponse(_Response):
    snapshots: list[SnapshotInfo]


class DeleteSnapshotResponse(_Response):
    snapshot_id: str


class CommitTurnResponse(_Response):
    released: list[CallResult]


class DropTurnResponse(_Response):
    dropped: list[str]


class ListCallsResponse(_Response):
    calls: list[LedgerCall]


class OutboxResponse(_Response):
    held: list[HeldCall]


class ReleaseCallResponse(_Response):
    result: CallResult


class DropCallResponse(_Response):
    call_id: str


class ResolveCallResponse(_Response):
    call: LedgerCall


class BeginReplayResponse(_Response):
    branch: str


class FinishReplayResponse(_Response):
    branch: str
    committed: bool
    orphaned: list[str]
    """Fired in the replaced branch, never reached by the replay: they need compensation."""
    dropped: list[str]
    unresolved: list[str]
    staged: list[str]


class ErrorResponse(_Response):
    code: str
    message: str
    details: dict[str, Any] = {}


Request = (
    HealthRequest
    | OpenSessionRequest
    | CloseSessionRequest
    | ListSessionsRequest
    | ListToolsRequest
    | CallRequest
    | SnapshotRequest
    | RestoreRequest
    | ListSnapshotsRequest
    | DeleteSnapshotRequest
    | CommitTurnRequest
    | DropTurnRequest
    | ListCallsRequest
    | OutboxRequest
    | ReleaseCallRequest
    | DropCallRequest
    | ResolveCallRequest
    | BeginReplayRequest
    | FinishReplayRequest
)

Response = (
    HealthResponse
    | OpenSessionResponse
    | CloseSessionResponse
    | ListSessionsResponse
    | ListToolsResponse
    | CallResponse
    | SnapshotResponse
    | RestoreResponse
    | ListSnapshotsResponse
    | DeleteSnapshotResponse
    | CommitTurnResponse
    | DropTurnResponse
    | ListCallsResponse
    | OutboxResponse
    | ReleaseCallResponse
    | DropCallResponse
    | ResolveCallResponse
    | BeginReplayResponse
    | FinishReplayResponse
    | ErrorResponse
)

REQUEST_TYPES: dict[str, type[Any]] = {cls.__name__: cls for cls in Request.__args__}
RESPONSE_TYPES: dict[str, type[Any]] = {cls.__name__: cls for cls in Response.__args__}

DEFAULT_MAX_FRAME = 8 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()


def encode(message: msgspec.Struct) -> bytes:
    """Serialize one message to a MessagePack frame."""
    return _encoder.encode(message)


def _decode(frame: bytes, types: dict[str, type[Any]], max_frame: int) -> Any:
    if len(frame) > max_frame:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"frame of {len(frame)} bytes exceeds the {max_frame}-byte limit",
            size=len(frame),
            limit=max_frame,
        )
    try:
        raw = _raw_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a MessagePack frame: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame must be a map, got {type(raw).__name__}")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in types:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}", request_id=_request_id(raw)
        )
    try:
        return msgspec.convert(raw, types[kind], strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"{kind}: {exc}", request_id=_request_id(raw)
        ) from exc


def _request_id(raw: dict[Any, Any]) -> str:
    rid = raw.get("request_id")
    return rid if isinstance(rid, str) else ""


def decode_request(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Request:
    """Decode a request frame strictly, raising `ProtocolError` with the matching code."""
    return _decode(frame, REQUEST_TYPES, max_frame)


def decode_response(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Response:
    """Decode a reply frame strictly (clients use this)."""
    return _decode(frame, RESPONSE_TYPES, max_frame)


def request_id_of(frame: bytes) -> str:
    """Best-effort request id of a frame that failed to decode, so the error reply can echo it."""
    try:
        raw = _raw_decoder.decode(frame)
    except msgspec.DecodeError:
        return ""
    return _request_id(raw) if isinstance(raw, dict) else ""
