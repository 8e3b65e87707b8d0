"""Request handlers: sessions, tool calls and snapshots, on top of containers, the store and SQLite.

`SandboxService.handle` is the one error boundary: whatever a handler raises becomes an
`ErrorResponse` with an enumerated code. It is also the one ownership check: a session is used only
by the peer that opened it or by an operator (`sandboxd.auth`). Requests of one session are serialised by a per-session
lock; different sessions run in parallel on the server's worker threads.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from sandboxd import __version__
from sandboxd import protocol as p
from sandboxd.auth import Peer
from sandboxd.config import DaemonConfig
from sandboxd.errors import (
    CallIdConflict,
    CallInterrupted,
    ExternalUnavailable,
    FlowBlocked,
    InvalidArguments,
    NotFound,
    PathEscape,
    RecordedError,
    ResourceLimit,
    SandboxdError,
    SandboxUnavailable,
    SessionClosed,
    SnapshotFailed,
    SnapshotNotFound,
    ToolError,
    ToolTimeout,
    Unauthorized,
    UnknownSession,
    UnknownTool,
    to_wire,
)
from sandboxd.firewall.flow import tainted_argument
from sandboxd.firewall.handlers import FirewallHandlers, result_text
from sandboxd.firewall.service import Firewall
from sandboxd.firewall.world import WORLDS, AgentDojoWorld
from sandboxd.metrics import DaemonMetrics
from sandboxd.provenance.handlers import ProvenanceHandlers
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.detector import load_detector
from sandboxd.revocation.operator import RevocationOperator
from sandboxd.sandbox.containers import ContainerManager
from sandboxd.state import StateStore, canonical_args
from sandboxd.tools.builtin import BUILTIN_TOOLS, executor_request
from sandboxd.tools.registry import ToolRegistry
from snapshots import SnapshotError, SnapshotStore, UnknownSnapshot

IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")
"""Characters Docker allows in an image name, tag or digest; anything else is refused before the engine sees it."""

log = logging.getLogger("sandboxd")

#: label of the snapshots the daemon takes for agent checkpoints (deleted with the suffix they belong to)
CHECKPOINT_LABEL = "checkpoint"

_EXECUTOR_ERRORS: dict[str, Callable[[str, dict[str, Any]], SandboxdError]] = {
    "path_escape": lambda msg, d: PathEscape(str(d.get("path", "")), str(d.get("reason", msg))),
    "not_found": lambda msg, d: NotFound(msg, **d),
    "invalid_arguments": lambda msg, d: InvalidArguments(str(d.get("tool", "")), msg),
    "resource_limit": lambda msg, d: ResourceLimit(str(d.get("call_id", "")), "disk", msg, **d),
}


class SandboxService:
    """All request handlers of the daemon, dispatched by request type."""

    def __init__(self, config: DaemonConfig, state: StateStore, store: SnapshotStore,
                 containers: ContainerManager) -> None:
        self.config = config
        self.state = state
        self.store = store
        self.containers = containers
        self.world = AgentDojoWorld(config.world.agentdojo_suite, config.state_path / WORLDS,
                                    config.world.agentdojo_version) if config.world.agentdojo_suite else None
        world_tools = self.world.adapters(config.firewall.adapter_timeout_s) if self.world else []
        self.firewall = Firewall(config.firewall, state.db, state.lock, extra=world_tools)
        self.effects = FirewallHandlers(self.firewall, state, self.check_open)
        # The world's tools replace sandbox tools of the same name: the suite's tasks name them so.
        served = {adapter.manifest.name for adapter in world_tools}
        self.tools = ToolRegistry([*(t for t in BUILTIN_TOOLS if t.name not in served),
                                   *self.firewall.manifests()])
        self.provenance = ProvenanceStore(state.db, state.lock)
        self.revocations = RevocationOperator(self, self.provenance, load_detector(config.detector))
        self.provenance_handlers = ProvenanceHandlers(self, self.provenance, self.revocations.on_observation)
        self.metrics = DaemonMetrics(self.firewall.stats, lambda: len(self.state.sessions()), self._effect_of)
        self.started = time.monotonic()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.handlers: dict[type[Any], Callable[[Any], p.Response]] = {
            p.HealthRequest: self.health,
            p.CloseSessionRequest: self.close_session,
            p.ListToolsRequest: self.list_tools,
            p.CallRequest: self.call,
            p.SnapshotRequest: self.snapshot,
            p.RestoreRequest: self.restore,
            p.ListSnapshotsRequest: self.list_snapshots,
            p.DeleteSnapshotRequest: self.delete_snapshot,
            **self.effects.handlers(),
            **self.provenance_handlers.handlers(),
            **self.revocations.handlers(),
            p.WorldResetRequest: self.world_reset,
            p.WorldStateRequest: self.world_state,
        }
        #: requests whose answer depends on who asks: the owner of a new session, whose sessions to list
        self.peer_handlers: dict[type[Any], Callable[[Any, Peer], p.Response]] = {
            p.OpenSessionRequest: self.open_session,
            p.ListSessionsRequest: self.list_sessions,
        }

    #: requests cheap enough to answer on the socket thread
    INLINE = (p.HealthRequest, p.ListToolsRequest, p.ListSessionsRequest, p.ListSnapshotsRequest,
              p.ListCallsRequest, p.OutboxRequest, p.PendingRevocationsRequest, p.RevocationStatusRequest)

    #: requests on the firewall's shared outbox: releasing a 'manual' hold is the operator's decision
    #: and the outside world is not the agent's to reset or to read around its tools
    OPERATOR_ONLY = (p.ReleaseCallRequest, p.DropCallRequest, p.ResolveCallRequest, p.WorldResetRequest,
                     p.WorldStateRequest)

    def handle(self, request: p.Request, peer: Peer) -> p.Response:
        """Check `peer` may make this request, run its handler; every failure becomes an ErrorResponse."""
        started = time.perf_counter()
        reply = self._serve(request, peer)
        self.metrics.observe(request, reply, time.perf_counter() - started)
        return reply

    def _serve(self, request: p.Request, peer: Peer) -> p.Response:
        """`handle` but for the metrics: the error boundary itself."""
        try:
            self.authorize(request, peer)
            if (for_peer := self.peer_handlers.get(type(request))) is not None:
                return for_peer(request, peer)
            return self.handlers[type(request)](request)
        except SandboxdError as exc:
            log.info("request %s failed: %s", request.request_id, exc, extra=log_ids(request, peer, exc))
            return error_response(request.request_id, exc)
        except AssertionError:
            log.critical("broken invariant while serving %r", request, exc_info=True,
                         extra=log_ids(request, peer))
            raise
        except Exception as exc:
            log.exception("internal error serving %s", type(request).__name__, extra=log_ids(request, peer))
            return error_response(request.request_id, exc)

    def authorize(self, request: p.Request, peer: Peer) -> None:
        """The one ownership check: a request naming a session, or a revocation of one, is its owner's."""
        if peer.operator:
            return
        if isinstance(request, self.OPERATOR_ONLY) or (isinstance(request, p.OutboxRequest)
                                                       and request.session_id is None):
            raise Unauthorized(None, type(request).__name__)
        session_id = getattr(request, "session_id", None)
        if session_id is None and isinstance(revocation_id := getattr(request, "revocation_id", None), str):
            session_id = self.state.revocation_session(revocation_id)
        row = self.state.session(session_id) if session_id is not None else None
        # An unknown id passes through to its handler's unknown_session: ids are random, so that reveals nothing.
        if row is not None and row["owner"] != peer.key:
            raise Unauthorized(session_id)

    def _effect_of(self, tool: str) -> str | None:
        """The effect class of a registered tool, None for a name no tool has."""
        try:
            return self.tools.get(tool).effect
        except UnknownTool:
            return None

    def session_lock(self, session_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(session_id, threading.Lock())

    def known_session(self, session_id: str) -> dict[str, Any]:
        row = self.state.session(session_id)
        if row is None:
            raise UnknownSession(session_id)
        return row

    def check_open(self, session_id: str) -> dict[str, Any]:
        row = self.state.session(session_id)
        if row is None:
            raise UnknownSession(session_id)
        if row["state"] != "open":
            raise SessionClosed(session_id)
        return row

    # Sessions ----------------------------------------------------------------------------------

    def health(self, req: p.HealthRequest) -> p.HealthResponse:
        return p.HealthResponse(request_id=req.request_id, version=__version__, protocol=p.PROTOCOL_VERSION,
                                open_sessions=len(self.state.sessions()),
                                uptime_s=time.monotonic() - self.started)

    def open_session(self, req: p.OpenSessionRequest, peer: Peer) -> p.OpenSessionResponse:
        session_id = "s-" + uuid.uuid4().hex[:12]
        image = req.image or self.config.image
        if not IMAGE_REFERENCE.fullmatch(image):
            raise NotFound(f"{image!r} is not an image reference (name[:tag], name@digest or an id)", image=image)
        if not self.containers.image_exists(image):
            raise NotFound(f"image {image!r} not found on the Docker engine", image=image)
        self.state.add_session(session_id, image, owner=peer.key)
        with self.session_lock(session_id):
            try:
                root = self.store.create(session_id, self.containers.owner())
                container_id = self.containers.create(session_id, image, root, self.store.propagation)
            except BaseException:
                self._teardown(session_id)
                self.state.update_session(session_id, state="failed", closed_at=time.time())
                raise
            self.state.update_session(session_id, state="open", container_id=container_id)
            for value in req.forget:
                self.revocations.forget(session_id, value)
        log.info("session %s opened on %s", session_id, image, extra=log_ids(req, peer, session_id=session_id))
        return p.OpenSessionResponse(request_id=req.request_id, session=self._info(session_id))

    def close_session(self, req: p.CloseSessionRequest) -> p.CloseSessionResponse:
        with self.session_lock(req.session_id):
            self.check_open(req.session_id)
            self.state.update_session(req.session_id, state="closing")
            # A replay left open would keep its holds out of reach of every later decision.
            self.firewall.abandon_open_replay(req.session_id)
            for held in self.firewall.outbox(req.session_id):
                if held.policy == "on_commit":  # its turn can never commit now
                    self.firewall.drop(held.call_id)
            self._teardown(req.session_id)
            self.state.delete_snapshots_of(req.session_id)
            # A closed session keeps its row; what its tools returned and what the agent saw is deleted.
            self.provenance.delete_session(req.session_id)
            self.state.delete_calls_of(req.session_id)
            if self.world is not None:
                self.world.forget(req.session_id)
            self.state.update_session(req.session_id, state="closed", closed_at=time.time())
            self.state.purge()
        log.info("session %s closed", req.session_id, extra=log_ids(req, None))
        return p.CloseSessionResponse(request_id=req.request_id, session_id=req.session_id)

    # The outside world ----------------------------------------------------------------------------

    def _world(self) -> AgentDojoWorld:
        if self.world is None:
            raise NotFound("this daemon holds no world: set [world] agentdojo_suite in its configuration")
        return self.world

    def world_reset(self, req: p.WorldResetRequest) -> p.WorldResponse:
        world = self._world()
        self.check_open(req.session_id)
        env = world.reset(req.session_id, req.injections, req.user_task)
        return p.WorldResponse(request_id=req.request_id, session_id=req.session_id, suite=world.name,
                               environment=env)

    def world_state(self, req: p.WorldStateRequest) -> p.WorldResponse:
        world = self._world()
        if self.state.session(req.session_id) is None:
            raise UnknownSession(req.session_id)
        return p.WorldResponse(request_id=req.request_id, session_id=req.session_id, suite=world.name,
                               environment=world.state(req.session_id))

    def _teardown(self, session_id: str) -> None:
        self.containers.remove(session_id)
        self.store.destroy(session_id)

    def list_sessions(self, req: p.ListSessionsRequest, peer: Peer) -> p.ListSessionsResponse:
        states = ("open", "closed", "failed") if req.include_closed else ("open",)
        rows = self.state.sessions(states, owner=None if peer.operator else peer.key)
        return p.ListSessionsResponse(request_id=req.request_id, sessions=[_session_info(r) for r in rows])

    def _info(self, session_id: str) -> p.SessionInfo:
        row = self.state.session(session_id)
        assert row is not None, f"session {session_id} vanished while being served"
        return _session_info(row)

    def list_tools(self, req: p.ListToolsRequest) -> p.ListToolsResponse:
        if req.session_id is not None:
            self.check_open(req.session_id)
        return p.ListToolsResponse(request_id=req.request_id, tools=self.tools.manifests())

    # Calls -------------------------------------------------------------------------------------

    def call(self, req: p.CallRequest) -> p.CallResponse:
        manifest = self.tools.validate(req.tool, req.args)
        if manifest.effect == "external" and self.config.firewall.flow_control:
            blocked = tainted_argument(req.args, self.revocations.flagged(req.session_id))
            if blocked is not None:
                raise FlowBlocked(req.tool, *blocked)
        if self.effects.serves(req.tool):
            # Effects run in the daemon, never in the container, and outside the session lock: the
            # ledger serialises what must be serialised, and a slow mail server must not stall tools.
            self.check_open(req.session_id)
            result = self.effects.call(req, req.session_id)
            return p.CallResponse(request_id=req.request_id, result=self._sanitized(req.session_id, result))
        with self.session_lock(req.session_id):
            self.check_open(req.session_id)
            if req.call_id is not None and (record := self.state.call(req.session_id, req.call_id)) is not None:
                return p.CallResponse(request_id=req.request_id, result=self._answer_from_record(req, record))
            if manifest.effect == "external":
                raise ExternalUnavailable(f"{req.tool} is an external tool that no effect adapter serves",
                                          tool=req.tool)
            call_id = req.call_id or "c-" + uuid.uuid4().hex
            self.state.begin_call(call_id, req.session_id, req.tool, req.args, manifest.effect,
                                  branch=req.branch, turn=req.turn)
            try:
                result = self._sanitized(req.session_id, self._execute(req, call_id))
            except SandboxdError as exc:
                code, message, details = to_wire(exc)
                status = "timeout" if isinstance(exc, ToolTimeout) else "error"
                self.state.finish_call(req.session_id, call_id, status, {"kind": "error", "code": code.value,
                                                         "message": message, "details": details})
                log.info("call %s of %s: %s", call_id, req.tool, status, extra=log_ids(req, None, call_id=call_id))
                raise
            self.state.finish_call(req.session_id, call_id, "done", {"kind": "result", **msgspec.to_builtins(result)})
            log.debug("call %s of %s: done", call_id, req.tool, extra=log_ids(req, None, call_id=call_id))
        return p.CallResponse(request_id=req.request_id, result=result)

    def _sanitized(self, session_id: str, result: p.CallResult) -> p.CallResult:
        """A result with the session's forgotten values excised, before it is recorded or returned.

        Structured data is filtered value by value and the text the agent reads is rendered again from
        the clean data, so no serialization of it (escaped or not) can carry a forgotten value."""
        forget = self.revocations.filter(session_id)
        if not forget:
            return result
        data = forget.value(result.data) if result.data is not None else None
        rendered = result.data is not None and result.stdout == result_text(result.data)
        # The rendering is filtered as text too: a target may span the structure it re-creates.
        stdout = forget.text(result_text(data) if rendered else result.stdout)
        return msgspec.structs.replace(result, stdout=stdout, stderr=forget.text(result.stderr), data=data)

    def _answer_from_record(self, req: p.CallRequest, record: dict[str, Any]) -> p.CallResult:
        """A retried call id: the recorded answer, never a second run."""
        if record["session_id"] != req.session_id or record["tool"] != req.tool \
                or record["args"] != canonical_args(req.args):
            raise CallIdConflict(record["call_id"], "for a different call (session, tool or arguments differ)")
        if record["status"] in ("running", "interrupted"):
            raise CallInterrupted(record["call_id"])
        saved = json.loads(record["result"])
        if saved.pop("kind") == "error":
            raise RecordedError(saved["code"], saved["message"], saved["details"])
        result = msgspec.convert(saved, p.CallResult)
        result.replayed = True
        return result

    def _execute(self, req: p.CallRequest, call_id: str) -> p.CallResult:
        limits = self.config.tools
        timeout = min(float(req.args.get("timeout_s") or req.timeout_s or limits.timeout_s), limits.max_timeout_s)
        payload = executor_request(req.tool, req.args)
        payload.update(timeout=timeout, output_bytes=limits.output_bytes, max_bytes=limits.read_bytes)
        if req.clock is not None:
            payload["clock"] = req.clock
        started = time.monotonic()
        reply = self._executor(req.session_id, payload, timeout + 10.0)
        if "error" in reply:
            details = dict(reply.get("details") or {}, call_id=call_id, tool=req.tool)
            factory = _EXECUTOR_ERRORS.get(reply["error"])
            raise factory(reply["message"], details) if factory else ToolError(reply["message"], **details)
        if reply.get("timed_out"):
            raise ToolTimeout(call_id, timeout, reply.get("stdout", ""), reply.get("stderr", ""))
        if reply.get("oom_killed"):
            raise ResourceLimit(call_id, "memory", f"call {call_id} was killed: it ran out of memory "
                                f"(limit {self.config.sandbox.memory_mb} MB)", exit_code=reply["exit_code"])
        return p.CallResult(
            call_id=call_id, tool=req.tool, exit_code=int(reply.get("exit_code", 0)),
            stdout=reply.get("stdout", ""), stderr=reply.get("stderr", ""),
            stdout_truncated=bool(reply.get("stdout_truncated")),
            stderr_truncated=bool(reply.get("stderr_truncated")),
            duration_ms=(time.monotonic() - started) * 1000,
        )

    def _executor(self, session_id: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One executor request; a dead container is restarted and the failure reported."""
        try:
            return self.containers.channel(session_id).request(payload, timeout)
        except SandboxUnavailable as exc:
            restarted = self.containers.ensure_running(session_id)
            raise SandboxUnavailable(f"{exc.message}; sandbox {'restarted' if restarted else 'is gone'}",
                                     session_id=session_id, restarted=restarted) from exc

    # Snapshots ---------------------------------------------------------------------------------

    def snapshot(self, req: p.SnapshotRequest) -> p.SnapshotResponse:
        with self.session_lock(req.session_id):
            self.check_open(req.session_id)
            row = self._take_snapshot(req.session_id, req.label)
        return p.SnapshotResponse(request_id=req.request_id, snapshot=_snapshot_info(row))

    def _take_snapshot(self, session_id: str, label: str | None) -> dict[str, Any]:
        """Freeze the sandbox (caller holds the session lock); the sandbox then equals this snapshot."""
        snapshot_id = "snap-" + uuid.uuid4().hex[:12]
        with self.metrics.timed("snapshot"):
            self._quiesce(session_id)
            try:
                taken = self.store.take(session_id, snapshot_id)
            except (SnapshotError, OSError) as exc:
                raise SnapshotFailed(f"snapshot of {session_id} failed: {exc}") from exc
        row = {"snapshot_id": snapshot_id, "session_id": session_id, "label": label,
               "created_at": taken.record.created_at, "layers": len(taken.record.layers),
               "elapsed_ms": taken.elapsed_ms}
        self.state.add_snapshot(row)
        self.state.update_session(session_id, env_snapshot=snapshot_id)
        return row

    def current_snapshot(self, session_id: str) -> str:
        """A snapshot equal to the sandbox now: the last one if nothing was written since, else a new one."""
        row = self.check_open(session_id)
        if row.get("env_snapshot") and self.state.snapshot(row["env_snapshot"]) is not None:
            return str(row["env_snapshot"])
        return str(self._take_snapshot(session_id, CHECKPOINT_LABEL)["snapshot_id"])

    def restore_snapshot(self, session_id: str, snapshot_id: str) -> float:
        """Restore (caller holds the session lock); returns milliseconds spent in the store."""
        self._own_snapshot(session_id, snapshot_id)
        with self.metrics.timed("restore"):
            self._quiesce(session_id)
            # /tmp is scratch, not part of a snapshot: a restored sandbox starts it empty.
            self._executor(session_id, {"op": "clear_scratch"}, 10.0)
            # Until the restore is known to be done, no snapshot is known to equal the sandbox.
            self.state.update_session(session_id, env_snapshot=None)
            try:
                done = self.store.restore(session_id, snapshot_id)
            except UnknownSnapshot as exc:
                raise SnapshotNotFound(snapshot_id, session_id) from exc
            except (SnapshotError, OSError) as exc:
                raise SnapshotFailed(f"restore of {snapshot_id} failed: {exc}") from exc
        self.state.update_session(session_id, env_snapshot=snapshot_id)
        return done.elapsed_ms

    def drop_unreferenced_checkpoint_snapshots(self, session_id: str, live: list[p.CheckpointRecord]) -> None:
        """Delete checkpoint snapshots that no remaining checkpoint refers to (an old suffix's)."""
        keep = {c.snapshot_id for c in live}
        current = self.check_open(session_id).get("env_snapshot")
        for row in self.state.snapshots(session_id):
            if row["label"] == CHECKPOINT_LABEL and row["snapshot_id"] not in keep and row["snapshot_id"] != current:
                self.store.delete(session_id, row["snapshot_id"])
                self.state.delete_snapshot(row["snapshot_id"])

    def restore(self, req: p.RestoreRequest) -> p.RestoreResponse:
        with self.session_lock(req.session_id):
            self.check_open(req.session_id)
            elapsed = self.restore_snapshot(req.session_id, req.snapshot_id)
        return p.RestoreResponse(request_id=req.request_id, session_id=req.session_id,
                                 snapshot_id=req.snapshot_id, elapsed_ms=elapsed)

    def list_snapshots(self, req: p.ListSnapshotsRequest) -> p.ListSnapshotsResponse:
        self.check_open(req.session_id)
        rows = self.state.snapshots(req.session_id)
        return p.ListSnapshotsResponse(request_id=req.request_id, snapshots=[_snapshot_info(r) for r in rows])

    def delete_snapshot(self, req: p.DeleteSnapshotRequest) -> p.DeleteSnapshotResponse:
        with self.session_lock(req.session_id):
            self.check_open(req.session_id)
            self._own_snapshot(req.session_id, req.snapshot_id)
            try:
                self.store.delete(req.session_id, req.snapshot_id)
            except UnknownSnapshot:
                pass  # a crash between store and state already removed the files
            self.state.delete_snapshot(req.snapshot_id)
        return p.DeleteSnapshotResponse(request_id=req.request_id, snapshot_id=req.snapshot_id)

    def _own_snapshot(self, session_id: str, snapshot_id: str) -> dict[str, Any]:
        row = self.state.snapshot(snapshot_id)
        if row is None or row["session_id"] != session_id:
            raise SnapshotNotFound(snapshot_id, session_id)
        return row

    def _quiesce(self, session_id: str) -> None:
        """No process of the sandbox may write into a layer while it is frozen or replaced."""
        reply = self._executor(session_id, {"op": "reap"}, 10.0)
        if not reply.get("ok"):
            raise SandboxUnavailable(f"could not quiesce {session_id}: {reply}")

    # Recovery ----------------------------------------------------------------------------------

    def recover(self) -> None:
        """Bring sessions, containers and snapshots back in line after a crash or restart."""
        for call_id in self.state.interrupt_running_calls():
            log.warning("call %s was interrupted by a restart", call_id)
        for call_id in self.firewall.recover():
            log.warning("external call %s was cut between intent and result: now unknown", call_id)
        for row in self.state.sessions(("opening", "closing")):
            self._teardown(row["session_id"])
            self.state.delete_snapshots_of(row["session_id"])
            final = "failed" if row["state"] == "opening" else "closed"
            self.state.update_session(row["session_id"], state=final, closed_at=time.time())
        live: set[str] = set()
        for row in self.state.sessions(("open",)):
            self._recover_session(row)
            live.add(row["session_id"])
        for session_id in set(self.containers.sessions_with_containers()) - live:
            log.warning("removing orphaned container of %s", session_id)
            self.containers.remove(session_id)
        for workspace in set(self.store.workspaces()) - live:
            log.warning("removing orphaned workspace %s", workspace)
            self.store.destroy(workspace)
        self.revocations.recover()

    def _recover_session(self, row: dict[str, Any]) -> None:
        session_id = row["session_id"]
        self.store.recover(session_id)
        on_disk = {r.snapshot_id for r in self.store.list(session_id)}
        recorded = {r["snapshot_id"] for r in self.state.snapshots(session_id)}
        for snapshot_id in on_disk - recorded:  # taken but never acknowledged
            self.store.delete(session_id, snapshot_id)
        for snapshot_id in recorded - on_disk:  # deleted from disk, row left by a crash
            self.state.delete_snapshot(snapshot_id)
        if not self.containers.ensure_running(session_id):
            log.warning("recreating the missing container of %s", session_id)
            container_id = self.containers.create(session_id, row["image"], self.store.mount_root(session_id),
                                                  self.store.propagation)
            self.state.update_session(session_id, container_id=container_id)


def log_ids(request: p.Request, peer: Peer | None, error: SandboxdError | None = None,
            **known: str) -> dict[str, str]:
    """The ids a log line about `request` carries as JSON fields (see `JsonFormatter`)."""
    ids = {"request_id": request.request_id, **known}
    if peer is not None:
        ids["peer_key"] = peer.key
    for key in ("session_id", "call_id"):
        value = ids.get(key) or getattr(request, key, None) or (error.details.get(key) if error else None)
        if isinstance(value, str):
            ids[key] = value
    return ids


def error_response(request_id: str, error: BaseException) -> p.ErrorResponse:
    """The one mapping from an exception to the error reply."""
    code, message, details = to_wire(error)
    return p.ErrorResponse(request_id=request_id, code=code.value, message=message,
                           details=msgspec.to_builtins(details))


def _session_info(row: dict[str, Any]) -> p.SessionInfo:
    state: Literal["open", "closed"] = "open" if row["state"] == "open" else "closed"
    return p.SessionInfo(session_id=row["session_id"], image=row["image"], state=state,
                         created_at=row["created_at"], container=row["container_id"])


def _snapshot_info(row: dict[str, Any]) -> p.SnapshotInfo:
    return p.SnapshotInfo(snapshot_id=row["snapshot_id"], session_id=row["session_id"],
                          created_at=row["created_at"], label=row["label"], layers=row["layers"] or 1,
                          elapsed_ms=row["elapsed_ms"] or 0.0)
