"""Rollback: an operator moves a whole session back to a point of its history; nothing is replayed.

One branch operation of kind `rollback` (`sandboxd.branch`), opened and committed in one request, so every
participant moves together: provenance and checkpoints after the point are truncated, the sandbox's call
records after it deleted, the sandbox's files restored to the point's snapshot, and the ledger's live branch
replaced by one that reached only what was reached before the point: held and staged calls after it are
dropped (they never fired), fired ones are orphaned and listed with the compensation their tool declares
(run with `compensate`, through the ledger, at most once). The agent resumes from the point when it next
connects: the point is the session's latest checkpoint now.

Crash safety. Beginning a rollback changes nothing but records (the sandbox participant restores the files
only when the operation commits), so a crash before the commit started is abandoned at start-up and leaves
the session as it was; once the commit started, start-up finishes it. Either way the session is before or
after the rollback, never between. Compensations run after the commit, outside the operation: a crash among
them leaves each either done once or to be run again by `sandboxd compensate` (an unknown one is reported).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branches
from sandboxd.calls import Calls
from sandboxd.db import Database
from sandboxd.errors import InvalidArguments, NotFound, OperationRefused, SandboxdError
from sandboxd.firewall.ledger import IN_FLIGHT_STATES
from sandboxd.firewall.service import Firewall
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.records import RevocationRow, Revocations
from sandboxd.session import Sessions

log = logging.getLogger("sandboxd")


class Rollbacks:
    """The `Rollback` request (a compensation alone is the firewall's: `CompensateRequest`)."""

    def __init__(self, db: Database, sessions: Sessions, provenance: ProvenanceStore, calls: Calls,
                 branches: Branches, firewall: Firewall, revocations: Revocations,
                 publish: Callable[[str, str], object]) -> None:
        self.db = db
        self.sessions = sessions
        self.provenance = provenance
        self.calls = calls
        self.branches = branches
        self.firewall = firewall
        self.revocations = revocations
        self.publish = publish
        """(session, operation id): tell whoever waits for the session's events that it moved."""

    def rollback(self, req: p.RollbackRequest) -> p.RollbackResponse:
        sid, started = req.session_id, time.time()
        with self.sessions.lock(sid):
            self.sessions.check_open(sid)
            splice = self.point(sid, req.checkpoint, req.snapshot, req.turn)
            unresolved = self._check_effects(sid, splice, req.force)
            artifacts, checkpoints = self.provenance.after(sid, splice)
            calls = int(self.db.value("SELECT COUNT(*) FROM calls WHERE session_id = ? AND branch = '' AND "
                                      "created_at > ?", [sid, splice.created_at]) or 0)
            branch = self.branches.open(sid, "rollback", splice)
            reports = self.branches.commit(branch)
            effects = reports.get("firewall", {})
            cancelled = self.revocations.rolled_back(sid, branch.id, self._gone(sid))
            report = p.RollbackReport(
                rollback=branch.id, session_id=sid, to=splice,
                files_restored=reports.get("sandbox", {}).get("files_restored"),
                dropped=list(effects.get("dropped", [])),
                orphaned=[self._orphan(cid) for cid in effects.get("orphaned", [])],
                unresolved=unresolved, artifacts_removed=artifacts, checkpoints_removed=checkpoints,
                calls_removed=calls, revocations_cancelled=cancelled, wall_ms=0.0)
            self._keep(report, started)
        log.info("session %s rolled back to %s (%s): %d orphaned, %d dropped", sid, splice.checkpoint_id or "its start",
                 branch.id, len(report.orphaned), len(report.dropped), extra={"session_id": sid})
        if req.compensate:
            for orphan in report.orphaned:
                if orphan.compensation is not None:
                    self._compensate(orphan)
            self._keep(report, started)
        self.publish(sid, branch.id)
        return p.RollbackResponse(request_id=req.request_id, report=report)

    # The point ---------------------------------------------------------------------------------

    def point(self, sid: str, checkpoint: str | None, snapshot: str | None, turn: int | None) -> p.CheckpointRecord:
        """The checkpoint a rollback (or fork) goes to, named by exactly one of checkpoint, snapshot or turn."""
        if sum(x is not None for x in (checkpoint, snapshot, turn)) != 1:
            raise InvalidArguments("rollback", "name exactly one point: a checkpoint, a snapshot or a turn",
                                   "$.checkpoint")
        live = sorted(self.provenance.checkpoints(sid), key=lambda c: c.created_at)
        if checkpoint is not None:
            found = next((c for c in live if c.checkpoint_id == checkpoint), None)
            if found is None:
                raise NotFound(f"session {sid} has no live checkpoint {checkpoint!r} (see sandboxd graph {sid})",
                               checkpoint_id=checkpoint)
        elif turn is not None:
            last = max((c.turn for c in live), default=0)
            if turn > last + 1:
                raise InvalidArguments("rollback", f"turn {turn} has not happened: the session is at turn {last}",
                                       "$.turn")
            found = next((c for c in reversed(live) if c.turn < turn), None)
            if found is None:
                raise NotFound(f"session {sid} has no checkpoint before turn {turn}", turn=turn)
        else:
            assert snapshot is not None
            snap = self.sessions.own_snapshot(sid, snapshot)
            # The last checkpoint whose files it holds; else the point in time it was taken at.
            found = next((c for c in reversed(live) if c.snapshot_id == snapshot), None)
            if found is None:
                before = next((c for c in reversed(live) if c.created_at <= snap.created_at), None)
                found = msgspec.structs.replace(before, snapshot_id=snapshot, created_at=snap.created_at) if before \
                    else p.CheckpointRecord(checkpoint_id="", step=0, turn=0, token_offset=0, cache_handle="",
                                            reason="start", snapshot_id=snapshot, created_at=snap.created_at)
        if found.snapshot_id is None:
            raise OperationRefused(f"checkpoint {found.checkpoint_id} of {sid} has no snapshot: its files cannot be "
                                   "restored (it was registered without one)", checkpoint_id=found.checkpoint_id)
        self.sessions.own_snapshot(sid, found.snapshot_id)  # snapshot_not_found: deleted by force
        return found

    def _check_effects(self, sid: str, splice: p.CheckpointRecord, force: bool) -> list[str]:
        """Refuse to pass over calls after the point that may be firing now, or whose outcome is unknown
        (unless forced: then they are returned, to be reported as unresolved)."""
        after = self.firewall.after_point(sid, splice.created_at)
        firing = [r.call_id for r in after if r.state in IN_FLIGHT_STATES]
        if firing:
            raise OperationRefused(f"external call(s) {', '.join(firing)} are firing now: roll back once they "
                                   "settle", calls=firing)
        unknown = [r.call_id for r in after if r.state == "unknown"]
        if unknown and not force:
            raise OperationRefused(
                f"external call(s) {', '.join(unknown)} after the point have an unknown outcome (they may have "
                "fired): resolve each first (sandboxd calls resolve CALL --outcome done|failed), or pass --force "
                "to roll back past them (they are reported as unresolved)", calls=unknown)
        return unknown

    # After the commit ----------------------------------------------------------------------------

    def _gone(self, sid: str) -> Callable[[RevocationRow], bool]:
        live_checkpoints = {c.checkpoint_id for c in self.provenance.checkpoints(sid)}

        def gone(row: RevocationRow) -> bool:
            try:
                self.provenance.artifact(sid, row.source)
            except NotFound:
                return True
            return row.checkpoint_id not in live_checkpoints

        return gone

    def _orphan(self, call_id: str) -> p.OrphanedEffect:
        record = self.firewall.ledger.get(call_id)
        assert record is not None, f"orphaned call {call_id} is not in the ledger"
        done = self.firewall.compensator.get(call_id)
        return p.OrphanedEffect(call_id=call_id, tool=record.tool, args=record.args, fired_at=record.created_at,
                                compensation=self.firewall.compensator.declared(record.tool),
                                compensation_call=done.call_id if done else None,
                                compensation_state=done.state if done else None)

    def _compensate(self, orphan: p.OrphanedEffect) -> None:
        try:
            result = self.firewall.compensate(orphan.call_id)
            orphan.compensation_call, orphan.compensation_state = result.call_id, result.state
        except SandboxdError as exc:
            record = self.firewall.compensator.get(orphan.call_id)
            orphan.compensation_call = record.call_id if record else None
            orphan.compensation_state = record.state if record else "failed"
            orphan.compensation_error = f"{exc.code.value}: {exc.message}"

    def _keep(self, report: p.RollbackReport, started: float) -> None:
        report.wall_ms = (time.time() - started) * 1000
        with self.db.transaction():
            self.db.update("branches", {"branch": report.rollback}, report=msgspec.json.encode(report).decode())
