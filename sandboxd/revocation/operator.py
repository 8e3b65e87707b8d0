"""The revocation operator (the paper's Algorithm 1), the daemon's half of it.

1. `Revoke` (operator, client, or the injection detector): locate the source, tau and the taint
   closure; the event waits as `pending` for the agent, which alone holds the model.
2. `BeginRevocation` (the agent takes the event): the target joins the session's forgotten values,
   kept only as a salted fingerprint, so every later tool result has it excised; the sandbox is
   restored to the snapshot of the latest checkpoint before o_tau; a firewall replay branch opens;
   the agent gets the checkpoint's context and the exogenous inputs that follow it, sanitized.
3. The agent replays steps tau..T over ZeroMQ: calls in shadow mode, artifacts under the branch.
4. `CommitRevocation`: the branch becomes the session; the old suffix's artifacts, call records and
   snapshots are deleted; SQLite is vacuumed and its WAL emptied; a byte scan looks for the target
   everywhere the daemon keeps state; the report says what it cost and what could not be erased.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from sandboxd import protocol as p
from sandboxd.errors import InvalidArguments, InvalidState, NotFound, SandboxdError
from sandboxd.firewall.handlers import result_text
from sandboxd.firewall.world import WORLDS
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.detector import InjectionDetector
from sandboxd.revocation.erasure import (
    AGENT_WROTE_IT,
    Exempt,
    LeakScan,
    byte_needles,
    scan_cells,
    scrub_database,
    scrub_log,
    target_filter,
)
from sandboxd.revocation.fingerprint import RevokedFingerprint
from sandboxd.revocation.forgetting import ForgetFilter, fingerprints_for, payload_texts, piece_fingerprints
from sandboxd.revocation.leakscan import scan_paths

if TYPE_CHECKING:
    from sandboxd.service import SandboxService

log = logging.getLogger("sandboxd")

#: artifacts the model writes (as opposed to what it reads)
AGENT_TYPES = ("model_turn", "plan", "tool_call", "reply", "summary")


def load_salt(state_dir: Path) -> bytes:
    """The daemon's secret fingerprint salt, created once (owner-only) and kept with its state."""
    path = state_dir / "forget.salt"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
    return path.read_bytes()


class RevocationOperator:
    """Revocation requests and the fingerprint filter on tool results."""

    def __init__(self, service: SandboxService, provenance: ProvenanceStore, detector: InjectionDetector) -> None:
        self.service = service
        self.state = service.state
        self.provenance = provenance
        self.detector = detector
        self.salt = load_salt(service.config.state_path)
        self._filters: dict[str, ForgetFilter] = {}

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {
            p.RevokeRequest: self.revoke,
            p.PendingRevocationsRequest: self.pending,
            p.BeginRevocationRequest: self.begin,
            p.CommitRevocationRequest: self.commit,
            p.RevocationStatusRequest: self.status,
        }

    # The filter --------------------------------------------------------------------------------

    def forget(self, session_id: str, value: str, pieces: list[str] | None = None) -> None:
        """From now on `value` never reaches this session again, in any form; only fingerprints are stored.

        Every form of the value (as given, decoded, the strings of a structured observation), matched in
        the decoded views of every text and whitespace-folded, so neither an escaped copy nor a tool that
        re-flows it (YAML folding a long string) brings it back. `pieces`: the parts of a value that was
        split across consecutive results, each as it ends or starts a result."""
        try:
            fps = fingerprints_for(value, self.salt) + piece_fingerprints(pieces or [], self.salt)
        except ValueError as exc:
            raise InvalidArguments("revoke", f"nothing to forget: {exc}", "$.target") from exc
        if not fps:
            raise InvalidArguments("revoke", "nothing to forget: the target is empty or only whitespace", "$.target")
        with self.state.transaction() as db:
            db.table("forgotten").insert_all(
                [{"session_id": session_id, "fingerprint": msgspec.json.encode(fp).decode()} for fp in fps])
        self._filters.pop(session_id, None)

    def filter(self, session_id: str) -> ForgetFilter:
        """The session's forgotten values, decoded once and kept until the next `forget`."""
        cached = self._filters.get(session_id)
        if cached is None:
            fps = [msgspec.json.decode(raw, type=RevokedFingerprint) for raw in self.state.fingerprints(session_id)]
            cached = self._filters[session_id] = ForgetFilter(fps, self.salt)
        return cached

    def sanitize(self, session_id: str, artifact: p.Artifact) -> str:
        """A recorded input with every forgotten value of the session excised, as a fresh call would get it:
        the result of a tool served in the daemon was rendered from data, and is filtered as that data."""
        forget = self.filter(session_id)
        if self.service.effects.serves(str(artifact.meta.get("tool", ""))):
            return forget.rendered(artifact.content, result_text)
        return forget.text(artifact.content)

    # Raising events ----------------------------------------------------------------------------

    def revoke(self, req: p.RevokeRequest) -> p.RevokeResponse:
        info, closure, last = self.raise_event(req.session_id, req.source, req.target, "operator")
        return p.RevokeResponse(request_id=req.request_id, revocation=info, taint_closure=closure, T=last)

    def raise_event(self, session_id: str, source: str, target: str | None,
                    raised_by: str) -> tuple[p.RevocationInfo, list[str], int]:
        """Record a pending revocation of `target` (default: all of it) entering through `source`.

        The target may be given in any form the agent saw it in (raw, JSON-escaped, percent-encoded) and
        may run on from the source into the results that follow it (then it is forgotten piece by piece).
        Tau is where it first entered: the earliest observation holding it, if that is before the source."""
        self.service.check_open(session_id)
        tau, last, closure, checkpoint = self.provenance.query(session_id, source)
        content = self.provenance.artifact(session_id, source).content
        whole = target if target is not None else content
        if not whole.strip():
            raise InvalidArguments("revoke", f"nothing to revoke: the {'target' if target is not None else 'source'}"
                                   " is empty or only whitespace", "$.target")
        wanted = target_filter(whole, [], self.salt)
        pieces: list[str] = []
        if not wanted.holds(content):
            pieces = self._split_across(session_id, source, whole)
            if not pieces:
                state = " (was it revoked already?)" if self.filter(session_id).holds(whole) else ""
                raise InvalidArguments("revoke", f"the target does not occur in {source}, nor runs on from it "
                                       f"into the results that follow{state}", "$.target")
        if self._already_pending(session_id, whole):
            raise InvalidState(source, "pending", "not yet revoked", "a revocation of this target is already pending")
        for earlier in self.provenance.observations_before(session_id, tau):
            if wanted.holds(earlier.content):
                tau, checkpoint = earlier.step, self.provenance.checkpoint_before(session_id, earlier.step)
                closure = sorted(set(closure) | set(self.provenance.closure(session_id, earlier.artifact_id)))
                break
        if checkpoint is None:
            raise InvalidState(source, "no checkpoint", "a checkpoint before the source was consumed")
        row = {"revocation_id": "rv-" + uuid.uuid4().hex[:12], "session_id": session_id, "source": source,
               "target": whole, "pieces": json.dumps(pieces) if pieces else None, "fingerprint": None,
               "state": "pending", "raised_by": raised_by, "tau": tau, "T": last,
               "checkpoint_id": checkpoint.checkpoint_id, "branch": None, "closure": json.dumps(closure),
               "report": None, "created_at": time.time(), "started_at": None}
        with self.state.transaction() as db:
            db.table("revocations").insert(row, alter=True)
        self.service.metrics.revocation("raised", raised_by)
        log.info("revocation %s of %s in %s raised by %s", row["revocation_id"], source, session_id, raised_by,
                 extra={"session_id": session_id})
        return _info(row), closure, last

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

    def _already_pending(self, session_id: str, target: str) -> bool:
        rows = self._rows("SELECT target FROM revocations WHERE session_id = ? AND state IN ('pending', 'replaying')",
                          [session_id])
        return any(r["target"] == target for r in rows)

    def on_observation(self, session_id: str, artifact: p.Artifact) -> None:
        """The injection detector's hook: a flagged observation raises its own revocation.

        The detector reads what the observation says, decoded (the strings of a structured result), so a
        finding is text the agent read and never carries serialization syntax with it."""
        for text in payload_texts(artifact.content):
            for finding in self.detector.scan(text):
                found = finding.target(text)
                if found.strip() and not self._already_pending(session_id, found):
                    self.raise_event(session_id, artifact.artifact_id, found, f"detector:{self.detector.name}")

    def flagged(self, session_id: str) -> list[tuple[str, str]]:
        """(source, target) of the session's revocations not yet committed: what flow control blocks."""
        rows = self._rows("SELECT source, target FROM revocations WHERE session_id = ? AND state IN "
                          "('pending', 'replaying') AND target IS NOT NULL", [session_id])
        return [(r["source"], r["target"]) for r in rows]

    def pending(self, req: p.PendingRevocationsRequest) -> p.PendingRevocationsResponse:
        rows = self._rows("SELECT * FROM revocations WHERE session_id = ? AND state IN ('pending', 'replaying') "
                          "ORDER BY created_at", [req.session_id])
        return p.PendingRevocationsResponse(request_id=req.request_id, revocations=[_info(r) for r in rows])

    def status(self, req: p.RevocationStatusRequest) -> p.RevocationStatusResponse:
        row = self._row(req.revocation_id)
        report = msgspec.json.decode(row["report"], type=p.RevocationReport) if row["report"] else None
        return p.RevocationStatusResponse(request_id=req.request_id, revocation=_info(row), report=report)

    # Begin: restore and hand over the replay plan ----------------------------------------------

    def begin(self, req: p.BeginRevocationRequest) -> p.BeginRevocationResponse:
        row = self._row(req.revocation_id)
        if row["state"] not in ("pending", "replaying"):
            raise InvalidState(req.revocation_id, row["state"], "pending")
        sid = row["session_id"]
        checkpoint = self._checkpoint(sid, row["checkpoint_id"])
        with self.service.session_lock(sid):
            self.service.check_open(sid)
            if row["state"] == "replaying":  # a replay that died: throw its branch away and start over
                self._abandon(row)
            self.forget(sid, row["target"], json.loads(row["pieces"]) if row.get("pieces") else None)
            if checkpoint.snapshot_id:
                self.service.restore_snapshot(sid, checkpoint.snapshot_id)
            branch = self.service.firewall.begin_replay(sid, from_turn=checkpoint.turn + 1)
            if self.service.world is not None:
                self.service.world.begin_shadow(sid, branch, checkpoint.checkpoint_id)
            # The suffix may have grown since the event was raised: tau stays, the closure and T do not.
            closure = self.provenance.closure(sid, row["source"])
            with self.state.transaction() as db:
                db.table("revocations").update(req.revocation_id, {
                    "state": "replaying", "branch": branch, "started_at": time.time(),
                    "closure": json.dumps(closure), "T": self.provenance.last_step(sid),
                    "suffix": json.dumps(self.provenance.suffix_bounds(sid))})
            row = self._row(req.revocation_id)
        return self._plan(req.request_id, row, checkpoint, branch)

    def _plan(self, request_id: str, row: dict[str, Any], checkpoint: p.CheckpointRecord,
              branch: str) -> p.BeginRevocationResponse:
        sid = row["session_id"]
        live = {a.artifact_id: a for a in self.provenance.artifacts(sid)}
        context = [live[aid] for aid in checkpoint.manifest]
        inputs = [p.ExogenousInput(type=a.type, text=self.sanitize(sid, a))
                  for a in live.values()
                  if a.type in ("user", "memory") and not a.parents and a.step > checkpoint.step]
        source = live[row["source"]]
        source_call = source.parents[0] if source.type == "observation" and source.parents else None
        return p.BeginRevocationResponse(
            request_id=request_id, revocation_id=row["revocation_id"], branch=branch, checkpoint=checkpoint,
            context=context, inputs=inputs, source_call=source_call,
            source_result=self.sanitize(sid, source) if source_call else None)

    # Commit: the branch becomes the session ----------------------------------------------------

    def commit(self, req: p.CommitRevocationRequest) -> p.CommitRevocationResponse:
        row = self._row(req.revocation_id)
        if row["state"] != "replaying":
            raise InvalidState(req.revocation_id, row["state"], "replaying")
        sid, branch = row["session_id"], row["branch"]
        splice = self._checkpoint(sid, row["checkpoint_id"])
        with self.service.session_lock(sid):
            self._set_state(req.revocation_id, "committing")  # from here a restart rolls forward
            effects = self._commit_steps(sid, branch, splice, json.loads(row["suffix"]))
            scan = self._erase(row, req.engine_context)
            report = self._report(row, req, splice, effects, scan)
            with self.state.transaction() as db:
                db.table("revocations").update(req.revocation_id, {
                    "state": "done", "report": msgspec.json.encode(report).decode()})
        self.service.metrics.revocation("committed", row["raised_by"])
        log.info("revocation %s committed: %d transitions replayed", req.revocation_id, req.transitions_replayed,
                 extra={"session_id": sid, "request_id": req.request_id})
        return p.CommitRevocationResponse(request_id=req.request_id, report=report)

    def _erase(self, row: dict[str, Any], engine_context: str) -> LeakScan:
        """Make forgetting physical, then scan for what is left; each remaining hit carries its reason.

        The target stays in this process's memory only, for the scan: the row loses it first."""
        sid, target = row["session_id"], row["target"]
        pieces = json.loads(row["pieces"]) if row.get("pieces") else []
        with self.state.transaction() as db:
            db.table("revocations").update(row["revocation_id"], {"state": "committed", "target": None,
                                                                  "pieces": None})
        self._settle_other_revocations(sid, row["revocation_id"])
        # This target's forms only: the session's earlier revocations were scrubbed when they committed.
        forget = target_filter(target, pieces, self.salt)
        scrub_database(self.state.conn, self.state.lock, forget, sid, self._replayed_by_agent(row))
        scrub_log(self.service.config.state_path / "sandboxd.log", forget)
        self.state.purge()
        scan = self._leak_scan(sid, target, pieces, engine_context, row)
        if any(where.startswith(("state.db", "sandboxd.log")) for where in scan.unexplained):
            # secure_delete zeroes deleted cells, yet under concurrent writers a copy has been seen to
            # survive a page rebalance; a full rewrite of the database removes it. Rare, so not always.
            self.state.vacuum()
            scan = self._leak_scan(sid, target, pieces, engine_context, row)
        if any(":image" in where for where in scan.unexplained):
            self.service.store.trim(sid)
            scan = self._leak_scan(sid, target, pieces, engine_context, row)
        return scan

    def _settle_other_revocations(self, sid: str, done: str) -> None:
        """Pending revocations of the session whose target this one took away (wholly, or its source) fail
        with their reason rather than wait for a replay that can never find what they name."""
        forget = self.filter(sid)
        for other in self._rows("SELECT * FROM revocations WHERE session_id = ? AND state = 'pending' "
                                "AND revocation_id != ?", [sid, done]):
            target = forget.text(other["target"] or "")
            try:
                source = self.provenance.artifact(sid, other["source"]).content
            except NotFound:
                source = ""
            update: dict[str, str | None] = {}
            if target.strip() and target_filter(target, [], self.salt).holds(source):
                update = {"target": target} if target != other["target"] else {}
            else:
                update = {"state": "failed", "target": None, "pieces": None,
                          "error": f"superseded by {done}: its target is forgotten or its source is gone"}
            if update:
                with self.state.transaction() as db:
                    db.table("revocations").update(other["revocation_id"], update, alter=True)

    def _commit_steps(self, sid: str, branch: str, splice: p.CheckpointRecord, old_end: list[int]) -> Any:
        """The branch becomes the session. Each step is safe to repeat after a crash part-way through."""
        effects: Any
        try:
            effects = self.service.firewall.finish_replay(branch, commit=True)
        except SandboxdError:  # finished before a crash: its report is gone, its effect is not
            effects = _NO_EFFECTS
        self.provenance.commit_branch(sid, branch, splice, (old_end[0], old_end[1]))
        if self.service.world is not None:
            self.service.world.end_shadow(sid, branch, commit=True)
        self._drop_old_calls(sid, branch, splice)
        self.service.drop_unreferenced_checkpoint_snapshots(sid, self.provenance.checkpoints(sid))
        self.service.store.trim(sid)  # the old suffix's files must not survive in free blocks either
        return effects

    def _set_state(self, revocation_id: str, state: str) -> None:
        with self.state.transaction() as db:
            db.table("revocations").update(revocation_id, {"state": state})

    # Recovery ----------------------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart no revocation is left half-replayed: roll back a replay, roll a commit forward."""
        for row in self._rows("SELECT * FROM revocations WHERE state IN ('replaying', 'committing')", []):
            if self.state.session(row["session_id"]) is None or not self._is_open(row["session_id"]):
                continue
            if row["state"] == "replaying":
                self._roll_back(row)
            else:
                self._roll_forward(row)

    def _is_open(self, sid: str) -> bool:
        session = self.state.session(sid)
        return session is not None and session["state"] == "open"

    def _roll_back(self, row: dict[str, Any]) -> None:
        """The replay died with its agent: drop its branch, put the sandbox back, wait for the agent again."""
        sid = row["session_id"]
        self._abandon(row)
        live = self.provenance.checkpoints(sid)
        if live and live[-1].snapshot_id:
            self.service.restore_snapshot(sid, live[-1].snapshot_id)
        with self.state.transaction() as db:
            db.table("revocations").update(row["revocation_id"], {"state": "pending", "branch": None})
        log.warning("revocation %s was replaying at a crash: rolled back, pending again", row["revocation_id"])

    def _roll_forward(self, row: dict[str, Any]) -> None:
        sid = row["session_id"]
        self._commit_steps(sid, row["branch"], self._checkpoint(sid, row["checkpoint_id"]), json.loads(row["suffix"]))
        if row["target"] is not None:
            self._erase(row, "")
        note = "completed after a daemon restart: the agent's token counts and the leak scan were lost"
        report = p.RevocationReport(
            revocation_id=row["revocation_id"], session=sid, source=row["source"], tau=row["tau"],
            T=self.provenance.last_step(sid), T_original=row["T"], taint_closure=json.loads(row["closure"]),
            checkpoint={"id": row["checkpoint_id"]}, tokens=p.TokenCounts(), transitions_replayed=0, calls={},
            leak_scan={}, not_erased=[note], wall_ms=0.0, raised_by=row["raised_by"])
        with self.state.transaction() as db:
            db.table("revocations").update(row["revocation_id"], {
                "state": "done", "target": None, "report": msgspec.json.encode(report).decode()})
        self.state.purge()
        log.warning("revocation %s was committing at a crash: rolled forward", row["revocation_id"])

    def _drop_old_calls(self, sid: str, branch: str, splice: p.CheckpointRecord) -> None:
        """Sandbox call records of the old suffix go; the branch's become the session's."""
        with self.state.transaction():
            self.state.conn.execute("DELETE FROM calls WHERE session_id = ? AND branch = '' AND created_at > ?",
                                    [sid, splice.created_at])
            self.state.conn.execute("UPDATE calls SET branch = '' WHERE session_id = ? AND branch = ?", [sid, branch])

    def _abandon(self, row: dict[str, Any]) -> None:
        try:
            self.service.firewall.finish_replay(row["branch"], commit=False)
        except SandboxdError:
            pass  # already closed before a crash
        self.provenance.abandon_branch(row["session_id"], row["branch"])
        if self.service.world is not None:
            self.service.world.end_shadow(row["session_id"], row["branch"], commit=False)
        with self.state.transaction():
            self.state.conn.execute("DELETE FROM calls WHERE session_id = ? AND branch = ?",
                                    [row["session_id"], row["branch"]])

    def _replayed_by_agent(self, row: dict[str, Any]) -> Exempt:
        """Cells the agent wrote itself after the splice (its turns, plans, replies, summaries and the
        arguments of its calls): the replay decoded them from a context without the target, so if they
        hold it, the counterfactual agent wrote it too. Rewriting them would make the record something no
        run of the agent produced; the scan reports them instead."""
        sid = row["session_id"]
        since = self._checkpoint(sid, row["checkpoint_id"]).created_at

        def exempt(table: str, column: str, cells: dict[str, Any]) -> bool:
            if cells.get("session_id") != sid:
                return False
            if table == "prov_artifacts":
                return column in ("content", "meta") and cells.get("type") in AGENT_TYPES
            if table in ("calls", "ledger_calls"):
                return column in ("args", "intent") and (cells.get("created_at") or 0.0) > since
            return False

        return exempt

    def _leak_scan(self, sid: str, target: str, pieces: list[str], engine_context: str,
                   row: dict[str, Any]) -> LeakScan:
        """Search every place the daemon keeps state, the session's sandbox and the agent's context.

        By meaning: every text cell of the database, and the agent's context, read through the filter's
        decoded views. By bytes: every file under the state directory (the database with its WAL, logs)
        and the session's snapshot store, and the container's scratch space, for every byte form of every
        form of the target. A hit in the sandbox's own files is the environment the counterfactual world
        holds too; a hit in the disk image's raw bytes is that only when some file holds it."""
        wanted = target_filter(target, pieces, self.salt)
        needles = byte_needles(target, pieces)
        state = self.service.config.state_path
        exempt = self._replayed_by_agent(row)
        scan = scan_cells(self.state.conn, self.state.lock, wanted, sid, exempt)
        shared = [path for path in state.iterdir() if path.name not in ("snapshots", WORLDS)]
        db_hits = scan_paths(needles, shared).hits
        if any(Path(h.location).name.startswith("state.db") for h in db_hits) and not scan.found:
            # Bytes in the database that no cell of this session explains: another session's rows, or pages
            # a vacuum has not rewritten yet. Only now is every session's record read to tell which.
            others = scan_cells(self.state.conn, self.state.lock, wanted, sid, exempt, everyone=True)
            scan.found += [(where, reason) for where, reason in others.found if reason.startswith("another")]
        explained = [reason for _, reason in scan.found if reason]
        db_reason = explained[0] if explained and not scan.unexplained else ""
        for hit in db_hits:
            name = Path(hit.location).relative_to(state).as_posix()
            scan.add(f"{name}@{hit.offset}", db_reason if name.startswith("state.db") else "")
        scan.locations_checked += len(shared)
        files = [path for path in self.service.store.paths(sid) if path.is_dir()]
        live = scan_paths(needles, files)
        scan.extend(live, "sandbox:", "the sandbox's files as the replay left them, snapshot layers kept for "
                    "checkpoints before tau included: the counterfactual world holds them too", str(state) + "/")
        for image in (path for path in self.service.store.paths(sid) if path.is_file()):
            raw = scan_paths(needles, [image])
            scan.extend(raw, "sandbox:image:", "blocks of the disk image holding the sandbox files above"
                        if live.hits else "", str(state) + "/")
        container = self.service.containers.container(sid)
        pid = container.attrs.get("State", {}).get("Pid") if container is not None else None
        if pid:
            # What only the container holds is its tmpfs, read through its root as the host sees it.
            root = Path(f"/proc/{pid}/root")
            scratch = scan_paths(needles, [root / "tmp", root / "dev" / "shm"])
            scan.extend(scratch, "container:", "the sandbox's scratch space as the replay left it: the "
                        "counterfactual world holds it too", str(root))
        scan.locations_checked += 1
        if engine_context and wanted.holds(engine_context):
            wrote = any(reason == AGENT_WROTE_IT for _, reason in scan.found)
            scan.add("agent:engine-context", AGENT_WROTE_IT if wrote else "")
        return scan

    def _report(self, row: dict[str, Any], req: p.CommitRevocationRequest, splice: p.CheckpointRecord,
                effects: Any, scan: LeakScan) -> p.RevocationReport:
        tokens = req.tokens
        counts = dict(req.call_counts)
        counts.update(staged=len(effects.staged), held=len(effects.held), orphaned=len(effects.orphaned),
                      fired_twice=self.service.firewall.ledger.fired_twice(row["session_id"]))
        for key in ("reexecuted", "reused", "shadowed", "deduplicated"):
            counts.setdefault(key, 0)
        not_erased = [f"external effect {cid} already fired (orphaned: compensate it)" for cid in effects.orphaned]
        not_erased += req.agent_notes
        # A location may name a file whose name is the target: the report must not carry it either.
        forget = self.filter(row["session_id"])
        found = [(forget.text(where), reason) for where, reason in scan.found]
        not_erased += _grouped(found)
        if self.service.world is not None:
            not_erased.append(f"the outside world ({self.service.world.name} environment) still holds whatever it "
                              "held or was sent: the source of an injection keeps it, as a web page would")
        environment = [w for w, r in found if w.startswith(("sandbox:", "container:")) and r]
        counterfactual = environment + [w for w, r in found if r == AGENT_WROTE_IT]
        leaks = [w for w, r in found if not r]
        leak = {"locations_checked": scan.locations_checked, "hits": len(leaks), "where": leaks,
                "counterfactual_hits": len(counterfactual), "counterfactual_where": counterfactual,
                "environment_hits": len(environment), "environment_where": environment,
                "other_sessions": sum(1 for _, r in found if r.startswith("another session"))}
        return p.RevocationReport(
            revocation_id=row["revocation_id"], session=row["session_id"], source=row["source"], tau=row["tau"],
            T=req.final_step, T_original=row["T"], taint_closure=json.loads(row["closure"]),
            checkpoint={"id": splice.checkpoint_id, "token_offset": splice.token_offset, "step": splice.step,
                        "snapshot_id": splice.snapshot_id},
            tokens=p.TokenCounts(reused_prefix=tokens.reused_prefix, prefilled=tokens.prefilled,
                                 decoded=tokens.decoded, recomputed=tokens.prefilled + tokens.decoded,
                                 full_reset=tokens.full_reset),
            transitions_replayed=req.transitions_replayed, calls=counts, leak_scan=leak, not_erased=not_erased,
            wall_ms=(time.time() - (row["started_at"] or time.time())) * 1000, answer=req.answer,
            raised_by=row["raised_by"])

    # Rows --------------------------------------------------------------------------------------

    def _rows(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        with self.state.lock:
            cursor = self.state.conn.execute(sql, params)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]

    def _row(self, revocation_id: str) -> dict[str, Any]:
        rows = self._rows("SELECT * FROM revocations WHERE revocation_id = ?", [revocation_id])
        if not rows:
            raise NotFound(f"no revocation {revocation_id!r}", revocation_id=revocation_id)
        return rows[0]

    def _checkpoint(self, sid: str, checkpoint_id: str) -> p.CheckpointRecord:
        for checkpoint in self.provenance.checkpoints(sid):
            if checkpoint.checkpoint_id == checkpoint_id:
                return checkpoint
        raise NotFound(f"checkpoint {checkpoint_id} of {sid} is gone", checkpoint_id=checkpoint_id)


class _NoEffects(msgspec.Struct):
    orphaned: list[str] = []
    staged: list[str] = []
    held: list[str] = []


_NO_EFFECTS = _NoEffects()


def _grouped(found: list[tuple[str, str]]) -> list[str]:
    """One line per place (a file, a table column) and reason: how many hits, where, and why they stay."""
    places: dict[tuple[str, str], int] = {}
    for where, reason in found:
        place = where.rsplit("@", 1)[0] if "@" in where else where.split("[", 1)[0]
        places[place, reason] = places.get((place, reason), 0) + 1
    return [f"{place} ({count} {'hit' if count == 1 else 'hits'}): "
            f"{reason or 'still holds it after erasure; the cause is not known'}"
            for (place, reason), count in places.items()]


def _info(row: dict[str, Any]) -> p.RevocationInfo:
    return p.RevocationInfo(revocation_id=row["revocation_id"], session_id=row["session_id"], source=row["source"],
                            state=row["state"], raised_by=row["raised_by"], tau=row["tau"],
                            checkpoint_id=row["checkpoint_id"])
