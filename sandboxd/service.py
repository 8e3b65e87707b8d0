"""The composition root: every part of the daemon built from its configuration, and the requests mapped to them.

Nothing imports this module but the daemon's entry point. It builds the session model (`Sessions`),
the calls, the firewall, provenance, forgetting and revocation, and the branch participants in their
order (`Branches`), wiring each to what it needs by value, so no part reaches into another.

`Service.handle` is the one error boundary: whatever a handler raises becomes an `ErrorResponse` with an
enumerated code. It is also the one ownership check: a session is used only by the peer that opened it
or by an operator (`sandboxd.auth`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from sandboxd import __version__, atonce, auth
from sandboxd import protocol as p
from sandboxd.auth import Peer
from sandboxd.branch import Branches
from sandboxd.calls import Calls
from sandboxd.config import DaemonConfig
from sandboxd.copying import Copying
from sandboxd.db import Database
from sandboxd.errors import NotFound, SandboxdError, UnknownSession, UnknownTool
from sandboxd.events import Events
from sandboxd.firewall.handlers import FirewallHandlers, FirewallParticipant
from sandboxd.firewall.service import Firewall
from sandboxd.firewall.world import WORLDS, AgentDojoWorld
from sandboxd.fork import Forks
from sandboxd.metrics import DaemonMetrics
from sandboxd.provenance.handlers import ProvenanceHandlers
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.detector import load_detector
from sandboxd.revocation.forgotten import Forgotten, load_salt
from sandboxd.revocation.leaks import LeakScanner
from sandboxd.revocation.operator import RevocationOperator
from sandboxd.revocation.records import Revocations
from sandboxd.rollback import Rollbacks
from sandboxd.sandbox.base import Sandbox
from sandboxd.sandbox.usage import container_usage
from sandboxd.session import Sessions
from sandboxd.tools.builtin import BUILTIN_TOOLS
from sandboxd.tools.registry import ToolRegistry
from snapshots import SnapshotStore

log = logging.getLogger("sandboxd")


#: successful replies that change what a session's timeline shows, and the event kind each publishes
_ANNOUNCED: dict[type[Any], str] = {
    p.CallResponse: "call", p.CommitTurnResponse: "call", p.DropTurnResponse: "call",
    p.RecordArtifactsResponse: "artifact", p.CheckpointResponse: "checkpoint",
    p.SnapshotResponse: "snapshot", p.RestoreResponse: "snapshot", p.DeleteSnapshotResponse: "snapshot",
    p.CommitRevocationResponse: "revocation",
}


class Service:
    """The daemon's parts, and its requests dispatched by type to them."""

    #: requests cheap enough to answer on the socket thread (they read, and take no session lock)
    INLINE: tuple[type[Any], ...] = (p.HealthRequest, p.ListToolsRequest, p.ListSessionsRequest, p.ListSnapshotsRequest,
              p.ListCallsRequest, p.OutboxRequest, p.PendingRevocationsRequest, p.RevocationStatusRequest,
              p.ListRevocationsRequest)

    OPERATOR_ONLY = auth.OPERATOR_ONLY

    def __init__(self, config: DaemonConfig, db: Database, sandbox: Sandbox, store: SnapshotStore) -> None:
        self.config = config
        self.db = db
        self.started = time.monotonic()
        self.events = Events()
        self.world = AgentDojoWorld(config.world.agentdojo_suite, config.state_path / WORLDS,
                                    config.world.agentdojo_version) if config.world.agentdojo_suite else None
        world_tools = self.world.adapters(config.firewall.adapter_timeout_s) if self.world else []
        self.firewall = Firewall(config.firewall, db, extra=world_tools)
        # The world's tools replace sandbox tools of the same name: the suite's tasks name them so.
        served = {adapter.manifest.name for adapter in world_tools}
        self.tools = ToolRegistry([*(t for t in BUILTIN_TOOLS if t.name not in served), *self.firewall.manifests()])
        self.metrics = DaemonMetrics(self.firewall.stats, lambda: self.sessions.count_open(), self._effect_of)
        self.sessions = Sessions(db, sandbox, store, config.image, timed=self.metrics.timed)
        self.provenance = ProvenanceStore(db)
        self.sessions.live_snapshots = self._live_snapshots
        salt = load_salt(config.state_path)
        self.forgotten = Forgotten(db, salt)
        self.effects = FirewallHandlers(self.firewall, self.sessions.check_open, self.sessions.known,
                                        lambda sid: [row.ledger_call() for row in self.calls.of_session(sid)],
                                        holds_effects=self._holds_effects)
        self.calls = Calls(db, config, self.sessions, self.tools, self.effects, self.forgotten.filter,
                           flagged=lambda sid: self.revocations.flagged(sid))
        # Committing runs in this order, the ledger last: its commit ends the operation (sandboxd.branch).
        self.branches = Branches(db, [self.provenance, *([self.world] if self.world else []), self.calls,
                                      self.sessions, FirewallParticipant(self.firewall)], reached=self._reached)
        self.revocations = Revocations(db, self.provenance, self.branches, self.forgotten,
                                       load_detector(config.detector), self.sessions.check_open, self._raised,
                                       known=self.sessions.known)
        scanner = LeakScanner(db, salt, config.state_path, store.paths, store.file_trees, sandbox.scan_scratch,
                              context=lambda sid: [a for a in self.provenance.artifacts(sid) if a.token_span])
        self.operator = RevocationOperator(
            db, self.revocations, self.forgotten, self.branches, self.sessions, self.provenance, scanner,
            served_in_daemon=self.effects.serves, fired_twice=self.firewall.ledger.fired_twice,
            outside_world=self.world.suite_name if self.world else None,
            committed=lambda by: self.metrics.revocation("committed", by), log_path=config.state_path / "sandboxd.log")
        self.copying = Copying(self.sessions, self.calls)
        self.rollbacks = Rollbacks(db, self.sessions, self.provenance, self.calls, self.branches, self.firewall,
                                   self.revocations, lambda sid, op: self.events.publish(sid, "rollback", op))
        self.forks = Forks(db, self.sessions, self.provenance, self.firewall, has_world=self.world is not None,
                           reached=self._reached)
        world = self.world
        self.provenance_handlers = ProvenanceHandlers(
            self.provenance, self.sessions, self.revocations.on_observation,
            on_checkpoint=(lambda sid, cp, branch: world.mark(sid, cp, branch)) if world else (lambda *_: None))
        self.handlers: dict[type[Any], Callable[[Any], p.Response]] = {
            p.HealthRequest: self.health,
            p.CloseSessionRequest: self.close_session,
            p.ListToolsRequest: self.list_tools,
            p.CallRequest: self.calls.call,
            p.SnapshotRequest: self.snapshot,
            p.RestoreRequest: self.restore,
            p.ListSnapshotsRequest: self.list_snapshots,
            p.DeleteSnapshotRequest: self.delete_snapshot,
            **self.effects.handlers(),
            **self.provenance_handlers.handlers(),
            **self.operator.handlers(),
            p.WorldResetRequest: self.world_reset,
            p.WorldStateRequest: self.world_state,
            **self.copying.handlers(),
            p.CallOutputRequest: self.calls.output,
            p.RollbackRequest: self.rollbacks.rollback,
            p.ForkRequest: self.forks.fork,
            p.AdoptSessionRequest: self.adopt_session,
        }
        #: requests whose answer depends on who asks: the owner of a new session, whose sessions to list
        self.peer_handlers: dict[type[Any], Callable[[Any, Peer], p.Response]] = {
            p.OpenSessionRequest: self.open_session,
            p.ListSessionsRequest: self.list_sessions,
            **self.effects.peer_handlers(),
        }

    # The error boundary and the ownership check --------------------------------------------------

    def handle(self, request: p.Request, peer: Peer, started: float | None = None) -> p.Response:
        """Check `peer` may make this request, run its handler; every failure becomes an ErrorResponse.
        `started` (`time.perf_counter`) is when its work began, where that was before this call."""
        started = time.perf_counter() if started is None else started
        reply = self._serve(request, peer)
        self.metrics.observe(request, reply, time.perf_counter() - started)
        sid = getattr(request, "session_id", None)
        if isinstance(reply, p.CommitRevocationResponse):
            sid = reply.report.session
        if (kind := _ANNOUNCED.get(type(reply))) is not None and isinstance(sid, str):
            # Watchers of the session (the console's timeline) hear that something happened; what, they read.
            result = getattr(reply, "result", None)
            self.events.publish(sid, kind, getattr(result, "call_id", "") or "")
        return reply

    def answer_now(self, request: p.Request, peer: Peer) -> p.Response | None:
        """The reply to a request that can be served without waiting on anything (see `sandboxd.atonce`),
        served as `handle` serves it; None when it cannot, with nothing done: a worker serves it."""
        if not isinstance(request, p.CallRequest):
            return None
        started, may = time.perf_counter(), atonce.may_read(request, peer, self.revocations.session_of)
        with atonce.answering(self.calls, request, may) as ready:
            return self.handle(request, peer, started) if ready else None

    def _serve(self, request: p.Request, peer: Peer) -> p.Response:
        try:
            with self.events.held(), self.db.one_flush():  # one wait for the disk, before reply and events
                return self._dispatch(request, peer)
        except SandboxdError as exc:
            log.info("request %s failed: %s", request.request_id, exc, extra=log_ids(request, peer, exc))
            return p.error_response(request.request_id, exc)
        except AssertionError:
            log.critical("broken invariant while serving %r", request, exc_info=True, extra=log_ids(request, peer))
            raise
        except Exception as exc:
            log.exception("internal error serving %s", type(request).__name__, extra=log_ids(request, peer))
            return p.error_response(request.request_id, exc)

    def _dispatch(self, request: p.Request, peer: Peer) -> p.Response:
        self.authorize(request, peer)
        # Activity is what the session's user does; an operator's listing (inline requests) is not.
        session_id = None if isinstance(request, self.INLINE) else getattr(request, "session_id", None)
        if isinstance(session_id, str):
            self.sessions.touch(session_id)
        try:
            if (for_peer := self.peer_handlers.get(type(request))) is not None:
                return for_peer(request, peer)
            return self.handlers[type(request)](request)
        finally:
            if isinstance(session_id, str):
                self.sessions.touch(session_id)  # a long call leaves it idle from its end, not its start

    def authorize(self, request: p.Request, peer: Peer) -> None:
        """The one ownership check (`sandboxd.auth.authorize`) on this daemon's sessions."""
        def owner_of(session_id: str) -> str | None:
            row = self.sessions.get(session_id)
            return row.owner if row is not None else None

        auth.authorize(request, peer, owner_of, self.revocations.session_of)

    def wait_events(self, request: p.WaitEventsRequest, peer: Peer) -> p.Response | None:
        """A long-poll's answer now (its events, an error, or none left to wait for), or None to park it."""
        try:
            self.authorize(request, peer)
            self.sessions.known(request.session_id)
        except SandboxdError as exc:
            return p.error_response(request.request_id, exc)
        events = self.events.since(request.session_id, request.after, request.epoch)
        if events or request.timeout_s == 0:
            return p.WaitEventsResponse(request_id=request.request_id, epoch=self.events.epoch, events=events)
        return None

    def no_events(self, request: p.WaitEventsRequest) -> p.WaitEventsResponse:
        return p.WaitEventsResponse(request_id=request.request_id, epoch=self.events.epoch, events=[])

    def adopt_session(self, req: p.AdoptSessionRequest) -> p.AdoptSessionResponse:
        """A lost node's session, served here from the snapshot its workspace was imported from (`sandboxd.fleet`);
        its ledger, provenance and calls were never the lost node's: they are in the shared state."""
        with self.sessions.lock(req.session_id):
            row, snapshot_id = self.sessions.adopt(req.session_id)
        log.warning("adopted session %s from snapshot %s", req.session_id, snapshot_id,
                    extra={"session_id": req.session_id})
        return p.AdoptSessionResponse(request_id=req.request_id, session=row.info(), snapshot_id=snapshot_id)

    def _raised(self, session_id: str, revocation_id: str, raised_by: str) -> None:
        self.metrics.revocation("raised", raised_by)
        self.events.publish(session_id, "revocation", revocation_id)

    def _effect_of(self, tool: str) -> str | None:
        """The effect class of a registered tool, None for a name no tool has."""
        try:
            return self.tools.get(tool).effect
        except UnknownTool:
            return None

    def _reached(self, point: str) -> None:
        if point in self.config.crash_at:
            log.critical("crash_at %s: killing the daemon (fault injection)", point)
            os.kill(os.getpid(), signal.SIGKILL)

    def _holds_effects(self, session_id: str) -> bool:
        row = self.sessions.get(session_id)
        return row is not None and bool(row.hold_effects)

    def _live_snapshots(self, session_id: str) -> set[str]:
        return {c.snapshot_id for c in self.provenance.checkpoints(session_id) if c.snapshot_id}

    # Sessions ----------------------------------------------------------------------------------

    def health(self, req: p.HealthRequest) -> p.HealthResponse:
        return p.HealthResponse(request_id=req.request_id, version=__version__, protocol=p.PROTOCOL_VERSION,
                                open_sessions=self.sessions.count_open(), uptime_s=time.monotonic() - self.started,
                                max_frame=self.config.max_frame_bytes)

    def open_session(self, req: p.OpenSessionRequest, peer: Peer) -> p.OpenSessionResponse:
        row = self.sessions.open(req.image, owner=peer.key, idle_timeout_s=req.idle_timeout_s, ttl_s=req.ttl_s)
        for value in req.forget:
            self.forgotten.forget(row.session_id, value)
        log.info("session %s opened on %s", row.session_id, row.image,
                 extra=log_ids(req, peer, session_id=row.session_id))
        return p.OpenSessionResponse(request_id=req.request_id, session=row.info())

    def close_session(self, req: p.CloseSessionRequest) -> p.CloseSessionResponse:
        sid = req.session_id
        with self.sessions.lock(sid):
            self.sessions.check_open(sid)
            self.sessions.update(sid, state="closing", durable=True)  # on disk before the sandbox goes
            # A branch left open would keep its holds out of reach of every later decision.
            if (branch := self.branches.open_branch(sid)) is not None:
                self.branches.abandon(branch)
            for held in self.firewall.outbox(sid):
                if held.policy == "on_commit":  # its turn can never commit now
                    self.firewall.drop(held.call_id)
            self.sessions.teardown(sid)
            # A closed session keeps its row; what its tools returned and what the agent saw is deleted.
            self.provenance.delete_session(sid)
            self.calls.delete_of(sid)
            if self.world is not None:
                self.world.forget(sid)
            self.forgotten.drop(sid)
            self.events.forget(sid)
            self.sessions.closed(sid)
            # Deleted, not revoked: on a shared server a rewrite of tables every node writes, at every
            # close, would cost more than the promise it keeps (none beyond the rows' deletion, see pg.reclaim).
            self.db.purge(erase=False)
        log.info("session %s closed", sid, extra=log_ids(req, None))
        return p.CloseSessionResponse(request_id=req.request_id, session_id=sid)

    def list_sessions(self, req: p.ListSessionsRequest, peer: Peer) -> p.ListSessionsResponse:
        # Every state with --all: a session being closed (by its idle timeout, say) is still listed, not lost.
        states = ("opening", "open", "closing", "closed", "failed", "lost") if req.include_closed else ("open",)
        rows = self.sessions.in_states(states, owner=None if peer.operator else peer.key)
        infos = []
        for row in rows:
            info = row.info()
            if row.state == "open":
                info.last_used_at = self.sessions.last_used(row)
                info.usage = container_usage(row.container_id)
                info.usage["disk_bytes"] = self.sessions.store.disk_bytes(row.session_id)
            infos.append(info)
        return p.ListSessionsResponse(request_id=req.request_id, sessions=infos)

    def expire(self, now: float | None = None) -> list[str]:
        """Close the sessions past their time to live or idle timeout; returns their ids."""
        closed = []
        for session_id, why in self.sessions.expired(time.time() if now is None else now):
            try:
                self.close_session(p.CloseSessionRequest(request_id=f"expire-{session_id}", session_id=session_id))
            except SandboxdError as exc:  # closed meanwhile by its user, or a sandbox that will not go
                log.info("could not expire session %s: %s", session_id, exc)
                continue
            log.info("session %s closed: %s", session_id, why, extra={"session_id": session_id})
            closed.append(session_id)
        return closed

    def list_tools(self, req: p.ListToolsRequest) -> p.ListToolsResponse:
        if req.session_id is not None:
            self.sessions.check_open(req.session_id)
        return p.ListToolsResponse(request_id=req.request_id, tools=self.tools.manifests())

    # Snapshots ---------------------------------------------------------------------------------

    def snapshot(self, req: p.SnapshotRequest) -> p.SnapshotResponse:
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            row = self.sessions.take(req.session_id, req.label)
        return p.SnapshotResponse(request_id=req.request_id, snapshot=row.info())

    def restore(self, req: p.RestoreRequest) -> p.RestoreResponse:
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            elapsed = self.sessions.restore(req.session_id, req.snapshot_id)
        return p.RestoreResponse(request_id=req.request_id, session_id=req.session_id, snapshot_id=req.snapshot_id,
                                 elapsed_ms=elapsed)

    def list_snapshots(self, req: p.ListSnapshotsRequest) -> p.ListSnapshotsResponse:
        self.sessions.check_open(req.session_id)
        return p.ListSnapshotsResponse(request_id=req.request_id,
                                       snapshots=[r.info() for r in self.sessions.snapshots(req.session_id)])

    def delete_snapshot(self, req: p.DeleteSnapshotRequest) -> p.DeleteSnapshotResponse:
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            broken = self.sessions.delete(req.session_id, req.snapshot_id, force=req.force)
        if broken:
            log.warning("snapshot %s of %s deleted by force: checkpoints %s can no longer restore files",
                        req.snapshot_id, req.session_id, ", ".join(broken), extra={"session_id": req.session_id})
        return p.DeleteSnapshotResponse(request_id=req.request_id, snapshot_id=req.snapshot_id, broken=broken)

    # The outside world ---------------------------------------------------------------------------

    def _world(self) -> AgentDojoWorld:
        if self.world is None:
            raise NotFound("this daemon holds no world: set [world] agentdojo_suite in its configuration")
        return self.world

    def world_reset(self, req: p.WorldResetRequest) -> p.WorldResponse:
        world = self._world()
        self.sessions.check_open(req.session_id)
        env = world.reset(req.session_id, req.injections, req.user_task)
        return p.WorldResponse(request_id=req.request_id, session_id=req.session_id, suite=world.suite_name,
                               environment=env)

    def world_state(self, req: p.WorldStateRequest) -> p.WorldResponse:
        world = self._world()
        if self.sessions.get(req.session_id) is None:
            raise UnknownSession(req.session_id)
        return p.WorldResponse(request_id=req.request_id, session_id=req.session_id, suite=world.suite_name,
                               environment=world.state(req.session_id))

    # Recovery ----------------------------------------------------------------------------------

    def recover(self) -> None:
        """Bring calls, effects, sessions, sandboxes, snapshots and branches back in line after a crash."""
        for call_id in self.calls.interrupt_running():
            log.warning("call %s was interrupted by a restart", call_id)
        for call_id in self.firewall.recover():
            log.warning("external call %s was cut between intent and result: now unknown", call_id)
        self.sessions.recover()
        self.operator.recover()


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

