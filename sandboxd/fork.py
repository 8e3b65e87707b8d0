"""Fork: a new session from a checkpoint of another; the parent is left exactly as it is.

The fork gets the parent's files at the checkpoint (copies of the snapshots its checkpoints up to there
refer to, so a rollback or revocation in the fork can splice at any of them), the parent's provenance and
checkpoints up to the point (the agent's context: a new agent resumes from the fork's copy of the
checkpoint), the sandbox's call records up to it, and the ledger up to it: the fork's live ledger branch
inherits every call the parent reached before the point, so a retried call of that prefix is answered
from the record and never fires again. After the point the fork has its own branch and lineage (its call
ids are its own). The outside world is shared by parent and fork: by default every external call the fork
makes is held for an operator's release (`live_effects` lets them fire as the release policy says).

Crash safety. Files and sandbox first, under a session row in state `opening`; then the records and the
state `open` in one transaction. A crash before that transaction leaves an `opening` session, which start-up
tears down (marked failed) with nothing of it recorded; after it, the fork is whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sandboxd import protocol as p
from sandboxd.db import Database
from sandboxd.errors import NotFound, OperationRefused
from sandboxd.firewall.service import Firewall
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.session import Sessions

log = logging.getLogger("sandboxd")


class Forks:
    """The `Fork` request."""

    def __init__(self, db: Database, sessions: Sessions, provenance: ProvenanceStore, firewall: Firewall,
                 has_world: bool, reached: Callable[[str], None] = lambda _point: None) -> None:
        self.db = db
        self.reached = reached
        """Told each point a fork passes (fork:opening, fork:open): crash tests stop there."""
        self.sessions = sessions
        self.provenance = provenance
        self.firewall = firewall
        self.has_world = has_world

    def fork(self, req: p.ForkRequest) -> p.ForkResponse:
        sid = req.session_id
        with self.sessions.lock(sid):
            parent = self.sessions.check_open(sid)
            if self.has_world:
                raise OperationRefused("this daemon holds an outside world whose state is not forked: a fork would "
                                       "share the parent's world", session_id=sid)
            live = self.provenance.checkpoints(sid)
            at = next((c for c in live if c.checkpoint_id == req.checkpoint), None)
            if at is None:
                raise NotFound(f"session {sid} has no live checkpoint {req.checkpoint!r} (see sandboxd graph {sid})",
                               checkpoint_id=req.checkpoint)
            if at.snapshot_id is None:
                raise OperationRefused(f"checkpoint {at.checkpoint_id} has no snapshot: the fork could not have "
                                       "its files", checkpoint_id=at.checkpoint_id)
            self.sessions.own_snapshot(sid, at.snapshot_id)  # snapshot_not_found: deleted by force
            # The snapshots of the checkpoints up to the point that still exist; a later one is not the fork's.
            present = {s.snapshot_id for s in self.sessions.snapshots(sid)}
            wanted = sorted({c.snapshot_id for c in live if c.snapshot_id in present and c.created_at <= at.created_at}
                            | {at.snapshot_id})
            child, renamed = self.sessions.open_fork(parent, wanted, at.snapshot_id, hold_effects=not req.live_effects)
            self.reached("fork:opening")
            with self.db.transaction():
                artifacts, checkpoints = self.provenance.copy_to(sid, child.session_id, at, renamed)
                self.db.execute(
                    "INSERT INTO calls (call_id, session_id, seq, tool, args, effect, status, result, created_at, "
                    "finished_at, branch, turn) SELECT call_id, ?, seq, tool, args, effect, status, result, "
                    "created_at, finished_at, branch, turn FROM calls WHERE session_id = ? AND branch = '' AND "
                    "created_at <= ?", [child.session_id, sid, at.created_at])
                inherited = self.firewall.fork_ledger(sid, child.session_id, at.created_at)
                self.db.update("sessions", {"session_id": child.session_id}, state="open")
            self.reached("fork:open")
        log.info("session %s forked from %s at %s", child.session_id, sid, at.checkpoint_id,
                 extra={"session_id": child.session_id})
        report = p.ForkReport(session_id=child.session_id, parent=sid,
                              at=next(c for c in self.provenance.checkpoints(child.session_id)
                                      if c.checkpoint_id == at.checkpoint_id),
                              artifacts=artifacts, checkpoints=checkpoints, snapshots=len(renamed),
                              inherited_calls=inherited, effects="live" if req.live_effects else "held")
        return p.ForkResponse(request_id=req.request_id, session=self.sessions.known(child.session_id).info(),
                              report=report)
