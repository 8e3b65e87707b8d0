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
from sandboxd.firewall.world import WORLDS
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.revocation.detector import InjectionDetector
from sandboxd.revocation.fingerprint import RevokedFingerprint, excise, fingerprint
from sandboxd.revocation.leakscan import needles_for, scan_paths

if TYPE_CHECKING:
    from sandboxd.service import SandboxService

log = logging.getLogger("sandboxd")


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

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {
            p.RevokeRequest: self.revoke,
            p.PendingRevocationsRequest: self.pending,
            p.BeginRevocationRequest: self.begin,
            p.CommitRevocationRequest: self.commit,
            p.RevocationStatusRequest: self.status,
        }

    # The filter --------------------------------------------------------------------------------

    def forget(self, session_id: str, value: str) -> None:
        """From now on `value` never reaches this session again; only its fingerprint is stored.

        Whitespace-folded: a tool that re-flows the value (YAML folds and indents a long string in a
        list) must not bring it back."""
        fp = fingerprint(value, self.salt, spacefold=True)
        self.state.add_fingerprint(session_id, msgspec.json.encode(fp).decode())

    def sanitize(self, session_id: str, text: str) -> str:
        """`text` with every forgotten value of the session excised."""
        fps = [msgspec.json.decode(raw, type=RevokedFingerprint) for raw in self.state.fingerprints(session_id)]
        return excise(text, fps, self.salt)[0] if fps and text else text

    # Raising events ----------------------------------------------------------------------------

    def revoke(self, req: p.RevokeRequest) -> p.RevokeResponse:
        info, closure, last = self.raise_event(req.session_id, req.source, req.target, "operator")
        return p.RevokeResponse(request_id=req.request_id, revocation=info, taint_closure=closure, T=last)

    def raise_event(self, session_id: str, source: str, target: str | None,
                    raised_by: str) -> tuple[p.RevocationInfo, list[str], int]:
        """Record a pending revocation of `target` (default: all of it) entering through `source`."""
        self.service.check_open(session_id)
        tau, last, closure, checkpoint = self.provenance.query(session_id, source)
        content = self.provenance.artifact(session_id, source).content
        if target is not None and (not target or target not in content):
            raise InvalidArguments("revoke", f"the target does not occur in {source}", "$.target")
        if checkpoint is None:
            raise InvalidState(source, "no checkpoint", "a checkpoint before the source was consumed")
        row = {"revocation_id": "rv-" + uuid.uuid4().hex[:12], "session_id": session_id, "source": source,
               "target": target if target is not None else content, "fingerprint": None, "state": "pending",
               "raised_by": raised_by, "tau": tau, "T": last, "checkpoint_id": checkpoint.checkpoint_id,
               "branch": None, "closure": json.dumps(closure), "report": None, "created_at": time.time(),
               "started_at": None}
        with self.state.transaction() as db:
            db.table("revocations").insert(row)
        self.service.metrics.revocation("raised", raised_by)
        log.info("revocation %s of %s in %s raised by %s", row["revocation_id"], source, session_id, raised_by,
                 extra={"session_id": session_id})
        return _info(row), closure, last

    def on_observation(self, session_id: str, artifact: p.Artifact) -> None:
        """The injection detector's hook: a flagged observation raises its own revocation."""
        for finding in self.detector.scan(artifact.content):
            self.raise_event(session_id, artifact.artifact_id, finding.target(artifact.content),
                             f"detector:{self.detector.name}")

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
            self.forget(sid, row["target"])
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
        inputs = [p.ExogenousInput(type=a.type, text=self.sanitize(sid, a.content))
                  for a in live.values()
                  if a.type in ("user", "memory") and not a.parents and a.step > checkpoint.step]
        source = live[row["source"]]
        source_call = source.parents[0] if source.type == "observation" and source.parents else None
        return p.BeginRevocationResponse(
            request_id=request_id, revocation_id=row["revocation_id"], branch=branch, checkpoint=checkpoint,
            context=context, inputs=inputs, source_call=source_call,
            source_result=self.sanitize(sid, source.content) if source_call else None)

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
            with self.state.transaction() as db:
                # From here on the target exists only in this process's memory, for the scan below.
                db.table("revocations").update(req.revocation_id, {"state": "committed", "target": None})
            self.state.purge()
            leak = self._leak_scan(sid, row["target"], req)
            if any(".db" in where for where in leak["where"]):
                # secure_delete zeroes deleted cells, yet under concurrent writers a copy has been seen to
                # survive a page rebalance; a full rewrite of the database removes it. Rare, so not always.
                self.state.vacuum()
                leak = self._leak_scan(sid, row["target"], req)
            report = self._report(row, req, splice, effects, leak)
            with self.state.transaction() as db:
                db.table("revocations").update(req.revocation_id, {
                    "state": "done", "report": msgspec.json.encode(report).decode()})
        self.service.metrics.revocation("committed", row["raised_by"])
        log.info("revocation %s committed: %d transitions replayed", req.revocation_id, req.transitions_replayed,
                 extra={"session_id": sid, "request_id": req.request_id})
        return p.CommitRevocationResponse(request_id=req.request_id, report=report)

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
        self._scrub_calls(sid)
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

    def _scrub_calls(self, sid: str) -> None:
        """Excise forgotten values from the call records that remain (the source's own call among them)."""
        for row in self.state.calls(sid):
            args, result = self._scrub_json(sid, row["args"]), self._scrub_json(sid, row["result"])
            if (args, result) != (row["args"], row["result"]):
                with self.state.transaction() as db:
                    db.table("calls").update((sid, row["call_id"]), {"args": args, "result": result})

    def _scrub_json(self, sid: str, text: str | None) -> str | None:
        if not text:
            return text
        value = json.loads(text)
        clean = _map_strings(value, lambda s: self.sanitize(sid, s))
        return text if clean == value else json.dumps(clean, sort_keys=True, separators=(",", ":"))

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

    def _leak_scan(self, sid: str, target: str, req: p.CommitRevocationRequest) -> dict[str, Any]:
        """Byte-scan everything the daemon keeps, the session's container, and the agent's context.

        Hits inside the sandbox's own files (workspace, snapshot layers, container) are counted apart:
        a value the environment held before tau is held by the counterfactual world too, and a replay
        does not rewrite the environment. Everything else must be clean.
        """
        needles = needles_for(target)
        state = self.service.config.state_path
        # What the daemon keeps for everyone (SQLite, WAL, logs) and this session's own snapshot store.
        # Other sessions' sandboxes are theirs: the same bytes there are not this session's leak.
        # The world's environments are the outside world (a bank, a web page): they keep what they were
        # sent or hold, as the far side of any effect does; the report lists them in not_erased.
        shared = [path for path in state.iterdir() if path.name not in ("snapshots", WORLDS)]
        report = scan_paths(needles, [*shared, *self.service.store.paths(sid)])
        environment = str(state / "snapshots")
        hits = [f"{h.location}@{h.offset}" for h in report.hits if not h.location.startswith(environment)]
        env_hits = [f"{h.location}@{h.offset}" for h in report.hits if h.location.startswith(environment)]
        checked = report.locations_checked
        # The workspace and the control dir are host binds, scanned above, and the root filesystem is
        # read-only: what only the container holds is its scratch tmpfs (read as its runtime allows).
        inside = self.service.containers.scan_scratch(sid, needles)
        checked += inside.locations_checked
        hits += [f"container:{h.location}@{h.offset}" for h in inside.hits]
        # The agent's engine cache and working memory, as the context text it holds after the replay.
        checked += 1
        if any(n.decode("utf-8", "ignore") in req.engine_context for n in needles[:1]):
            hits.append("agent:engine-context")
        return {"locations_checked": checked, "hits": len(hits), "where": hits[:20],
                "environment_hits": len(env_hits), "environment_where": env_hits[:20]}

    def _report(self, row: dict[str, Any], req: p.CommitRevocationRequest, splice: p.CheckpointRecord,
                effects: Any, leak: dict[str, Any]) -> p.RevocationReport:
        tokens = req.tokens
        counts = dict(req.call_counts)
        counts.update(staged=len(effects.staged), held=len(effects.held), orphaned=len(effects.orphaned),
                      fired_twice=self.service.firewall.ledger.fired_twice(row["session_id"]))
        for key in ("reexecuted", "reused", "shadowed", "deduplicated"):
            counts.setdefault(key, 0)
        not_erased = [f"external effect {cid} already fired (orphaned: compensate it)" for cid in effects.orphaned]
        not_erased += req.agent_notes
        if leak["environment_hits"]:
            not_erased.append(f"the target is in the sandbox's own files ({leak['environment_hits']} places), "
                              "which the counterfactual world holds too: a replay does not rewrite the environment")
        if self.service.world is not None:
            not_erased.append(f"the outside world ({self.service.world.name} environment) still holds whatever it "
                              "held or was sent: the source of an injection keeps it, as a web page would")
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


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` with `fn` applied to every string inside it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    return value


def _info(row: dict[str, Any]) -> p.RevocationInfo:
    return p.RevocationInfo(revocation_id=row["revocation_id"], session_id=row["session_id"], source=row["source"],
                            state=row["state"], raised_by=row["raised_by"], tau=row["tau"],
                            checkpoint_id=row["checkpoint_id"])
