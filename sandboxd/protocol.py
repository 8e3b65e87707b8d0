"""The wire contract: every message that crosses the daemon's ZeroMQ socket.

A frame is one MessagePack map whose `type` field names the struct. Requests end in `Request`,
replies in `Response`; every request carries a `request_id` that its reply echoes. Decoding is
strict: an unknown type, a missing or ill-typed field, an unknown field or an oversized frame is a
`ProtocolError` with its own code, never a crash. Nothing on the socket is ever pickled.

Why one module of this size: it is the wire contract, and a contract read in one place is the point
(every struct a peer may send or receive, the version and the one error mapping, side by side; SGLang
keeps its inter-process structs in one `io_struct.py` for the same reason). It holds declarations, not
logic: splitting it by feature would make a reader open several files to learn what one frame may say.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from sandboxd.errors import ErrorCode, ProtocolError, to_wire

PROTOCOL_VERSION = 3

EffectClass = Literal["read", "write", "external"]

#: a position or count the daemon stores in SQLite (whose integers are 64-bit): bounded so a frame
#: cannot carry a number the store would refuse
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


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
    destructive: bool | None = None
    """Whether a call may destroy or overwrite what is there (not only add to it); None: unknown, which an
    MCP client must read as true. An email adds a message; an HTTP DELETE destroys."""
    open_world: bool | None = None
    """Whether the tool reaches beyond the sandbox; None: only `external` tools do. A read served by the
    firewall (`http_get`, a world's read tools) reads the open world."""
    compensation: str | None = None
    """The compensating action an operator may run for a fired call of this tool that a rollback orphaned
    (the saga pattern: a webhook's undo URL); None: the tool declares none."""

    def openai_format(self) -> dict[str, Any]:
        """The manifest as an OpenAI `tools[]` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


SessionState = Literal["opening", "open", "closing", "closed", "failed", "lost"]


class SessionInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    session_id: str
    image: str
    state: SessionState
    """Anything but open is listed only with `include_closed` (`sandboxd session list --all`)."""
    created_at: float
    container: str | None = None
    idle_timeout_s: float | None = None
    """Closed by the daemon after this long without a request (None: never)."""
    ttl_s: float | None = None
    """Closed by the daemon this long after it opened (None: never)."""
    last_used_at: float | None = None
    """When a request last named it (since this daemon run started; its opening before that)."""
    closed_at: float | None = None
    owner: str | None = None
    """Who opened it: a CURVE public key (z85), or `local` for the owner of the daemon's ipc socket."""
    usage: dict[str, Any] = {}
    """What its sandbox uses now: memory_bytes, cpu_s, pids (where the engine tells), and disk_bytes (its
    workspace and snapshots on the host's disk)."""


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
    stdout_size: Count | None = None
    """With stdout_truncated: the full size in bytes of what the tool wrote (or of the file read)."""
    stderr_size: Count | None = None
    duration_ms: float = 0.0
    replayed: bool = False
    state: str = "done"
    data: dict[str, Any] | None = None
    deduplicated: bool = False
    shadowed: bool = False
    held: bool = False
    simulated: bool = False
    """Shadowed in a replay, and `stdout` is the answer of the replay's simulated world: nothing was sent."""


class LedgerCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One call as the operator sees it: a sandbox call or a ledgered external effect."""

    call_id: str
    session_id: str
    tool: str
    effect: EffectClass
    state: str
    args: dict[str, Any]
    result: dict[str, Any] | None = None
    simulated: dict[str, Any] | None = None
    """A replay-staged call's answer from the replay's simulated far side: what the agent read."""
    error: str | None = None
    turn: int | None = None
    occurrence: int | None = None
    policy: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    agent_call_ids: list[str] = []
    """The call ids the caller gave (`--call-id`, an agent's ids) that name this call."""
    target: str = ""
    """Where an external effect goes: recipients, or method and URL."""
    preview: str = ""
    """The start of its payload (a mail's subject and body, a request's body), on one line."""
    digest: str = ""
    """sha256 of its canonical arguments: what an operator approves is exactly this payload."""
    decided_by: str | None = None
    """Who released, dropped or resolved it: a peer's key, `local` for the ipc socket's owner."""
    reason: str | None = None
    """The reason given with that decision."""
    advice: str | None = None
    """For an `unknown` call: what an operator should do about it."""


class HeldCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An external effect waiting in the outbox."""

    call_id: str
    session_id: str
    tool: str
    policy: str
    turn: int | None
    held_at: float
    args: dict[str, Any]
    replay: str | None = None
    """The open replay branch that holds it: neither released nor dropped until that replay is finished."""
    state: str = "staged"
    target: str = ""
    preview: str = ""
    digest: str = ""
    agent_call_ids: list[str] = []
    session_state: str = "open"
    """The holding session's state: a closed session's held calls are released only with force."""


ArtifactType = Literal[
    "system", "user", "memory", "model_turn", "reply", "plan", "tool_call", "observation", "summary"
]
#: artifact types that enter from outside the model: each is one step o_t of the observation stream
OBSERVATION_TYPES = ("user", "memory", "observation")


class Artifact(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A node of the provenance graph (paper: id, type, parents, source_ids, token_span, turn, committed).

    `parents` are the artifacts it was computed from, exactly those that occurred (a model turn: every
    block of its context; a tool call: its turn; an observation: its call; a summary: what it
    summarised). `step` is the observation step: an observation's own t, otherwise the t of the last
    observation consumed before it. `content` is the text, kept so recorded observations can be re-fed
    by prefill on replay and so a leak scan can find what must be forgotten.
    """

    artifact_id: str
    type: ArtifactType
    parents: list[str] = []
    source_ids: list[str] = []
    token_span: tuple[Count, Count] | None = None
    turn: Count = 0
    step: Count = 0
    committed: bool = True
    content: str = ""
    meta: dict[str, Any] = {}


class CheckpointRecord(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A splice point, metadata only: token offset, model-cache handle, environment snapshot, manifest."""

    checkpoint_id: str
    step: Count
    """Observations consumed so far: the checkpoint sits just before o_{step+1} is consumed."""
    turn: Count
    token_offset: Count
    cache_handle: str
    reason: Literal["start", "turn", "memory", "external", "compaction"]
    manifest: list[str] = []
    """Artifact ids of the blocks that make up the context up to token_offset."""
    snapshot_id: str | None = None
    created_at: float = 0.0


class TokenCounts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Token cost of a revocation: recomputed = prefilled + decoded; full_reset is replay from scratch."""

    reused_prefix: Count = 0
    prefilled: Count = 0
    decoded: Count = 0
    recomputed: Count = 0
    full_reset: Count = 0
    turns_prefilled: Count = 0
    """Model turns of the suffix re-materialized by prefill from their recorded tokens (independent of z, as
    the graph certifies), not decoded again; their tokens count in `prefilled`."""


class ExogenousInput(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A recorded user input or seeded memory to re-feed by prefill on replay (already sanitized)."""

    type: Literal["user", "memory"]
    text: str


class RecordedResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool result of the old suffix, as recorded and sanitized: a replay may answer a read from it when
    nothing the read depends on changed (the agent decides; the daemon only hands it over)."""

    observation: str
    call: str
    """The tool-call artifact it answers."""
    content: str


class RevocationInfo(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    revocation_id: str
    session_id: str
    source: str
    state: str
    """pending, replaying (its branch is open), committing, done, failed or cancelled."""
    raised_by: str
    tau: int
    checkpoint_id: str | None = None
    branch: str | None = None
    error: str | None = None
    """Why a failed revocation failed (or who cancelled it, and why)."""
    created_at: float = 0.0


class RevocationReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a revocation did and cost (the issue's report fields)."""

    revocation_id: str
    session: str
    source: str
    tau: int
    T: int
    T_original: int
    taint_closure: list[str]
    checkpoint: dict[str, Any]
    tokens: TokenCounts
    transitions_replayed: int
    calls: dict[str, int]
    leak_scan: dict[str, Any]
    not_erased: list[str]
    wall_ms: float
    answer: str | None = None
    raised_by: str = "operator"


class OrphanedEffect(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An external effect that fired after a rollback's point: it cannot be undone, only compensated."""

    call_id: str
    tool: str
    args: dict[str, Any]
    fired_at: float
    compensation: str | None = None
    """The compensating action the tool's manifest declares; None: the tool declares none."""
    compensation_call: str | None = None
    """The ledger id of the compensating call, once it was asked for (it runs at most once)."""
    compensation_state: str | None = None
    """done, failed or unknown once run; None: not run (run it with `sandboxd compensate CALL`)."""
    compensation_error: str | None = None


class RollbackReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a rollback did: files back, held calls dropped, fired ones orphaned, the suffix truncated."""

    rollback: str
    """The branch operation's id."""
    session_id: str
    to: CheckpointRecord
    """The point: the agent resumes from this checkpoint when it next connects."""
    files_restored: str | None
    """The snapshot the sandbox's files went back to."""
    dropped: list[str]
    """Calls held or staged after the point: they never fired and now never will."""
    orphaned: list[OrphanedEffect]
    """Effects fired after the point: they cannot be undone; compensate those that declare how."""
    unresolved: list[str]
    """Calls after the point whose outcome is unknown, passed over by --force: resolve them."""
    artifacts_removed: Count
    checkpoints_removed: Count
    calls_removed: Count
    revocations_cancelled: list[str]
    """Pending revocations whose source was after the point: nothing is left for them to forget."""
    wall_ms: float


class ForkReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A fork: a new session with the parent's files, provenance and ledger up to a checkpoint."""

    session_id: str
    parent: str
    at: CheckpointRecord
    """The fork's copy of the parent's checkpoint: its agent starts from here."""
    artifacts: Count
    checkpoints: Count
    snapshots: Count
    inherited_calls: Count
    """Ledger calls reached before the point: retried in the fork, they are answered, never fired again."""
    effects: Literal["held", "live"]
    """held: the fork's new external calls wait in the outbox for release (the outside world is shared)."""


# Requests ------------------------------------------------------------------------------------


class HealthRequest(_Request):
    pass


class OpenSessionRequest(_Request):
    image: str | None = None
    forget: list[str] = []
    """Values this session must never observe: kept only as salted fingerprints, excised from results."""
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=10**8)] | None = None
    """Close the session after this long without a request naming it."""
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=10**8)] | None = None
    """Close the session this long after it opened, busy or not."""


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
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Seconds before the call is killed; NaN, zero and negatives are refused as invalid_field."""
    clock: Annotated[float, msgspec.Meta(ge=0, le=253_402_300_799)] | None = None
    """Virtual wall-clock time (Unix seconds, up to year 9999) the tool sees; replay passes the recorded one."""
    mode: Literal["live", "shadow"] = "live"
    """shadow: an external effect is never fired, only deduplicated against the ledger or staged."""
    branch: str = ""
    """The replay branch a call belongs to (empty: the live session)."""
    turn: Count | None = None
    """The agent's turn, which an on_commit effect waits for."""
    stream: bool = False
    """Keep the output as it comes, for `CallOutputRequest`s naming `call_id` while the call runs."""


class CommitTurnRequest(_Request):
    session_id: str
    turn: Count


class DropTurnRequest(_Request):
    session_id: str
    turn: Count


class ListCallsRequest(_Request):
    session_id: str | None = None
    """None: every session's calls (operators only)."""


class OutboxRequest(_Request):
    session_id: str | None = None


class ReleaseCallRequest(_Request):
    call_id: str
    reason: str = ""
    """Why the operator released it: recorded in the call's history with who decided."""
    force: bool = False
    """Release even though the holding session is closed."""


class DropCallRequest(_Request):
    call_id: str
    reason: str = ""
    """Why the operator dropped it: recorded in the call's history with who decided."""


class WorldResetRequest(_Request):
    """Operator: give a session a fresh environment of the daemon's world, with these injections placed."""

    session_id: str
    injections: dict[str, str] = {}
    user_task: str | None = None
    """A user task of the suite whose environment set-up runs on the fresh environment."""


class WorldStateRequest(_Request):
    """Operator: the session's environment as it stands."""

    session_id: str


class RecordArtifactsRequest(_Request):
    """Report artifacts of a session to the provenance store (idempotent per artifact id)."""

    session_id: str
    artifacts: list[Artifact]
    branch: str = ""
    """Empty for the live session; a replay records under its branch until it commits."""


class CheckpointRequest(_Request):
    """Register a checkpoint; the daemon snapshots the sandbox only if it changed since the last one."""

    session_id: str
    checkpoint: CheckpointRecord
    snapshot: bool = True
    branch: str = ""


class ProvenanceRequest(_Request):
    """Where a source artifact entered (tau), everything reachable from it, and where to splice."""

    session_id: str
    source: str


class GraphRequest(_Request):
    session_id: str


class RevokeRequest(_Request):
    """A revocation event (z, s): forget `target` (default: the whole source) that entered through `source`."""

    session_id: str
    source: str
    target: str | None = None


class PendingRevocationsRequest(_Request):
    session_id: str


class BeginRevocationRequest(_Request):
    """The agent takes a pending revocation: the daemon restores the sandbox and hands over the replay plan."""

    revocation_id: str


class CommitRevocationRequest(_Request):
    """The agent finished replaying: commit the branch, delete the old suffix, scan for leaks, report."""

    revocation_id: str
    tokens: TokenCounts
    transitions_replayed: Count
    final_step: Count
    answer: str | None = None
    call_counts: dict[str, int] = {}
    """The agent's view of its replayed calls: reexecuted, deduplicated, shadowed."""
    agent_notes: list[str] = []
    """What the agent could not erase itself (an SGLang radix cache keeps entries until evicted)."""


class RevocationStatusRequest(_Request):
    revocation_id: str


class WaitEventsRequest(_Request):
    """Long-poll: answered as soon as the session has an event after `after` (of this daemon run, `epoch`),
    or when `timeout_s` runs out with none. An agent learns of a pending revocation this way."""

    session_id: str
    after: Count = 0
    epoch: str = ""
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 30.0


class ResolveCallRequest(_Request):
    call_id: str
    outcome: Literal["done", "failed"]
    result: dict[str, Any] | None = None
    reason: str = ""


class CopyInRequest(_Request):
    """Write bytes into a file of the session's workspace (a chunk of `sandboxd cp`): binary-safe."""

    session_id: str
    path: str
    data: bytes
    append: bool = False
    """Add to the file instead of replacing it (the chunks after the first)."""


class CopyOutRequest(_Request):
    """Read up to `length` bytes of a workspace file from `offset` (a chunk of `sandboxd cp`)."""

    session_id: str
    path: str
    offset: Count = 0
    length: Annotated[int, msgspec.Meta(ge=1, le=64 * 1024 * 1024)] = 4 * 1024 * 1024


class CallOutputRequest(_Request):
    """Long-poll: the output a running call has written after these offsets (`sandboxd call --stream`)."""

    session_id: str
    call_id: str
    stdout_offset: Count = 0
    stderr_offset: Count = 0
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 5.0


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
    force: bool = False
    """Delete it even though checkpoints refer to it (rollbacks, forks and revocations to them then fail)."""


class RollbackRequest(_Request):
    """Operator: move a whole session back to a point (one of checkpoint, snapshot, turn); nothing is replayed."""

    session_id: str
    checkpoint: str | None = None
    snapshot: str | None = None
    turn: Count | None = None
    """Back to the start of this turn: it and every later one are discarded."""
    compensate: bool = False
    """Run each orphaned effect's declared compensation (through the ledger, at most once)."""
    force: bool = False
    """Pass over calls after the point whose outcome is unknown (they are listed as unresolved)."""


class AdoptSessionRequest(_Request):
    """Operator (a fleet's front door): serve a session whose node was lost, on this daemon, from the
    workspace of its last exported snapshot, already imported into this daemon's snapshot store."""

    session_id: str


class ForkRequest(_Request):
    """Operator: a new session from a checkpoint of this one; the parent is left as it is."""

    session_id: str
    checkpoint: str
    live_effects: bool = False
    """Let the fork's external calls fire as the release policy says (default: each is held for release)."""


class CompensateRequest(_Request):
    """Operator: run an orphaned effect's declared compensation, through the ledger, at most once."""

    call_id: str


class ListRevocationsRequest(_Request):
    """Revocations of one session, or (operators) of every session, oldest first, in every state."""

    session_id: str | None = None


class CancelRevocationRequest(_Request):
    """Cancel a revocation that no agent has taken yet."""

    revocation_id: str
    reason: str | None = None


# Responses -----------------------------------------------------------------------------------


class HealthResponse(_Response):
    version: str
    protocol: int
    open_sessions: int
    uptime_s: float
    max_frame: Count = 0
    """The largest request frame the daemon accepts (0: not said, an older daemon)."""


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
    broken: list[str] = []
    """Checkpoints that referred to it (deleted by force): what can no longer be rolled back, forked or
    spliced at."""


class RollbackResponse(_Response):
    report: RollbackReport


class AdoptSessionResponse(_Response):
    session: SessionInfo
    snapshot_id: str
    """The snapshot the workspace was re-created from."""


class ForkResponse(_Response):
    session: SessionInfo
    report: ForkReport


class CompensateResponse(_Response):
    call_id: str
    """The orphaned call that was compensated."""
    result: CallResult
    """The compensating call (its own ledger id; answered from the ledger when it already ran)."""


class ListRevocationsResponse(_Response):
    revocations: list[RevocationInfo]


class CancelRevocationResponse(_Response):
    revocation: RevocationInfo


class CommitTurnResponse(_Response):
    released: list[CallResult]


class DropTurnResponse(_Response):
    dropped: list[str]


class ListCallsResponse(_Response):
    calls: list[LedgerCall]


class OutboxResponse(_Response):
    held: list[HeldCall]
    unknown: list[LedgerCall] = []
    """Effects whose outcome is unknown: they wait for an operator too (see each one's `advice`)."""


class ReleaseCallResponse(_Response):
    result: CallResult


class DropCallResponse(_Response):
    call_id: str


class ResolveCallResponse(_Response):
    call: LedgerCall


class CopyInResponse(_Response):
    path: str
    size: Count
    """The file's size after the write."""


class CopyOutResponse(_Response):
    path: str
    data: bytes
    offset: Count
    size: Count
    """The whole file's size: the copy is done when offset + len(data) reaches it."""
    mode: int = 0o644


class CallOutputResponse(_Response):
    call_id: str
    stdout: str
    stderr: str
    running: bool
    """False once the call has finished (its result is the call's reply) or was never seen streaming."""


class RecordArtifactsResponse(_Response):
    recorded: int


class CheckpointResponse(_Response):
    checkpoint: CheckpointRecord


class ProvenanceResponse(_Response):
    source: str
    tau: int
    T: int
    taint_closure: list[str]
    """The source and every artifact reachable from it, in recording order."""
    checkpoint: CheckpointRecord | None
    """The latest checkpoint before o_tau was consumed."""


class GraphResponse(_Response):
    artifacts: list[Artifact]
    checkpoints: list[CheckpointRecord]


class RevokeResponse(_Response):
    revocation: RevocationInfo
    taint_closure: list[str]
    T: int


class PendingRevocationsResponse(_Response):
    revocations: list[RevocationInfo]


class BeginRevocationResponse(_Response):
    revocation_id: str
    branch: str
    checkpoint: CheckpointRecord
    """The splice point; its manifest names the context blocks (the agent holds them, or reads the graph)."""
    inputs: list[ExogenousInput]
    """Exogenous inputs after the checkpoint, in order, with the target excised."""
    source_call: str | None = None
    source_result: str | None = None
    """When the source is a tool result: the call it answers and its recorded content minus the target."""
    recorded: list[RecordedResult] = []
    """The old suffix's other tool results, sanitized, oldest first (what a replay may reuse)."""
    closure: list[str] = []
    """The taint closure I(z): a replayed model turn none of whose parents is in it may be re-materialized."""


class CommitRevocationResponse(_Response):
    report: RevocationReport


class RevocationStatusResponse(_Response):
    revocation: RevocationInfo
    report: RevocationReport | None = None


class WorldResponse(_Response):
    session_id: str
    suite: str
    environment: bytes
    """The environment, pickled (AgentDojo's JSON round trip loses data); only the daemon unpickles its own."""


class Event(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Something a session's agent must react to: a revocation raised, a held call decided."""

    seq: Count
    kind: Literal["revocation", "call", "rollback", "artifact", "checkpoint", "snapshot"]
    subject: str
    """The revocation id, or the call id."""


class WaitEventsResponse(_Response):
    epoch: str
    """This daemon run's id: after a restart the sequence starts again, so a client resets `after`."""
    events: list[Event]


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
    | RecordArtifactsRequest
    | CheckpointRequest
    | ProvenanceRequest
    | GraphRequest
    | RevokeRequest
    | PendingRevocationsRequest
    | BeginRevocationRequest
    | CommitRevocationRequest
    | RevocationStatusRequest
    | WaitEventsRequest
    | WorldResetRequest
    | WorldStateRequest
    | CopyInRequest
    | CopyOutRequest
    | CallOutputRequest
    | RollbackRequest
    | ForkRequest
    | AdoptSessionRequest
    | CompensateRequest
    | ListRevocationsRequest
    | CancelRevocationRequest
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
    | RecordArtifactsResponse
    | CheckpointResponse
    | ProvenanceResponse
    | GraphResponse
    | RevokeResponse
    | PendingRevocationsResponse
    | BeginRevocationResponse
    | CommitRevocationResponse
    | RevocationStatusResponse
    | WaitEventsResponse
    | WorldResponse
    | CopyInResponse
    | CopyOutResponse
    | CallOutputResponse
    | RollbackResponse
    | ForkResponse
    | AdoptSessionResponse
    | CompensateResponse
    | ListRevocationsResponse
    | CancelRevocationResponse
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
    except RecursionError as exc:  # a few bytes per level: a small frame can nest deeper than the stack
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame nests too deeply") from exc
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
    except (msgspec.DecodeError, RecursionError):
        return ""
    return _request_id(raw) if isinstance(raw, dict) else ""


def error_response(request_id: str, error: BaseException) -> ErrorResponse:
    """The one mapping from an exception to the error reply."""
    code, message, details = to_wire(error)
    return ErrorResponse(request_id=request_id, code=code.value, message=message,
                         details=msgspec.to_builtins(details))
