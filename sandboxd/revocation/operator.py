"""The revocation operator (the paper's Algorithm 1), the daemon's half of it.

1. `Revoke` (an operator, a client, or the injection detector; `sandboxd.revocation.records`): locate the
   source, tau and the taint closure; the event waits as `pending` for the agent, which alone holds the model.
2. `BeginRevocation` (the agent takes it): the target joins the session's forgotten values, kept only as
   salted fingerprints, so every later tool result has it excised; a replay branch opens in every branch
   participant (`sandboxd.branch`): the sandbox goes back to the snapshot of the latest checkpoint before
   o_tau, the ledger counts the replay's shadow calls, the outside world shows its shadow at the splice;
   the agent gets the checkpoint and the exogenous inputs that follow it, sanitized.
3. The agent replays steps tau..T: calls in shadow mode, artifacts under the branch.
4. `CommitRevocation`: the branch commits in every participant (the old suffix's artifacts, call records
   and snapshots go); then erasure scrubs every record and the log, empties the WAL, and the leak scan
   says what is left and why; the report says what it cost and what could not be erased.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branch, Branches
from sandboxd.db import Database
from sandboxd.errors import (
    InvalidState,
    NotFound,
    OperationRefused,
    SandboxdError,
    SandboxUnavailable,
    SessionClosed,
    UnknownSession,
)
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.erasure import (
    MIN_NEEDLE_BYTES,
    byte_needles,
    scrub_database,
    scrub_log,
    target_filter,
    target_texts,
)
from sandboxd.revocation.forgetting import ForgetFilter
from sandboxd.revocation.forgotten import Forgotten
from sandboxd.revocation.leaks import LeakScan, LeakScanner, kept_cells
from sandboxd.revocation.records import RevocationRow, Revocations
from sandboxd.session import Sessions

log = logging.getLogger("sandboxd")


class RevocationOperator:
    """Takes pending revocations (begin), commits their replays (commit), and recovers after a crash."""

    def __init__(self, db: Database, records: Revocations, forgotten: Forgotten, branches: Branches,
                 sessions: Sessions, provenance: ProvenanceStore, scanner: LeakScanner, *,
                 served_in_daemon: Callable[[str], bool], fired_twice: Callable[[str], int],
                 outside_world: str | None, committed: Callable[[str], None], log_path: Path | None) -> None:
        self.db = db
        self.records = records
        self.forgotten = forgotten
        self.branches = branches
        self.sessions = sessions
        self.provenance = provenance
        self.scanner = scanner
        self.served_in_daemon = served_in_daemon
        """Whether a tool runs in the daemon (its result was rendered from data)."""
        self.fired_twice = fired_twice
        self.outside_world = outside_world
        """The name of the world the daemon holds, if any (it keeps what it was sent)."""
        self.committed = committed
        self.log_path = log_path
        """The daemon's log file, scrubbed too (None: it logs nowhere the revocation can reach)."""

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {
            p.RevokeRequest: self.records.revoke,
            p.PendingRevocationsRequest: self.records.pending,
            p.RevocationStatusRequest: self.records.status,
            p.BeginRevocationRequest: self.begin,
            p.CommitRevocationRequest: self.commit,
            p.ListRevocationsRequest: self.records.list_all,
            p.CancelRevocationRequest: self.records.cancel,
        }

    # Begin: forget, open the replay branch, hand over the plan ------------------------------------

    def begin(self, req: p.BeginRevocationRequest) -> p.BeginRevocationResponse:
        row = self.records.get(req.revocation_id)
        if row.state not in ("pending", "taken"):
            raise OperationRefused(f"revocation {req.revocation_id} is {row.state}, not pending"
                                   + (f": {row.error}" if row.error else ""), revocation_id=req.revocation_id,
                                   state=row.state)
        try:
            return self._begin(req, row)
        except (SandboxUnavailable, SessionClosed, UnknownSession):
            raise  # the sandbox or the session, not the revocation: it may be taken again
        except SandboxdError as exc:
            # One revocation that cannot be replayed must not stand in front of the others (they are taken
            # oldest first): it fails, with its reason, and the next one is taken.
            self.records.settle(req.revocation_id, "failed", f"{exc.code.value}: {exc.message}")
            log.warning("revocation %s failed: %s", req.revocation_id, exc, extra={"session_id": row.session_id})
            raise

    def _begin(self, req: p.BeginRevocationRequest, row: RevocationRow) -> p.BeginRevocationResponse:
        sid = row.session_id
        with self.sessions.lock(sid):
            self.sessions.check_open(sid)
            checkpoint = self._checkpoint(sid, row.checkpoint_id)
            if row.state == "taken":  # a replay that died with its agent: throw its branch away, start over
                self._abandon(row)
            branch = self.branches.open(sid, "replay", checkpoint)
            if row.state == "pending":
                # Only once the branch is open: a revocation that fails before it forgets nothing.
                assert row.target is not None, f"pending revocation {row.revocation_id} lost its target"
                try:
                    self.forgotten.forget(sid, row.target, row.piece_list())
                except BaseException:
                    self.branches.abandon(branch)
                    raise
            # The suffix may have grown since the event was raised: tau stays, the closure and T do not.
            closure = self.provenance.closure(sid, row.source)
            self.records.update(req.revocation_id, state="taken", branch=branch.id, started_at=time.time(),
                                closure=json.dumps(closure), T=self.provenance.last_step(sid))
        return self._plan(req.request_id, row, branch, closure)

    def _plan(self, request_id: str, row: RevocationRow, branch: Branch,
              closure: list[str]) -> p.BeginRevocationResponse:
        sid, checkpoint = row.session_id, branch.splice
        live = self.provenance.artifacts(sid)
        inputs = [p.ExogenousInput(type=a.type, text=self._sanitized(sid, a)) for a in live
                  if a.type in ("user", "memory") and not a.parents and a.step > checkpoint.step]
        source = next((a for a in live if a.artifact_id == row.source), None)
        if source is None:
            raise NotFound(f"session {sid} has no artifact {row.source!r}", artifact_id=row.source)
        source_call = source.parents[0] if source.type == "observation" and source.parents else None
        recorded = [p.RecordedResult(observation=a.artifact_id, call=a.parents[0], content=self._sanitized(sid, a))
                    for a in self.provenance.artifacts(sid)
                    if a.type == "observation" and a.parents and a.step > checkpoint.step
                    and a.artifact_id != row.source]
        return p.BeginRevocationResponse(
            request_id=request_id, revocation_id=row.revocation_id, branch=branch.id, checkpoint=checkpoint,
            inputs=inputs, source_call=source_call,
            source_result=self._sanitized(sid, source) if source_call else None, recorded=recorded,
            closure=closure)

    def _sanitized(self, sid: str, artifact: p.Artifact) -> str:
        return self.forgotten.sanitize(sid, artifact, self.served_in_daemon(str(artifact.meta.get("tool", ""))))

    # Commit: the branch becomes the session, then erasure -----------------------------------------

    def commit(self, req: p.CommitRevocationRequest) -> p.CommitRevocationResponse:
        row = self.records.get(req.revocation_id)
        found = self.branches.get(row.branch) if row.state == "taken" and row.branch else None
        if found is None or found[1] not in ("open", "committing"):
            raise InvalidState(req.revocation_id, row.state, "replaying")
        branch = found[0]
        with self.sessions.lock(row.session_id):
            effects = self.branches.commit(branch).get("firewall", {})
            scan = self._erase(row, branch)
            report = self._report(row, branch, effects, scan, req)
            self.records.update(req.revocation_id, state="done", report=msgspec.json.encode(report).decode())
        self.committed(row.raised_by)
        log.info("revocation %s committed: %d transitions replayed", req.revocation_id, req.transitions_replayed,
                 extra={"session_id": row.session_id, "request_id": req.request_id})
        return p.CommitRevocationResponse(request_id=req.request_id, report=report)

    def _erase(self, row: RevocationRow, branch: Branch) -> LeakScan:
        """Make forgetting physical, then scan for what is left; each remaining hit carries its reason.

        The target stays in this process's memory only, for the scan: its row loses it first. After a crash
        it is gone: the session's fingerprints still scrub, but nothing can be scanned for."""
        sid, target, pieces = row.session_id, row.target, row.piece_list()
        self.records.update(row.revocation_id, target=None, pieces=None)
        self._settle_others(sid, row.revocation_id)
        # This target's forms only, while it is known: the session's earlier revocations were scrubbed already.
        forget = target_filter(target, pieces, self.forgotten.salt) if target else self.forgotten.filter(sid)
        # The branch carries its splice: the checkpoint is not read again.
        kept = kept_cells(sid, branch.id, branch.splice.created_at)
        plain = target_texts(target, pieces) if target else []
        scrub_database(self.db, forget, sid, kept, plain)
        if self.log_path is not None:
            # A log line is prose: a value too short to be told from it is left in it (see erasure.distinctive).
            scrub_log(self.log_path, ForgetFilter([fp for fp in forget.fingerprints if fp.length >= MIN_NEEDLE_BYTES],
                                                  self.forgotten.salt), plain)
        # Every table: the commit deleted the old suffix's rows across the provenance tables too.
        self.db.purge()
        if target is None:
            return LeakScan(skipped=["the leak scan: the target was lost with the process that held it"])
        # The filter that scrubbed is the one that scans, and its byte forms are made once for every scan.
        needles = byte_needles(target, pieces)
        scan = self.scanner.scan(sid, forget, needles, kept)
        if any(where.startswith(("state.db", "sandboxd.log")) for where in scan.unexplained):
            # secure_delete zeroes deleted cells, yet under concurrent writers a copy has been seen to survive
            # a page rebalance; a full rewrite of the database removes it. Rare, so not always.
            self.db.vacuum()
            scan = self.scanner.scan(sid, forget, needles, kept)
        if any(":image" in where for where in scan.unexplained):
            self.sessions.store.trim(sid)
            scan = self.scanner.scan(sid, forget, needles, kept)
        return scan

    def _settle_others(self, sid: str, done: str) -> None:
        """Pending revocations of the session whose target this one took away (wholly, or its source) fail
        with their reason rather than wait for a replay that can never find what they name."""
        forget = self.forgotten.filter(sid)
        for other in self.db.structs("SELECT * FROM revocations WHERE session_id = ? AND state = 'pending' "
                                     "AND revocation_id != ?", [sid, done], RevocationRow):
            target = forget.text(other.target or "")
            try:
                source = self.provenance.artifact(sid, other.source).content
            except NotFound:
                source = ""
            if target.strip() and target_filter(target, [], self.forgotten.salt).holds(source):
                if target != other.target:
                    self.records.update(other.revocation_id, target=target)
            else:
                self.records.update(other.revocation_id, state="failed", target=None, pieces=None,
                                    error=f"superseded by {done}: its target is forgotten or its source is gone")

    def _report(self, row: RevocationRow, branch: Branch, effects: dict[str, Any], scan: LeakScan,
                req: p.CommitRevocationRequest | None) -> p.RevocationReport:
        orphaned = list(effects.get("orphaned", []))
        counts = dict(req.call_counts) if req else {}
        counts.update(staged=len(effects.get("staged", [])), held=len(effects.get("held", [])),
                      orphaned=len(orphaned), fired_twice=self.fired_twice(row.session_id))
        for key in ("reexecuted", "reused", "shadowed", "deduplicated"):
            counts.setdefault(key, 0)
        leak, remaining = scan.summary(self.forgotten.filter(row.session_id))
        not_erased = [f"external effect {cid} already fired (orphaned: compensate it)" for cid in orphaned]
        not_erased += (req.agent_notes if req else []) + remaining
        if req is None:
            not_erased.append("completed after a daemon restart: the agent's token counts were lost")
        if self.outside_world is not None:
            not_erased.append(f"the outside world ({self.outside_world} environment) still holds whatever it held "
                              "or was sent: the source of an injection keeps it, as a web page would")
        # The notes are the daemon's prose around the places it names (already filtered): a revoked value that
        # a note's wording spells (`checkpoint`) is taken out of it too, as from a log line.
        prose = self.forgotten.prose_filter(row.session_id)
        not_erased = [prose.text(note) for note in not_erased]
        splice, tokens = branch.splice, req.tokens if req else p.TokenCounts()
        return p.RevocationReport(
            revocation_id=row.revocation_id, session=row.session_id, source=row.source, tau=row.tau,
            T=req.final_step if req else self.provenance.last_step(row.session_id), T_original=row.T,
            taint_closure=json.loads(row.closure or "[]"),
            checkpoint={"id": splice.checkpoint_id, "token_offset": splice.token_offset, "step": splice.step,
                        "snapshot_id": splice.snapshot_id},
            tokens=p.TokenCounts(reused_prefix=tokens.reused_prefix, prefilled=tokens.prefilled,
                                 decoded=tokens.decoded, recomputed=tokens.prefilled + tokens.decoded,
                                 full_reset=tokens.full_reset, turns_prefilled=tokens.turns_prefilled),
            transitions_replayed=req.transitions_replayed if req else 0, calls=counts, leak_scan=leak,
            not_erased=not_erased, wall_ms=(time.time() - (row.started_at or time.time())) * 1000,
            answer=req.answer if req else None, raised_by=row.raised_by)

    # Recovery ----------------------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart no operation is left half-done: an open branch is abandoned (its revocation is
        pending again), a committing one is committed, and a committed one's revocation is finished."""
        open_sessions = {row.session_id for row in self.sessions.in_states(("open",))}
        for branch, status in self.branches.unfinished():
            if branch.session_id not in open_sessions:
                continue
            if status == "open":
                self.branches.abandon(branch)
                log.warning("branch %s of %s was open at a crash: abandoned", branch.id, branch.session_id)
            else:
                self.branches.commit(branch)
                log.warning("branch %s of %s was committing at a crash: committed", branch.id, branch.session_id)
        for row in self.records.taken():
            if row.session_id not in open_sessions or row.branch is None:
                continue
            found = self.branches.get(row.branch)
            if found is None or found[1] == "abandoned":
                self.records.update(row.revocation_id, state="pending", branch=None)
                log.warning("revocation %s was replaying at a crash: pending again", row.revocation_id)
            elif found[1] == "live":
                scan = self._erase(row, found[0])
                report = self._report(row, found[0], {}, scan, None)
                self.records.update(row.revocation_id, state="done", report=msgspec.json.encode(report).decode())
                log.warning("revocation %s was committing at a crash: rolled forward", row.revocation_id)

    def _abandon(self, row: RevocationRow) -> None:
        found = self.branches.get(row.branch) if row.branch else None
        if found is not None and found[1] in ("open", "committing"):
            self.branches.abandon(found[0])

    def _checkpoint(self, sid: str, checkpoint_id: str | None) -> p.CheckpointRecord:
        checkpoint = self.provenance.checkpoint(sid, checkpoint_id) if checkpoint_id else None
        if checkpoint is not None:
            return checkpoint
        raise NotFound(f"checkpoint {checkpoint_id} of {sid} is gone", checkpoint_id=checkpoint_id)
