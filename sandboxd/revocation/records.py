"""Revocation events: raised (by an operator, a client or the injection detector), listed, looked up.

A revocation `(z, s)` names a target and the source artifact it entered through. Raising one locates
where it first entered (tau), its taint closure and the checkpoint to splice at, and records it as
`pending` for the agent, which alone holds the model (`sandboxd.revocation.operator` takes it from
there). The `revocations` table holds it; its `state` is pending, taken (a branch replays it), done,
failed or cancelled, and while it is taken the state shown is its branch's (replaying, committing).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branches
from sandboxd.db import Database
from sandboxd.errors import InvalidArguments, NotFound, OperationRefused
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.detector import InjectionDetector
from sandboxd.revocation.erasure import target_filter
from sandboxd.revocation.forgetting import detected_targets, payload_texts
from sandboxd.revocation.forgotten import Forgotten

log = logging.getLogger("sandboxd")

#: states in which a revocation still waits to be forgotten (flow control blocks its target meanwhile)
WAITING = ("pending", "taken")


class RevocationRow(msgspec.Struct, kw_only=True):
    revocation_id: str
    session_id: str
    source: str
    state: str
    raised_by: str
    tau: int
    T: int
    checkpoint_id: str | None = None
    target: str | None = None
    """The value to forget, kept only until the revocation commits (then only fingerprints remain)."""
    pieces: str | None = None
    """JSON list: the pieces of a target split across consecutive results."""
    branch: str | None = None
    closure: str | None = None
    report: str | None = None
    error: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    fingerprint: str | None = None
    suffix: str | None = None

    def piece_list(self) -> list[str]:
        return json.loads(self.pieces) if self.pieces else []


class Revocations:
    """The `revocations` table and the requests that raise and read it."""

    def __init__(self, db: Database, provenance: ProvenanceStore, branches: Branches, forgotten: Forgotten,
                 detector: InjectionDetector, check_open: Callable[[str], object],
                 raised: Callable[[str, str, str], None], known: Callable[[str], object] = lambda _sid: None) -> None:
        self.db = db
        self.provenance = provenance
        self.branches = branches
        self.forgotten = forgotten
        self.detector = detector
        self.check_open = check_open
        self.known = known
        self.raised = raised
        """(session, revocation id, raised by): tell whoever waits for the session's events (and count it)."""

    def revoke(self, req: p.RevokeRequest) -> p.RevokeResponse:
        info, closure, last = self.raise_event(req.session_id, req.source, req.target, "operator")
        return p.RevokeResponse(request_id=req.request_id, revocation=info, taint_closure=closure, T=last)

    def raise_event(self, session_id: str, source: str, target: str | None,
                    raised_by: str) -> tuple[p.RevocationInfo, list[str], int]:
        """Record a pending revocation of `target` (default: all of it) entering through `source`.

        The target may be given in any form the agent saw it in (raw, JSON-escaped, percent-encoded) and
        may run on from the source into the results that follow it (then it is forgotten piece by piece).
        Tau is where it first entered: the earliest observation holding it, if that is before the source."""
        self.check_open(session_id)
        source_artifact = self.provenance.artifact(session_id, source)
        tau, last, closure, checkpoint = self.provenance.locate(session_id, source_artifact)
        content = source_artifact.content
        whole = target if target is not None else content
        if not whole.strip():
            raise InvalidArguments("revoke", f"nothing to revoke: the {'target' if target is not None else 'source'}"
                                   " is empty or only whitespace", "$.target")
        try:
            wanted = target_filter(whole, [], self.forgotten.salt)
        except ValueError as exc:
            raise InvalidArguments("revoke", f"nothing to revoke: {exc}", "$.target") from exc
        pieces: list[str] = []
        if not wanted.holds(content):
            pieces = self._split_across(session_id, source, whole)
            if not pieces:
                state = " (was it revoked already?)" if self.forgotten.filter(session_id).holds(whole) else ""
                raise InvalidArguments("revoke", f"the target does not occur in {source}, nor runs on from it "
                                       f"into the results that follow{state}", "$.target")
        self._refuse_repeat(session_id, source, target, whole)
        for earlier in self.provenance.observations_before(session_id, tau):
            if wanted.holds(earlier.content):
                tau, checkpoint = earlier.step, self.provenance.checkpoint_before(session_id, earlier.step)
                closure = sorted(set(closure) | set(self.provenance.closure(session_id, earlier.artifact_id)))
                break
        if checkpoint is None:
            raise OperationRefused(f"{source} entered before the session's first checkpoint: there is no point to "
                                   "splice at", source=source)
        row = RevocationRow(revocation_id="rv-" + uuid.uuid4().hex[:12], session_id=session_id, source=source,
                            target=whole, pieces=json.dumps(pieces) if pieces else None, state="pending",
                            raised_by=raised_by, tau=tau, T=last, checkpoint_id=checkpoint.checkpoint_id,
                            closure=json.dumps(closure), created_at=time.time())
        with self.db.transaction():
            self.db.insert("revocations", row)
        log.info("revocation %s of %s in %s raised by %s", row.revocation_id, source, session_id, raised_by,
                 extra={"session_id": session_id})
        self.raised(session_id, row.revocation_id, raised_by)
        return self.info(row), closure, last

    def _refuse_repeat(self, session_id: str, source: str, target: str | None, whole: str) -> None:
        """Refuse, when it is raised, a revocation that could only fail or repeat one already made: a target
        already pending, one already forgotten, a source already revoked (one that cannot be fingerprinted
        was refused before)."""
        for row in self._of(session_id, WAITING):
            if row.target == whole or (target is None and row.source == source):
                raise OperationRefused(f"{row.revocation_id} already revokes this {'target' if target else 'source'} "
                                       f"and is {row.state}: cancel it first (sandboxd revocation cancel "
                                       f"{row.revocation_id}) to raise it again", revocation_id=row.revocation_id)
        if target is not None and self.forgotten.filter(session_id).holds(target):
            raise OperationRefused("this target was revoked already: the session has forgotten it", source=source)
        if target is None:
            done = self.db.value("SELECT revocation_id FROM revocations WHERE session_id = ? AND source = ? AND "
                                 "state = 'done' ORDER BY created_at DESC", [session_id, source])
            if done is not None:
                raise OperationRefused(f"{source} was revoked already by {done}: name a --target to forget something "
                                       "else it holds", source=source, revocation_id=str(done))

    def list_all(self, req: p.ListRevocationsRequest) -> p.ListRevocationsResponse:
        """Every revocation of a session, or of every session, oldest first, with its state."""
        if req.session_id is None:
            rows = self.db.structs("SELECT * FROM revocations ORDER BY created_at", [], RevocationRow)
        else:
            self.known(req.session_id)
            rows = self.db.structs("SELECT * FROM revocations WHERE session_id = ? ORDER BY created_at",
                                   [req.session_id], RevocationRow)
        return p.ListRevocationsResponse(request_id=req.request_id, revocations=[self.info(r) for r in rows])

    def cancel(self, req: p.CancelRevocationRequest) -> p.CancelRevocationResponse:
        """Cancel a pending revocation: its target is dropped from the record, nothing is forgotten."""
        row = self.get(req.revocation_id)
        if row.state != "pending":
            why = {"taken": "an agent is replaying it now: it commits or, if the agent dies, is pending again",
                   "done": "it is done: what it forgot stays forgotten",
                   "failed": f"it failed already ({row.error})", "cancelled": "it was cancelled already"}
            raise OperationRefused(f"revocation {row.revocation_id} cannot be cancelled: "
                                   f"{why.get(row.state, row.state)}", revocation_id=row.revocation_id,
                                   state=row.state)
        reason = f"cancelled by an operator: {req.reason}" if req.reason else "cancelled by an operator"
        self.settle(row.revocation_id, "cancelled", reason)
        log.info("revocation %s of %s cancelled", row.revocation_id, row.session_id,
                 extra={"session_id": row.session_id})
        return p.CancelRevocationResponse(request_id=req.request_id, revocation=self.info(self.get(row.revocation_id)))

    def settle(self, revocation_id: str, state: str, reason: str) -> None:
        """End a revocation as failed or cancelled, with its reason; its target leaves the record for good."""
        with self.db.transaction():
            self.db.update("revocations", {"revocation_id": revocation_id}, state=state, error=reason, target=None,
                           pieces=None)
        self.db.purge(["revocations"])

    def rolled_back(self, session_id: str, branch: str, gone: Callable[[RevocationRow], bool]) -> list[str]:
        """Pending revocations whose source (or splice point) a rollback removed are cancelled; returns them."""
        cancelled = []
        for row in self._of(session_id, ("pending",)):
            if gone(row):
                self.settle(row.revocation_id, "cancelled", f"cancelled by rollback {branch}: its source or its "
                            "splice point was rolled back, so nothing is left for it to forget")
                cancelled.append(row.revocation_id)
        return cancelled

    def _split_across(self, session_id: str, source: str, target: str, most: int = 4) -> list[str]:
        """The pieces of `target` if it starts in the source's last text and runs on through the texts of
        the observations that follow it (at most `most` of them); else []."""
        following = self.provenance.observations_from(session_id, source)[:most]
        texts = [payload_texts(a.content) for a in following]
        if not texts:
            return []
        parts = [texts[0][-1]] + [" ".join(t) for t in texts[1:-1]] + ([texts[-1][0]] if len(texts) > 1 else [])
        joined = "".join(parts)
        bounds = [sum(len(x) for x in parts[:i + 1]) for i in range(len(parts))]
        at = joined.find(target)
        while at != -1:
            end = at + len(target)
            if at < bounds[0] < end:  # it starts in the source and leaves it
                cuts = [at, *[b for b in bounds if at < b < end], end]
                return [joined[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
            at = joined.find(target, at + 1)
        return []

    def waiting(self, session_id: str, target: str) -> bool:
        """Whether a revocation of exactly this target waits for the session already."""
        return any(row.target == target for row in self._of(session_id, WAITING))

    def on_observation(self, session_id: str, artifact: p.Artifact) -> None:
        """The injection detector's hook: a flagged observation raises its own revocation."""
        for found in detected_targets(self.detector, artifact.content):
            if not self.waiting(session_id, found):
                self.raise_event(session_id, artifact.artifact_id, found, f"detector:{self.detector.name}")

    def flagged(self, session_id: str) -> list[tuple[str, str]]:
        """(source, target) of the session's revocations not yet committed: what flow control blocks."""
        return [(row.source, row.target) for row in self._of(session_id, WAITING) if row.target is not None]

    def pending(self, req: p.PendingRevocationsRequest) -> p.PendingRevocationsResponse:
        rows = self._of(req.session_id, WAITING)
        return p.PendingRevocationsResponse(request_id=req.request_id, revocations=[self.info(r) for r in rows])

    def status(self, req: p.RevocationStatusRequest) -> p.RevocationStatusResponse:
        row = self.get(req.revocation_id)
        report = msgspec.json.decode(row.report, type=p.RevocationReport) if row.report else None
        return p.RevocationStatusResponse(request_id=req.request_id, revocation=self.info(row), report=report)

    # Rows --------------------------------------------------------------------------------------

    def get(self, revocation_id: str) -> RevocationRow:
        row = self.db.struct("SELECT * FROM revocations WHERE revocation_id = ?", [revocation_id], RevocationRow)
        if row is None:
            raise NotFound(f"no revocation {revocation_id!r}", revocation_id=revocation_id)
        return row

    def session_of(self, revocation_id: str) -> str | None:
        """The session a revocation belongs to, if it exists."""
        value = self.db.value("SELECT session_id FROM revocations WHERE revocation_id = ?", [revocation_id])
        return None if value is None else str(value)

    def _of(self, session_id: str, states: tuple[str, ...]) -> list[RevocationRow]:
        marks = ",".join("?" for _ in states)
        return self.db.structs(f"SELECT * FROM revocations WHERE session_id = ? AND state IN ({marks}) "
                               "ORDER BY created_at", [session_id, *states], RevocationRow)

    def taken(self) -> list[RevocationRow]:
        return self.db.structs("SELECT * FROM revocations WHERE state = 'taken' ORDER BY created_at", [],
                               RevocationRow)

    def update(self, revocation_id: str, **fields: object) -> None:
        with self.db.transaction():
            self.db.update("revocations", {"revocation_id": revocation_id}, **fields)

    def info(self, row: RevocationRow) -> p.RevocationInfo:
        state = row.state
        if state == "taken" and row.branch is not None:
            found = self.branches.get(row.branch)
            status = found[1] if found else "open"
            state = {"open": "replaying", "committing": "committing"}.get(status, "committing")
        return p.RevocationInfo(revocation_id=row.revocation_id, session_id=row.session_id, source=row.source,
                                state=state, raised_by=row.raised_by, tau=row.tau, checkpoint_id=row.checkpoint_id,
                                branch=row.branch, error=row.error, created_at=row.created_at)
