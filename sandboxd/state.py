"""The daemon's durable state in SQLite: sessions, calls and snapshots.

One connection shared by the worker threads under a lock, WAL mode and `synchronous=FULL`: a reply
is sent only after its record is committed, so whatever the daemon acknowledged survives `kill -9`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlite_utils

SCHEMA_VERSION = 1


def connect(path: Path) -> sqlite3.Connection:
    """A connection with the pragmas every sandboxd database uses."""
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    # Revoked content must not survive in freed pages (the revocation issue relies on this).
    conn.execute("PRAGMA secure_delete=ON")
    return conn


class StateStore:
    """Typed access to the state tables; every method is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = connect(path)
        self.db = sqlite_utils.Database(self.conn)
        self.lock = threading.RLock()
        self._create()

    def _create(self) -> None:
        with self.transaction():
            self.db.table("sessions").create(
                {"session_id": str, "image": str, "state": str, "created_at": float, "closed_at": float,
                 "container_id": str, "env_snapshot": str, "owner": str},
                # owner: the opener's CURVE public key, or "local" for the ipc socket's owner
                pk="session_id", if_not_exists=True, not_null={"image", "state", "created_at", "owner"},
            )
            self.db.table("calls").create(
                {"call_id": str, "session_id": str, "seq": int, "tool": str, "args": str, "effect": str,
                 "status": str, "result": str, "created_at": float, "finished_at": float, "branch": str,
                 "turn": int},
                # Call ids are the agent's to choose, so they are unique within a session, not across them.
                pk=("session_id", "call_id"), if_not_exists=True, foreign_keys=[("session_id", "sessions")],
                not_null={"session_id", "tool", "args", "status"},
            )
            self.db.table("snapshots").create(
                {"snapshot_id": str, "session_id": str, "label": str, "created_at": float, "layers": int,
                 "elapsed_ms": float},
                pk="snapshot_id", if_not_exists=True, foreign_keys=[("session_id", "sessions")],
            )
            self.db.table("revocations").create(
                {"revocation_id": str, "session_id": str, "source": str, "target": str, "fingerprint": str,
                 "state": str, "raised_by": str, "tau": int, "T": int, "checkpoint_id": str, "branch": str,
                 "closure": str, "report": str, "created_at": float, "started_at": float, "suffix": str,
                 "pieces": str, "error": str},
                pk="revocation_id", if_not_exists=True,
            )
            revocations = self.db.table("revocations")
            for column in ("pieces", "error"):  # a state written by an older daemon lacks them
                if column not in revocations.columns_dict:
                    revocations.add_column(column, str)
            self.db.table("forgotten").create({"session_id": str, "fingerprint": str}, if_not_exists=True)
            self.db.table("calls").create_index(["session_id", "seq"], if_not_exists=True)
            self.db.table("snapshots").create_index(["session_id"], if_not_exists=True)
            self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """BEGIN IMMEDIATE .. COMMIT under the store lock; rolls back on any exception."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    # Sessions ----------------------------------------------------------------------------------

    def add_session(self, session_id: str, image: str, owner: str) -> dict[str, Any]:
        row = {"session_id": session_id, "image": image, "state": "opening", "created_at": time.time(),
               "closed_at": None, "container_id": None, "owner": owner}
        with self.transaction() as db:
            db.table("sessions").insert(row)
        return row

    def update_session(self, session_id: str, **fields: Any) -> None:
        with self.transaction() as db:
            db.table("sessions").update(session_id, fields)

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self.lock:
            rows = list(self.db.table("sessions").rows_where("session_id = ?", [session_id]))
        return rows[0] if rows else None

    def sessions(self, states: tuple[str, ...] = ("open",), owner: str | None = None) -> list[dict[str, Any]]:
        """Sessions in these states, oldest first; only `owner`'s when one is given."""
        where, params = f"state in ({','.join('?' for _ in states)})", list(states)
        if owner is not None:
            where, params = where + " AND owner = ?", [*params, owner]
        with self.lock:
            return list(self.db.table("sessions").rows_where(where, params, order_by="created_at"))

    def revocation_session(self, revocation_id: str) -> str | None:
        """The session a revocation belongs to, if it exists."""
        with self.lock:
            row = self.conn.execute("SELECT session_id FROM revocations WHERE revocation_id = ?",
                                    [revocation_id]).fetchone()
        return row[0] if row else None

    # Calls -------------------------------------------------------------------------------------

    def call(self, session_id: str, call_id: str) -> dict[str, Any] | None:
        with self.lock:
            rows = list(self.db.table("calls").rows_where("session_id = ? AND call_id = ?", [session_id, call_id]))
        return rows[0] if rows else None

    def begin_call(self, call_id: str, session_id: str, tool: str, args: dict[str, Any], effect: str,
                   branch: str = "", turn: int | None = None) -> None:
        """Record a call as running before it runs (write-ahead); a write call makes the sandbox dirty."""
        with self.transaction() as db:
            if effect == "write":
                db.table("sessions").update(session_id, {"env_snapshot": None})
            seq = self.conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM calls WHERE session_id = ?", [session_id]
            ).fetchone()[0]
            db.table("calls").insert({"call_id": call_id, "session_id": session_id, "seq": seq, "tool": tool,
                                "args": canonical_args(args), "effect": effect, "status": "running",
                                "result": None, "created_at": time.time(), "finished_at": None,
                                "branch": branch, "turn": turn})

    def finish_call(self, session_id: str, call_id: str, status: str, result: dict[str, Any]) -> None:
        with self.transaction() as db:
            db.table("calls").update((session_id, call_id), {"status": status, "result": json.dumps(result),
                                         "finished_at": time.time()})

    def interrupt_running_calls(self) -> list[str]:
        """Mark calls a crash cut off; returns their ids."""
        with self.transaction():
            ids = [r[0] for r in self.conn.execute("SELECT call_id FROM calls WHERE status = 'running'")]
            self.conn.execute("UPDATE calls SET status = 'interrupted' WHERE status = 'running'")
        return ids

    def delete_calls_of(self, session_id: str) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM calls WHERE session_id = ?", [session_id])

    def calls(self, session_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.db.table("calls").rows_where("session_id = ?", [session_id], order_by="seq"))

    # Forgetting -------------------------------------------------------------------------------

    def fingerprints(self, session_id: str) -> list[str]:
        with self.lock:
            return [r["fingerprint"] for r in self.db.table("forgotten").rows_where("session_id = ?", [session_id])]

    def add_fingerprint(self, session_id: str, fingerprint: str) -> None:
        with self.transaction() as db:
            db.table("forgotten").insert({"session_id": session_id, "fingerprint": fingerprint})

    def purge(self) -> None:
        """Make deleted rows physically gone from the files, the WAL included.

        secure_delete already overwrites deleted content (and freed pages) with zeros in the database
        pages; what remains is the old page images in the WAL, which a TRUNCATE checkpoint removes.
        Rejected: VACUUM on every purge, which rewrites the whole database under the state lock (seconds
        once many sessions share it) for nothing secure_delete has not already done.
        """
        with self.lock:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def vacuum(self) -> None:
        """Rewrite the whole database (and empty the WAL): the last resort when a scan still finds a value."""
        with self.lock:
            self.conn.execute("VACUUM")
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # Snapshots ---------------------------------------------------------------------------------

    def add_snapshot(self, row: dict[str, Any]) -> None:
        with self.transaction() as db:
            db.table("snapshots").insert(row)

    def snapshot(self, snapshot_id: str) -> dict[str, Any] | None:
        with self.lock:
            rows = list(self.db.table("snapshots").rows_where("snapshot_id = ?", [snapshot_id]))
        return rows[0] if rows else None

    def snapshots(self, session_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.db.table("snapshots").rows_where("session_id = ?", [session_id],
                                                        order_by="created_at, snapshot_id"))

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self.transaction() as db:
            db.table("snapshots").delete(snapshot_id)

    def delete_snapshots_of(self, session_id: str) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM snapshots WHERE session_id = ?", [session_id])


def canonical_args(args: dict[str, Any]) -> str:
    """Arguments as stable JSON, so a retried call id can be compared with its record."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
