"""The provenance graph, the observation log and the checkpoint set of each session, in SQLite.

Artifacts are the graph's nodes; `prov_edges` holds parent -> child. Observations (user inputs,
memory injections, tool results) are the artifacts whose type makes them a step o_t, and their
recorded content is the observation log a replay re-feeds. One recursive query gives a source's
taint closure; `tau` is the source's step. Every artifact gets a `seq` in recording order, so "the
suffix after a checkpoint" is a range of seqs.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branch
from sandboxd.db import Database
from sandboxd.errors import InvalidArguments, NotFound

_TABLES = ("prov_artifacts", "prov_edges", "prov_checkpoints")
#: the live branch of a session; a replay writes under its own branch name until it commits
LIVE = ""


class ProvenanceStore:
    """Typed access to the provenance tables; the branch participant of provenance."""

    name = "provenance"

    def __init__(self, db: Database) -> None:
        self.db = db


    # Recording ---------------------------------------------------------------------------------

    def record(self, session_id: str, artifacts: list[p.Artifact], branch: str = LIVE) -> int:
        """Insert artifacts and their parent edges; a re-sent artifact id must be identical."""
        with self.db.transaction():
            seq = self._next_seq(session_id)
            inserted = 0
            for artifact in artifacts:
                existing = self._artifact_row(session_id, artifact.artifact_id, branch)
                if existing is not None:
                    if self._load(existing) != artifact:
                        raise InvalidArguments("provenance", f"artifact {artifact.artifact_id} re-sent with "
                                               "different contents", "$.artifacts")
                    continue
                self._check_parents(session_id, artifact, branch)
                self.db.insert("prov_artifacts", _to_row(session_id, artifact, seq, branch))
                for parent in dict.fromkeys(artifact.parents):
                    self.db.insert("prov_edges", {"session_id": session_id, "branch": branch, "parent": parent,
                                                  "child": artifact.artifact_id})
                seq += 1
                inserted += 1
        return inserted

    def _next_seq(self, session_id: str) -> int:
        row = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM prov_artifacts WHERE session_id = ?",
                              [session_id]).fetchone()
        return int(row[0])

    def _check_parents(self, session_id: str, artifact: p.Artifact, branch: str) -> None:
        for parent in artifact.parents:
            # A replay branch builds on the live prefix: its parents are its own or live artifacts.
            if parent != artifact.artifact_id and (self._artifact_row(session_id, parent, branch) is not None
                                                   or self._artifact_row(session_id, parent, LIVE) is not None):
                continue
            raise InvalidArguments("provenance", f"artifact {artifact.artifact_id} names unknown parent "
                                   f"{parent!r}; parents must be recorded first", "$.artifacts")

    def _artifact_row(self, session_id: str, artifact_id: str, branch: str = LIVE) -> dict[str, Any] | None:
        rows = self.db.rows("SELECT * FROM prov_artifacts WHERE session_id = ? AND branch = ? AND artifact_id = ?",
                          [session_id, branch, artifact_id])
        return rows[0] if rows else None

    def add_checkpoint(self, session_id: str, checkpoint: p.CheckpointRecord, branch: str = LIVE) -> bool:
        """Store a checkpoint, remembering how many artifacts existed when it was taken; False when the very same
        position is registered again (an agent resumed from it after a rollback), which keeps the first."""
        # Three statements under the writers' lock, not five: an agent checkpoints every turn.
        with self.db.transaction():
            same = self.db.rows("SELECT step, turn, token_offset, artifact_seq FROM prov_checkpoints WHERE "
                                "session_id = ? AND branch = ? AND checkpoint_id = ?",
                                [session_id, branch, checkpoint.checkpoint_id])
            last_seq = self._next_seq(session_id) - 1
            if same:
                first = same[0]
                unmoved = last_seq == int(first["artifact_seq"] or 0)
                if (first["step"], first["turn"], first["token_offset"]) == \
                        (checkpoint.step, checkpoint.turn, checkpoint.token_offset) and unmoved:
                    return False
                raise InvalidArguments("checkpoint", f"checkpoint {checkpoint.checkpoint_id} already exists",
                                       "$.checkpoint.checkpoint_id")
            row = msgspec.to_builtins(checkpoint)
            row.update(session_id=session_id, manifest=json.dumps(checkpoint.manifest), artifact_seq=last_seq,
                       branch=branch)
            self.db.insert("prov_checkpoints", row)
        return True

    def checkpoint(self, session_id: str, checkpoint_id: str, branch: str = LIVE) -> p.CheckpointRecord | None:
        rows = self.db.rows("SELECT * FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND checkpoint_id = ?",
                          [session_id, branch, checkpoint_id])
        return _checkpoint(rows[0]) if rows else None

    # Queries -----------------------------------------------------------------------------------

    def _load(self, row: dict[str, Any]) -> p.Artifact:
        parents = self.db.rows("SELECT parent FROM prov_edges WHERE session_id = ? AND branch = ? AND child = ? "
                             "ORDER BY rowid", [row["session_id"], row["branch"], row["artifact_id"]])
        return _from_row(row, [r["parent"] for r in parents])

    def artifact(self, session_id: str, artifact_id: str) -> p.Artifact:
        row = self._artifact_row(session_id, artifact_id)
        if row is None:
            raise NotFound(f"session {session_id} has no artifact {artifact_id!r}", artifact_id=artifact_id)
        return self._load(row)

    def artifacts(self, session_id: str, branch: str | None = LIVE) -> list[p.Artifact]:
        """Artifacts in recording order (of one branch, or all with branch=None)."""
        where, params = "session_id = ?", [session_id]
        if branch is not None:
            where, params = where + " AND branch = ?", [session_id, branch]
        parents: dict[str, list[str]] = {}
        for edge in self.db.rows("SELECT branch, parent, child FROM prov_edges WHERE session_id = ? ORDER BY rowid",
                               [session_id]):
            parents.setdefault(edge["branch"] + "/" + edge["child"], []).append(edge["parent"])
        rows = self.db.rows(f"SELECT * FROM prov_artifacts WHERE {where} ORDER BY seq", params)
        return [_from_row(r, parents.get(r["branch"] + "/" + r["artifact_id"], [])) for r in rows]

    def checkpoints(self, session_id: str, branch: str | None = LIVE) -> list[p.CheckpointRecord]:
        where, params = "session_id = ?", [session_id]
        if branch is not None:
            where, params = where + " AND branch = ?", [session_id, branch]
        rows = self.db.rows(f"SELECT * FROM prov_checkpoints WHERE {where} ORDER BY step, token_offset, created_at",
                          params)
        return [_checkpoint(r) for r in rows]

    def closure(self, session_id: str, source: str) -> list[str]:
        """The source and every artifact reachable from it along parent -> child edges, in order."""
        rows = self.db.rows(
            """WITH RECURSIVE reach(id) AS (
                   SELECT ? UNION SELECT e.child FROM prov_edges e JOIN reach r ON e.parent = r.id
                   WHERE e.session_id = ? AND e.branch = ?)
               SELECT a.artifact_id FROM prov_artifacts a JOIN reach ON a.artifact_id = reach.id
               WHERE a.session_id = ? AND a.branch = ? ORDER BY a.seq""",
            [source, session_id, LIVE, session_id, LIVE])
        return [r["artifact_id"] for r in rows]

    def last_step(self, session_id: str) -> int:
        """T: the number of observation steps the live branch has consumed."""
        marks = ",".join("?" for _ in p.OBSERVATION_TYPES)
        rows = self.db.rows(f"SELECT COALESCE(MAX(step), 0) AS t FROM prov_artifacts WHERE session_id = ? "
                          f"AND branch = ? AND type IN ({marks})", [session_id, LIVE, *p.OBSERVATION_TYPES])
        return int(rows[0]["t"])

    def observations_before(self, session_id: str, step: int) -> list[p.Artifact]:
        """Live observations consumed before observation `step`, oldest first."""
        return [a for a in self.artifacts(session_id) if a.type in p.OBSERVATION_TYPES and a.step < step]

    def observations_from(self, session_id: str, source: str) -> list[p.Artifact]:
        """The live observation `source` and the observations after it, in the order they were consumed."""
        observed = [a for a in self.artifacts(session_id) if a.type in p.OBSERVATION_TYPES]
        index = next((i for i, a in enumerate(observed) if a.artifact_id == source), None)
        return [] if index is None else observed[index:]

    def checkpoint_before(self, session_id: str, step: int) -> p.CheckpointRecord | None:
        """The latest live checkpoint taken before observation `step` was consumed."""
        rows = self.db.rows(
            "SELECT * FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND step < ? "
            "ORDER BY step DESC, token_offset DESC, artifact_seq DESC LIMIT 1", [session_id, LIVE, step])
        return _checkpoint(rows[0]) if rows else None

    def query(self, session_id: str, source: str) -> tuple[int, int, list[str], p.CheckpointRecord | None]:
        """(tau, T, taint closure, splice checkpoint) for a source artifact."""
        return self.locate(session_id, self.artifact(session_id, source))

    def locate(self, session_id: str, artifact: p.Artifact) -> tuple[int, int, list[str], p.CheckpointRecord | None]:
        """`query` of an artifact the caller has read already."""
        source = artifact.artifact_id
        if artifact.type not in p.OBSERVATION_TYPES:
            raise InvalidArguments("provenance", f"{source} is a {artifact.type}, not an observation: only "
                                   "user inputs, memory injections and tool results can be revoked", "$.source")
        tau = artifact.step
        closure = self.closure(session_id, source)
        return tau, self.last_step(session_id), closure, self.checkpoint_before(session_id, tau)

    def suffix_bounds(self, session_id: str) -> tuple[int, int]:
        """(last artifact seq, last checkpoint rowid) of the live session: where an old suffix ends."""
        row = self.db.rows(
            "SELECT (SELECT COALESCE(MAX(seq), 0) FROM prov_artifacts WHERE session_id = ? AND branch = ?) AS a, "
            "(SELECT COALESCE(MAX(rowid), 0) FROM prov_checkpoints WHERE session_id = ? AND branch = ?) AS c",
            [session_id, LIVE, session_id, LIVE])[0]
        return int(row["a"]), int(row["c"])

    def commit_branch(self, session_id: str, branch: str, splice: p.CheckpointRecord,
                      old_end: tuple[int, int]) -> None:
        """Make a replay branch live: drop the old suffix between `splice` and `old_end`, relabel the branch.

        Bounded on both sides, so repeating it after a crash never touches what the branch brought."""
        with self.db.transaction():
            cut = self._cut(session_id, splice)
            later = [r["artifact_id"] for r in self.db.rows(
                "SELECT artifact_id FROM prov_artifacts WHERE session_id = ? AND branch = ? AND seq > ? AND seq <= ?",
                [session_id, LIVE, cut["artifact_seq"], old_end[0]])]
            for chunk in _chunks(later):
                marks = ",".join("?" for _ in chunk)
                self.db.execute(f"DELETE FROM prov_edges WHERE session_id = ? AND branch = ? AND child IN ({marks})",
                                [session_id, LIVE, *chunk])
                self.db.execute(f"DELETE FROM prov_artifacts WHERE session_id = ? AND branch = ? "
                                f"AND artifact_id IN ({marks})", [session_id, LIVE, *chunk])
            self.db.execute("DELETE FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND rowid > ? "
                            "AND rowid <= ?", [session_id, LIVE, cut["rowid"], old_end[1]])
            # A replay re-registers the splice point itself (same position, same id): keep the live one.
            self.db.execute("DELETE FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND checkpoint_id IN "
                            "(SELECT checkpoint_id FROM prov_checkpoints WHERE session_id = ? AND branch = ?)",
                            [session_id, branch, session_id, LIVE])
            for table in _TABLES:
                self.db.execute(f"UPDATE {table} SET branch = ? WHERE session_id = ? AND branch = ?",
                                [LIVE, session_id, branch])

    def _cut(self, session_id: str, splice: p.CheckpointRecord) -> dict[str, Any]:
        """Where the live session is cut at `splice`: its artifact seq and checkpoint rowid (0, 0 for a point
        before the first checkpoint: a rollback to a snapshot taken before any)."""
        rows = self.db.rows("SELECT artifact_seq, rowid FROM prov_checkpoints WHERE session_id = ? AND branch = ? "
                          "AND checkpoint_id = ?", [session_id, LIVE, splice.checkpoint_id])
        return rows[0] if rows else {"artifact_seq": 0, "rowid": 0}

    def after(self, session_id: str, splice: p.CheckpointRecord) -> tuple[int, int]:
        """(artifacts, checkpoints) of the live session after `splice`: what a rollback to it removes."""
        cut = self._cut(session_id, splice)
        row = self.db.rows(
            "SELECT (SELECT COUNT(*) FROM prov_artifacts WHERE session_id = ? AND branch = ? AND seq > ?) AS a, "
            "(SELECT COUNT(*) FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND rowid > ?) AS c",
            [session_id, LIVE, cut["artifact_seq"], session_id, LIVE, cut["rowid"]])[0]
        return int(row["a"]), int(row["c"])

    def copy_to(self, session_id: str, child: str, splice: p.CheckpointRecord, snapshots: dict[str, str]) -> tuple[
            int, int]:
        """Copy the live session up to `splice` (its artifacts, edges and checkpoints) to the session `child`
        (inside a transaction); checkpoints' snapshots are renamed by `snapshots`. Returns (artifacts,
        checkpoints) copied."""
        cut = self._cut(session_id, splice)
        artifacts = self.db.execute(
            "INSERT INTO prov_artifacts (session_id, artifact_id, seq, type, turn, step, token_start, token_end, "
            "committed, content, meta, source_ids, branch) SELECT ?, artifact_id, seq, type, turn, step, "
            "token_start, token_end, committed, content, meta, source_ids, branch FROM prov_artifacts "
            "WHERE session_id = ? AND branch = ? AND seq <= ?", [child, session_id, LIVE, cut["artifact_seq"]]).rowcount
        self.db.execute(
            "INSERT INTO prov_edges (session_id, branch, parent, child) SELECT ?, e.branch, e.parent, e.child "
            "FROM prov_edges e JOIN prov_artifacts a ON a.session_id = ? AND a.branch = e.branch "
            "AND a.artifact_id = e.child WHERE e.session_id = ? AND e.branch = ?", [child, child, session_id, LIVE])
        checkpoints = 0
        for row in self.db.rows("SELECT * FROM prov_checkpoints WHERE session_id = ? AND branch = ? AND rowid <= ? "
                              "ORDER BY rowid", [session_id, LIVE, cut["rowid"]]):
            row.update(session_id=child, snapshot_id=snapshots.get(row["snapshot_id"] or ""))
            self.db.insert("prov_checkpoints", row)
            checkpoints += 1
        return int(artifacts), checkpoints

    # The branch participant --------------------------------------------------------------------

    def begin(self, branch: Branch) -> None:
        """Remember where the live session's suffix ends now: what a commit replaces, and nothing later."""
        artifacts, checkpoints = self.suffix_bounds(branch.session_id)
        with self.db.transaction():
            self.db.insert("prov_branches", {"branch": branch.id, "session_id": branch.session_id,
                                             "artifact_end": artifacts, "checkpoint_end": checkpoints}, replace=True)

    def commit(self, branch: Branch) -> dict[str, Any]:
        with self.db.transaction():
            bounds = self.db.row("SELECT * FROM prov_branches WHERE branch = ?", [branch.id])
            if bounds is not None:  # absent: committed before a crash
                self.commit_branch(branch.session_id, branch.id, branch.splice,
                                   (bounds["artifact_end"], bounds["checkpoint_end"]))
                self.db.execute("DELETE FROM prov_branches WHERE branch = ?", [branch.id])
        return {}

    def abandon(self, branch: Branch) -> None:
        with self.db.transaction():
            self.abandon_branch(branch.session_id, branch.id)
            self.db.execute("DELETE FROM prov_branches WHERE branch = ?", [branch.id])

    def abandon_branch(self, session_id: str, branch: str) -> None:
        """Forget a replay branch that will not be committed."""
        with self.db.transaction():
            for table in _TABLES:
                self.db.execute(f"DELETE FROM {table} WHERE session_id = ? AND branch = ?", [session_id, branch])

    def delete_session(self, session_id: str) -> None:
        with self.db.transaction():
            for table in _TABLES:
                self.db.execute(f"DELETE FROM {table} WHERE session_id = ?", [session_id])


def _chunks(items: list[str], size: int = 400) -> list[list[str]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _to_row(session_id: str, artifact: p.Artifact, seq: int, branch: str) -> dict[str, Any]:
    span = artifact.token_span
    return {"session_id": session_id, "artifact_id": artifact.artifact_id, "seq": seq, "type": artifact.type,
            "turn": artifact.turn, "step": artifact.step, "token_start": span[0] if span else None,
            "token_end": span[1] if span else None, "committed": int(artifact.committed),
            "content": artifact.content, "meta": json.dumps(artifact.meta, sort_keys=True),
            "source_ids": json.dumps(artifact.source_ids), "branch": branch}


def _from_row(row: dict[str, Any], parents: list[str]) -> p.Artifact:
    span = (row["token_start"], row["token_end"]) if row["token_start"] is not None else None
    return p.Artifact(
        artifact_id=row["artifact_id"], type=row["type"], parents=parents,
        source_ids=json.loads(row["source_ids"]), token_span=span, turn=row["turn"], step=row["step"],
        committed=bool(row["committed"]), content=row["content"], meta=json.loads(row["meta"]),
    )


def _checkpoint(row: dict[str, Any]) -> p.CheckpointRecord:
    return p.CheckpointRecord(
        checkpoint_id=row["checkpoint_id"], step=row["step"], turn=row["turn"], token_offset=row["token_offset"],
        cache_handle=row["cache_handle"], reason=row["reason"], manifest=json.loads(row["manifest"]),
        snapshot_id=row["snapshot_id"], created_at=row["created_at"] or 0.0,
    )
