"""Sessions: the one model everything else is built on. A session's row, its lock, its sandbox, its snapshots.

`Sessions` owns the `sessions` and `snapshots` tables, a lock per open session (requests of one session
are serialised; different sessions run in parallel; a closed session's lock is dropped), the sandbox
(`sandboxd.sandbox.base.Sandbox`) and the snapshot store. It takes and restores snapshots, knows which
snapshot equals the sandbox now, and recovers all of it after a crash. It is also the branch participant
that holds the sandbox's files: a branch begins by restoring its splice checkpoint's snapshot.

Why one module of this size: the session row, its lock, its sandbox and its snapshots are the one model
the issue asked for (a `Session` everything else is built on); their recovery after a crash has to see
all of them at once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branch
from sandboxd.db import Database
from sandboxd.errors import (
    NotFound,
    OperationRefused,
    SandboxUnavailable,
    SessionClosed,
    SnapshotFailed,
    SnapshotInUse,
    SnapshotNotFound,
    UnknownSession,
)
from sandboxd.sandbox.base import Sandbox
from snapshots import SnapshotError, SnapshotStore, UnknownSnapshot

log = logging.getLogger("sandboxd")

IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")
"""Characters Docker allows in an image name, tag or digest; anything else is refused before the engine sees it."""

#: label of the snapshots the daemon takes for agent checkpoints (deleted with the suffix they belong to)
CHECKPOINT_LABEL = "checkpoint"


class SessionRow(msgspec.Struct, kw_only=True):
    """A session as stored: `state` is opening, open, closing, closed, failed or lost (a lost node's)."""

    session_id: str
    image: str
    state: p.SessionState
    created_at: float
    owner: str
    """The opener's CURVE public key, or "local" for the owner of the ipc socket."""
    closed_at: float | None = None
    container_id: str | None = None
    env_snapshot: str | None = None
    """A snapshot equal to the sandbox now, or None once a write-class call may have changed it."""
    idle_timeout_s: float | None = None
    """Closed by the daemon after this long without a request naming it."""
    ttl_s: float | None = None
    """Closed by the daemon this long after it opened."""
    forked_from: str | None = None
    hold_effects: int = 0
    """1: every external call of the session is held for release (a fork's, unless started with live effects)."""

    def info(self) -> p.SessionInfo:
        return p.SessionInfo(session_id=self.session_id, image=self.image,
                             state=self.state, created_at=self.created_at,
                             container=self.container_id, idle_timeout_s=self.idle_timeout_s, ttl_s=self.ttl_s,
                             closed_at=self.closed_at, owner=self.owner)


class SnapshotRow(msgspec.Struct, kw_only=True):
    snapshot_id: str
    session_id: str
    created_at: float
    label: str | None = None
    layers: int = 1
    elapsed_ms: float = 0.0

    def info(self) -> p.SnapshotInfo:
        return p.SnapshotInfo(snapshot_id=self.snapshot_id, session_id=self.session_id, created_at=self.created_at,
                              label=self.label, layers=self.layers or 1, elapsed_ms=self.elapsed_ms or 0.0)


Timed = Callable[[str], AbstractContextManager[object]]


class Sessions:
    """Every session of the daemon; see the module docstring."""

    name = "sandbox"

    def __init__(self, db: Database, sandbox: Sandbox, store: SnapshotStore, default_image: str,
                 timed: Timed | None = None) -> None:
        self.db = db
        self.sandbox = sandbox
        self.store = store
        self.default_image = default_image
        self.timed: Timed = timed or (lambda _op: _untimed())
        self.live_snapshots: Callable[[str], set[str]] = lambda _sid: set()
        """The snapshots a session's live checkpoints refer to (provenance tells; set by the composition)."""
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._started_at = time.time()
        self._held = threading.local()
        self._last_used: dict[str, float] = {}
        """When a request last named each session, in this daemon run (kept in memory: a write per read
        request would cost more than an idle clock that restarts with the daemon is worth)."""

    # Rows --------------------------------------------------------------------------------------

    def get(self, session_id: str) -> SessionRow | None:
        held: SessionRow | None = getattr(self._held, "row", None)
        if held is not None and held.session_id == session_id:
            return held
        return self.db.struct("SELECT * FROM sessions WHERE session_id = ?", [session_id], SessionRow)

    @contextmanager
    def holding(self, row: SessionRow) -> Iterator[None]:
        """Within the block this thread reads the session's row as `row`, read by a caller that holds the
        writers' lock throughout (`sandboxd.atonce`): no write can change it meanwhile, so reading it
        again, as the ownership check and then the call do, would only cost the time."""
        self._held.row = row
        try:
            yield
        finally:
            self._held.row = None

    def known(self, session_id: str) -> SessionRow:
        row = self.get(session_id)
        if row is None:
            raise UnknownSession(session_id)
        return row

    def check_open(self, session_id: str) -> SessionRow:
        row = self.known(session_id)
        if row.state != "open":
            raise SessionClosed(session_id)
        return row

    def in_states(self, states: tuple[str, ...] = ("open",), owner: str | None = None) -> list[SessionRow]:
        """Sessions in these states, oldest first; only `owner`'s when one is given; on a state database
        several daemons share, only this daemon's (the ones it serves, expires and recovers)."""
        where, params = f"state IN ({','.join('?' for _ in states)})", list(states)
        mine, node = self.db.mine()
        where, params = where + mine, [*params, *node]
        if owner is not None:
            where, params = where + " AND owner = ?", [*params, owner]
        return self.db.structs(f"SELECT * FROM sessions WHERE {where} ORDER BY created_at", params, SessionRow)

    def count_open(self) -> int:
        return int(self.db.value("SELECT COUNT(*) FROM sessions WHERE state = 'open'") or 0)

    def update(self, session_id: str, durable: bool = False, **fields: Any) -> None:
        with self.db.transaction(durable=durable):
            self.db.update("sessions", {"session_id": session_id}, **fields)

    def lock(self, session_id: str) -> threading.Lock:
        """The lock that serialises a session's requests."""
        with self._guard:
            return self._locks.setdefault(session_id, threading.Lock())

    def _forget_lock(self, session_id: str) -> None:
        with self._guard:
            self._locks.pop(session_id, None)
            self._last_used.pop(session_id, None)

    # Idle time and time to live ------------------------------------------------------------------

    def touch(self, session_id: str) -> None:
        """A request named the session: its idle clock starts again."""
        with self._guard:
            self._last_used[session_id] = time.time()

    def last_used(self, row: SessionRow) -> float:
        """When a request last named it; its opening, or this daemon's start, before any did."""
        with self._guard:
            return self._last_used.get(row.session_id) or max(row.created_at, self._started_at)

    def expired(self, now: float) -> list[tuple[str, str]]:
        """Open sessions past their time to live or idle timeout, with which one."""
        found = []
        for row in self.in_states(("open",)):
            if row.ttl_s is not None and now - row.created_at >= row.ttl_s:
                found.append((row.session_id, f"its time to live of {row.ttl_s:g}s ran out"))
            elif row.idle_timeout_s is not None and now - self.last_used(row) >= row.idle_timeout_s:
                found.append((row.session_id, f"it was idle for {row.idle_timeout_s:g}s"))
        return found

    # Lifecycle ---------------------------------------------------------------------------------

    def open(self, image: str | None, owner: str, idle_timeout_s: float | None = None,
             ttl_s: float | None = None) -> SessionRow:
        """A new session with a running sandbox on an empty workspace."""
        session_id = "s-" + uuid.uuid4().hex[:12]
        image = image or self.default_image
        if not IMAGE_REFERENCE.fullmatch(image):
            raise NotFound(f"{image!r} is not an image reference (name[:tag], name@digest or an id)", image=image)
        if not self.sandbox.image_exists(image):
            raise NotFound(f"image {image!r} not found on the Docker engine", image=image)
        with self.db.transaction():
            self.db.insert("sessions", SessionRow(session_id=session_id, image=image, state="opening",
                                                  created_at=time.time(), owner=owner,
                                                  idle_timeout_s=idle_timeout_s, ttl_s=ttl_s))
        with self.lock(session_id):
            try:
                root = self.store.create(session_id, self.sandbox.owner())
                container_id = self.sandbox.create(session_id, image, root, self.store.propagation)
            except BaseException:
                self.teardown(session_id)
                self.update(session_id, state="failed", closed_at=time.time())
                raise
            self.update(session_id, state="open", container_id=container_id)
        self.touch(session_id)  # idle from now: a slow start must not eat an idle timeout before the opener has it
        return self.known(session_id)

    def open_fork(self, parent: SessionRow, snapshots: list[str], at: str, hold_effects: bool) -> tuple[
            SessionRow, dict[str, str]]:
        """A new session, still `opening`, whose store holds copies of the parent's `snapshots` (under new ids,
        returned old -> new) and whose sandbox runs on the files of snapshot `at`. The caller records the rest
        and opens it in one transaction; a crash before leaves an `opening` session, torn down at start-up."""
        session_id = "s-" + uuid.uuid4().hex[:12]
        renamed = {old: "snap-" + uuid.uuid4().hex[:12] for old in snapshots}
        with self.db.transaction():
            self.db.insert("sessions", SessionRow(session_id=session_id, image=parent.image, state="opening",
                                                  created_at=time.time(), owner=parent.owner,
                                                  forked_from=parent.session_id, hold_effects=int(hold_effects)))
        try:
            root = self.store.create(session_id, self.sandbox.owner())
            self.store.clone(parent.session_id, session_id, renamed)
            self.store.restore(session_id, renamed[at])
            container_id = self.sandbox.create(session_id, parent.image, root, self.store.propagation)
        except BaseException:
            self.teardown(session_id)
            self.update(session_id, state="failed", closed_at=time.time())
            raise
        with self.db.transaction():
            for old, new in renamed.items():
                origin = self.own_snapshot(parent.session_id, old)
                self.db.insert("snapshots", msgspec.structs.replace(origin, snapshot_id=new, session_id=session_id))
            self.db.update("sessions", {"session_id": session_id}, container_id=container_id,
                           env_snapshot=renamed[at])
        return self.known(session_id), renamed

    def stop_all(self) -> None:
        """A daemon stopping: every sandbox stops and every mount goes; start-up brings them back."""
        for row in self.in_states(("open",)):
            try:
                self.sandbox.stop(row.session_id)
            except Exception:  # noqa: BLE001 - the engine may be gone too; start-up recovers either way
                log.warning("could not stop the sandbox of %s", row.session_id, exc_info=True)
        self.store.detach()

    def teardown(self, session_id: str) -> None:
        """Remove the session's sandbox and snapshot store (its rows stay)."""
        self.sandbox.remove(session_id)
        self.store.destroy(session_id)
        with self.db.transaction():
            self.db.execute("DELETE FROM snapshots WHERE session_id = ?", [session_id])

    def closed(self, session_id: str) -> None:
        """The session is closed: its row says so and its lock is gone."""
        self.update(session_id, state="closed", closed_at=time.time())
        self._forget_lock(session_id)

    # The sandbox -------------------------------------------------------------------------------

    def executor(self, session_id: str, payload: dict[str, Any], timeout: float,
                 on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """One executor request; a dead sandbox is restarted and the failure reported."""
        try:
            return self.sandbox.request(session_id, payload, timeout, on_output)
        except SandboxUnavailable as exc:
            cause = self.sandbox.stop_cause(session_id)
            restarted = self.sandbox.ensure_running(session_id)
            stopped = f"; the sandbox had stopped (exit code {cause['exit_code']})" if "exit_code" in cause else ""
            raise SandboxUnavailable(f"{exc.message}{stopped}; sandbox {'restarted' if restarted else 'is gone'}",
                                     session_id=session_id, restarted=restarted,
                                     oom_killed=bool(cause.get("oom_killed")), exit_code=cause.get("exit_code"),
                                     ) from exc

    def quiesce(self, session_id: str) -> None:
        """No process of the sandbox may write into a layer while it is frozen or replaced."""
        reply = self.executor(session_id, {"op": "reap"}, 10.0)
        if not reply.get("ok"):
            raise SandboxUnavailable(f"could not quiesce {session_id}: {reply}")

    # Snapshots (the caller holds the session lock) -----------------------------------------------

    def take(self, session_id: str, label: str | None) -> SnapshotRow:
        """Freeze the sandbox; the sandbox then equals this snapshot."""
        snapshot_id = "snap-" + uuid.uuid4().hex[:12]
        with self.timed("snapshot"):
            self.quiesce(session_id)
            try:
                taken = self.store.take(session_id, snapshot_id)
            except (SnapshotError, OSError) as exc:
                raise SnapshotFailed(f"snapshot of {session_id} failed: {exc}") from exc
        row = SnapshotRow(snapshot_id=snapshot_id, session_id=session_id, label=label,
                          created_at=taken.record.created_at, layers=len(taken.record.layers),
                          elapsed_ms=taken.elapsed_ms)
        # Lazy, like a call's record: it survives the daemon's kill -9 once committed, and the layer it
        # names is itself synced to disk only by the store's flusher, up to a second later.
        with self.db.transaction(lazy=True):
            self.db.insert("snapshots", row)
            self.db.update("sessions", {"session_id": session_id}, env_snapshot=snapshot_id)
        return row

    def current(self, session_id: str) -> str:
        """A snapshot equal to the sandbox now: the last one if nothing was written since, else a new one."""
        row = self.check_open(session_id)
        if row.env_snapshot and self.snapshot(row.env_snapshot) is not None:
            return row.env_snapshot
        return self.take(session_id, CHECKPOINT_LABEL).snapshot_id

    def restore(self, session_id: str, snapshot_id: str) -> float:
        """Put the sandbox back to a snapshot; returns milliseconds spent in the store."""
        self.own_snapshot(session_id, snapshot_id)
        with self.timed("restore"):
            self.quiesce(session_id)
            # /tmp is scratch, not part of a snapshot: a restored sandbox starts it empty.
            self.executor(session_id, {"op": "clear_scratch"}, 10.0)
            # Until the restore is known to be done, no snapshot is known to equal the sandbox. Lazy (see
            # `take`): the store's own steps reach the disk no sooner.
            self._point_at(session_id, None)
            try:
                done = self.store.restore(session_id, snapshot_id)
            except UnknownSnapshot as exc:
                raise SnapshotNotFound(snapshot_id, session_id) from exc
            except (SnapshotError, OSError) as exc:
                raise SnapshotFailed(f"restore of {snapshot_id} failed: {exc}") from exc
        self._point_at(session_id, snapshot_id)
        return done.elapsed_ms

    def _point_at(self, session_id: str, snapshot_id: str | None) -> None:
        """Record which snapshot the sandbox equals (None: not known), committed without waiting for the disk."""
        with self.db.transaction(lazy=True):
            self.db.update("sessions", {"session_id": session_id}, env_snapshot=snapshot_id)

    def snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        return self.db.struct("SELECT * FROM snapshots WHERE snapshot_id = ?", [snapshot_id], SnapshotRow)

    def snapshots(self, session_id: str) -> list[SnapshotRow]:
        return self.db.structs("SELECT * FROM snapshots WHERE session_id = ? ORDER BY created_at, snapshot_id",
                               [session_id], SnapshotRow)

    def own_snapshot(self, session_id: str, snapshot_id: str) -> SnapshotRow:
        row = self.snapshot(snapshot_id)
        if row is None or row.session_id != session_id:
            raise SnapshotNotFound(snapshot_id, session_id)
        return row

    def delete(self, session_id: str, snapshot_id: str, force: bool = True) -> list[str]:
        """Delete a snapshot; one that live checkpoints refer to only with `force`. Returns those checkpoints."""
        self.own_snapshot(session_id, snapshot_id)
        broken = self.checkpoints_on(session_id, snapshot_id)
        if broken and not force:
            raise SnapshotInUse(snapshot_id, broken)
        # Checkpoints that refer to it keep the id: splicing there then fails with snapshot_not_found, rather
        # than going on with files that are not the checkpoint's.
        try:
            self.store.delete(session_id, snapshot_id)
        except UnknownSnapshot:
            pass  # a crash between store and state already removed the files
        with self.db.transaction():
            self.db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", [snapshot_id])
            self.db.execute("UPDATE sessions SET env_snapshot = NULL WHERE session_id = ? AND env_snapshot = ?",
                            [session_id, snapshot_id])
        return broken

    def checkpoints_on(self, session_id: str, snapshot_id: str) -> list[str]:
        """The checkpoints (of any branch) that restore the files of this snapshot."""
        return [str(r["checkpoint_id"]) for r in self.db.rows(
            "SELECT checkpoint_id FROM prov_checkpoints WHERE session_id = ? AND snapshot_id = ? ORDER BY rowid",
            [session_id, snapshot_id])]

    def drop_checkpoint_snapshots(self, session_id: str, keep: set[str]) -> None:
        """Delete checkpoint snapshots no remaining checkpoint refers to (an old suffix's)."""
        current = self.check_open(session_id).env_snapshot
        for row in self.snapshots(session_id):
            if row.label == CHECKPOINT_LABEL and row.snapshot_id not in keep and row.snapshot_id != current:
                self.delete(session_id, row.snapshot_id)

    # The branch participant that holds the sandbox's files --------------------------------------

    def begin(self, branch: Branch) -> None:
        """A replay's sandbox goes back to the splice checkpoint's snapshot (the caller holds the session lock).

        A rollback's waits for its commit: until the operation commits, a crash must find the files as they
        were, and once it is committing it is finished after a crash, the restore with it."""
        if branch.kind == "replay" and branch.splice.snapshot_id:
            self.restore(branch.session_id, branch.splice.snapshot_id)

    def commit(self, branch: Branch) -> dict[str, Any]:
        """The old suffix's checkpoint snapshots go, and their blocks leave the session's disk image."""
        if self.get(branch.session_id) is not None and self.known(branch.session_id).state == "open":
            if branch.kind == "rollback" and branch.splice.snapshot_id:
                self.restore(branch.session_id, branch.splice.snapshot_id)  # again after a crash: same files
            self.drop_checkpoint_snapshots(branch.session_id, self.live_snapshots(branch.session_id))
            self.store.trim(branch.session_id)
        return {"files_restored": branch.splice.snapshot_id} if branch.kind == "rollback" else {}

    def abandon(self, branch: Branch) -> None:
        """The sandbox goes back to where the live branch left it (its latest checkpoint's snapshot)."""
        row = self.get(branch.session_id)
        if row is None or row.state != "open":
            return
        live = self.live_snapshots(branch.session_id)
        latest = next((s.snapshot_id for s in reversed(self.snapshots(branch.session_id)) if s.snapshot_id in live),
                      None)
        if latest is not None:
            self.restore(branch.session_id, latest)

    # Recovery ----------------------------------------------------------------------------------

    def recover(self) -> set[str]:
        """Bring sessions, sandboxes and snapshots back in line after a crash; returns the open sessions."""
        for row in self.in_states(("opening", "closing")):
            self.teardown(row.session_id)
            self.update(row.session_id, state="failed" if row.state == "opening" else "closed",
                        closed_at=time.time())
        live = set()
        for row in self.in_states(("open",)):
            self._recover(row)
            live.add(row.session_id)
        for session_id in set(self.sandbox.sessions()) - live:
            log.warning("removing orphaned sandbox of %s", session_id)
            self.sandbox.remove(session_id)
        for workspace in set(self.store.workspaces()) - live:
            log.warning("removing orphaned workspace %s", workspace)
            self.store.destroy(workspace)
        self.store.sweep(live)
        return live

    def adopt(self, session_id: str) -> tuple[SessionRow, str]:
        """Take over a `lost` session (its node gone) whose workspace was imported into this daemon's store:
        it becomes this daemon's, open again on its imported stack; returns it and that stack's snapshot."""
        row = self.known(session_id)
        if row.state != "lost" or self.db.node is None:
            raise OperationRefused(f"session {session_id} is {row.state}: only a lost session of a shared state "
                                   "database is adopted", session_id=session_id, state=row.state)
        if session_id not in self.store.workspaces():
            raise OperationRefused(f"the workspace of {session_id} was not imported on this node",
                                   session_id=session_id, state=row.state)
        with self.db.transaction():
            self.db.execute("UPDATE sessions SET state = 'open', node = ?, container_id = NULL "
                            "WHERE session_id = ? AND state = 'lost'", [self.db.node, session_id])
        adopted = self.known(session_id)
        self._recover(adopted)
        kept = self.store.list(session_id)
        return self.known(session_id), kept[-1].snapshot_id if kept else ""

    def _recover(self, row: SessionRow) -> None:
        session_id = row.session_id
        self.store.recover(session_id)
        on_disk = {r.snapshot_id for r in self.store.list(session_id)}
        recorded = {r.snapshot_id for r in self.snapshots(session_id)}
        for snapshot_id in on_disk - recorded:  # taken but never acknowledged
            self.store.delete(session_id, snapshot_id)
        with self.db.transaction():
            for snapshot_id in recorded - on_disk:  # deleted from disk, row left by a crash
                self.db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", [snapshot_id])
        if not self.sandbox.ensure_running(session_id):
            log.warning("recreating the missing sandbox of %s", session_id)
            container_id = self.sandbox.create(session_id, row.image, self.store.mount_root(session_id),
                                               self.store.propagation)
            self.update(session_id, container_id=container_id)


@contextmanager
def _untimed() -> Iterator[None]:
    yield
