"""The write-ahead call ledger of external effects, its outbox of held effects, and replay branches.

It lives in the daemon's database (`sandboxd.db`; its tables are created by `sandboxd.migrations`),
every write in a durable transaction. The ledger only stores and checks state transitions; what to do
in each state is the firewall's business.

Tables:
- `ledger_calls`: one row per intent-level call id, its state, arguments and recorded result.
- `ledger_reached`: which branch reached which call with which occurrence index; this is where
  occurrence counters live, so they survive a daemon restart (a counter reset would make the next
  legitimately identical send collide with the first and be answered instead of sent).
- `ledger_aliases`: the agent's own call ids, per branch, pointing at ledger call ids.
- `branches`: the live branch and replay branches of each lineage (the table of `sandboxd.branch`: a
  replay branch is the branch operation that opened it).
- `ledger_events`: append-only history of every state change, for audit.
- `outbox_held`: effects held by a release policy (or staged by a replay) until released or dropped.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import msgspec

from sandboxd.db import Database
from sandboxd.errors import InvalidState
from sandboxd.firewall.intent import canonical_json

CallState = Literal[
    "intent", "fired", "done", "failed", "shadowed", "staged", "released", "orphaned", "unknown", "dropped"
]
HoldPolicy = Literal["on_commit", "manual", "shadow"]
BranchStatus = Literal["live", "open", "committing", "superseded", "abandoned"]

# States in which this process may be talking to the outside world; found after a crash they are unknown.
IN_FLIGHT_STATES: tuple[CallState, ...] = ("intent", "fired", "released")

_json_encode = msgspec.json.encode
_json_decode = msgspec.json.decode


class CallRecord(msgspec.Struct, kw_only=True):
    """One ledger row as the service and operators see it."""

    call_id: str
    tool: str
    state: CallState
    session_id: str
    lineage: str
    branch: str
    occurrence: int
    intent_key: str
    intent: Any
    args: dict[str, Any]
    policy: str
    turn: int | None = None
    result: dict[str, Any] | None = None
    simulated: dict[str, Any] | None = None
    """What a replay's shadow world answered for this staged call; nothing real happened."""
    error: str | None = None
    attempts: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    recovered_from: str | None = None


class HeldEffect(msgspec.Struct, kw_only=True):
    """An effect waiting in the outbox for a commit, an operator, or a replay decision."""

    call_id: str
    tool: str
    session_id: str
    lineage: str
    branch: str
    turn: int | None
    policy: HoldPolicy
    held_at: float
    args: dict[str, Any]


class Branch(msgspec.Struct, kw_only=True):
    """A line of calls within a lineage: the live one, or a replay being built beside it."""

    branch: str
    lineage: str
    parent: str | None
    status: BranchStatus
    from_turn: int | None
    created_at: float


class Ledger:
    """Durable record of every external call; all writes happen inside `transaction()`."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._lock = db.lock
        self._clock = clock

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One durable transaction: committed (fsynced) when the block exits.

        Never nested in someone else's transaction, where our commit would not reach the disk before the
        effect fires: that breaks the write-ahead rule, so `Database` refuses it loudly."""
        with self._db.transaction(durable=True):
            yield

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return self._db.rows(sql, params)

    # Calls ------------------------------------------------------------------------------------

    def get(self, call_id: str) -> CallRecord | None:
        """The call with this ledger id, or None."""
        rows = self._rows("SELECT * FROM ledger_calls WHERE call_id = ?", [call_id])
        return _record(rows[0]) if rows else None

    def insert_call(self, record: CallRecord) -> None:
        """Record a new call in `record.state` (call inside `transaction()`)."""
        now = self._clock()
        self._db.execute(
            "INSERT INTO ledger_calls (call_id, lineage, branch, session_id, tool, intent_key, intent, "
            "args, occurrence, state, policy, turn, attempts, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
            [
                record.call_id,
                record.lineage,
                record.branch,
                record.session_id,
                record.tool,
                record.intent_key,
                canonical_json(record.intent),
                _json_encode(record.args).decode(),
                record.occurrence,
                record.state,
                record.policy,
                record.turn,
                now,
                now,
            ],
        )
        self._event(record.call_id, None, record.state, f"recorded by {record.session_id}")

    def transition(
        self,
        call_id: str,
        to: CallState,
        expect: Iterable[CallState],
        *,
        note: str = "",
        result: dict[str, Any] | None = None,
        error: str | None = None,
        count_attempt: bool = False,
        policy: str | None = None,
        actor: str | None = None,
        reason: str | None = None,
    ) -> str:
        """Move a call from one of `expect` to `to` (inside `transaction()`); returns the old state."""
        allowed = tuple(expect)
        row = self._db.execute("SELECT state FROM ledger_calls WHERE call_id = ?", [call_id]).fetchone()
        if row is None:
            raise InvalidState(call_id, "absent", " or ".join(allowed), "no such call in the ledger")
        if row[0] not in allowed:
            raise InvalidState(call_id, row[0], " or ".join(allowed))
        self._db.execute(
            "UPDATE ledger_calls SET state = ?, updated_at = ?, attempts = attempts + ?, "
            "result = COALESCE(?, result), error = ?, policy = COALESCE(?, policy) WHERE call_id = ?",
            [
                to,
                self._clock(),
                1 if count_attempt else 0,
                None if result is None else _json_encode(result).decode(),
                error,
                policy,
                call_id,
            ],
        )
        self._event(call_id, row[0], to, note or (error or ""), actor, reason)
        return str(row[0])

    def set_simulated(self, call_id: str, answer: dict[str, Any] | None) -> None:
        """Keep (or, with None, forget) a staged call's simulated answer, so a retry reads it again
        (inside `transaction()`)."""
        encoded = None if answer is None else _json_encode(answer).decode()
        self._db.execute("UPDATE ledger_calls SET simulated = ? WHERE call_id = ?", [encoded, call_id])
        if answer is not None:
            self._event(call_id, "staged", "staged", "answered by the replay's simulated far side")

    def _event(self, call_id: str, from_state: str | None, to_state: str, note: str, actor: str | None = None,
               reason: str | None = None) -> None:
        self._db.execute(
            "INSERT INTO ledger_events (call_id, at, from_state, to_state, note, actor, reason) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [call_id, self._clock(), from_state, to_state, note, actor, reason],
        )

    def decisions(self, call_ids: list[str]) -> dict[str, tuple[str, str]]:
        """call id -> (who, why) of the latest decision a person made about it (release, drop, resolve)."""
        found: dict[str, tuple[str, str]] = {}
        for chunk in _chunks(call_ids):
            rows = self._rows(
                f"SELECT call_id, actor, reason FROM ledger_events WHERE actor IS NOT NULL AND call_id IN "
                f"({','.join('?' * len(chunk))}) ORDER BY id", chunk)
            found.update({r["call_id"]: (r["actor"], r["reason"] or "") for r in rows})
        return found

    def agent_ids(self, call_ids: list[str]) -> dict[str, list[str]]:
        """call id -> the caller's own ids that name it (in any branch), oldest first."""
        found: dict[str, list[str]] = {}
        for chunk in _chunks(call_ids):
            rows = self._rows(
                f"SELECT DISTINCT call_id, agent_call_id FROM ledger_aliases WHERE call_id IN "
                f"({','.join('?' * len(chunk))}) ORDER BY rowid", chunk)
            for r in rows:
                found.setdefault(r["call_id"], []).append(r["agent_call_id"])
        return found

    def events(self, call_id: str) -> list[tuple[str | None, str, str]]:
        """(from, to, note) of every state change of one call, oldest first."""
        rows = self._rows(
            "SELECT from_state, to_state, note FROM ledger_events WHERE call_id = ? ORDER BY id", [call_id]
        )
        return [(r["from_state"], r["to_state"], r["note"] or "") for r in rows]

    def calls_of_session(self, session_id: str) -> list[CallRecord]:
        """Every call a session reached (in any branch), once each, in the order first reached."""
        rows = self._rows(
            "SELECT c.* FROM ledger_calls c JOIN (SELECT call_id, MIN(reached_at) AS first, MIN(rowid) AS k "
            "FROM ledger_reached WHERE session_id = ? GROUP BY call_id) r ON c.call_id = r.call_id "
            "ORDER BY r.first, r.k",
            [session_id],
        )
        return [_record(row) for row in rows]

    def of_session_like(self, session_id: str, pattern: str) -> list[CallRecord]:
        """A session's calls whose id matches a LIKE pattern (its compensations: `cmp-%`), oldest first."""
        rows = self._rows("SELECT * FROM ledger_calls WHERE session_id = ? AND call_id LIKE ? ORDER BY created_at",
                          [session_id, pattern])
        return [_record(row) for row in rows]

    def in_states(self, states: Iterable[CallState]) -> list[CallRecord]:
        """Every call currently in one of `states`."""
        wanted = list(states)
        marks = ",".join("?" * len(wanted))
        rows = self._rows(f"SELECT * FROM ledger_calls WHERE state IN ({marks}) ORDER BY created_at", wanted)
        return [_record(row) for row in rows]

    def fired_twice(self, session_id: str) -> int:
        """Calls of a session that fired more than once without a certain failure in between (must be 0)."""
        rows = self._rows(
            # Portable SQL (CASE, not a summed comparison; HAVING repeats the sum): PostgreSQL runs it too.
            """SELECT e.call_id FROM ledger_events e JOIN ledger_calls c ON c.call_id = e.call_id
               WHERE c.session_id = ? GROUP BY e.call_id
               HAVING SUM(CASE WHEN e.to_state = 'fired' THEN 1 ELSE 0 END)
                      - SUM(CASE WHEN e.from_state = 'fired' AND e.to_state = 'failed' THEN 1 ELSE 0 END)
                      - SUM(CASE WHEN e.note = 'reached again after its compensation' THEN 1 ELSE 0 END) > 1""",
            [session_id],
        )
        return len(rows)

    def count_by_state(self) -> dict[str, int]:
        """How many calls sit in each state."""
        rows = self._rows("SELECT state, COUNT(*) AS n FROM ledger_calls GROUP BY state")
        return {row["state"]: row["n"] for row in rows}

    def set_recovered_from(self, call_id: str, state: str) -> None:
        """Remember which state a call was found in at recovery (inside `transaction()`)."""
        self._db.execute("UPDATE ledger_calls SET recovered_from = ? WHERE call_id = ?", [state, call_id])

    # Occurrences and aliases --------------------------------------------------------------------

    def next_occurrence(self, branch: str, key: str) -> int:
        """Occurrence index the next call of intent `key` gets in `branch`."""
        row = self._db.execute(
            "SELECT MAX(occurrence) FROM ledger_reached WHERE branch = ? AND intent_key = ?", [branch, key]
        ).fetchone()
        # MAX+1 rather than COUNT: an inherited prefix may skip indices, and ids must never collide.
        return 0 if row[0] is None else int(row[0]) + 1

    def mark_reached(
        self, branch: str, record: CallRecord, session_id: str, turn: int | None, agent_call_id: str | None
    ) -> None:
        """Note that `branch` reached this call (inside `transaction()`)."""
        self._db.execute(
            "INSERT INTO ledger_reached (branch, call_id, lineage, session_id, intent_key, occurrence, "
            "turn, reached_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                branch,
                record.call_id,
                record.lineage,
                session_id,
                record.intent_key,
                record.occurrence,
                turn,
                self._clock(),
            ],
        )
        if agent_call_id is not None:
            self._db.execute(
                "INSERT INTO ledger_aliases (branch, agent_call_id, call_id) VALUES (?, ?, ?)",
                [branch, agent_call_id, record.call_id],
            )

    def alias(self, branch: str, agent_call_id: str) -> str | None:
        """The ledger id an agent call id names in `branch`, if it was used there."""
        row = self._db.execute(
            "SELECT call_id FROM ledger_aliases WHERE branch = ? AND agent_call_id = ?",
            [branch, agent_call_id],
        ).fetchone()
        return None if row is None else str(row[0])

    # Outbox -----------------------------------------------------------------------------------

    def hold(
        self, record: CallRecord, branch: str, session_id: str, turn: int | None, policy: HoldPolicy
    ) -> None:
        """Put a staged call in the outbox (inside `transaction()`)."""
        self._db.execute(
            "INSERT OR REPLACE INTO outbox_held (call_id, session_id, lineage, branch, turn, policy, "
            "held_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [record.call_id, session_id, record.lineage, branch, turn, policy, self._clock()],
        )

    def unhold(self, call_id: str) -> None:
        """Take a call out of the outbox (inside `transaction()`)."""
        self._db.execute("DELETE FROM outbox_held WHERE call_id = ?", [call_id])

    def held(
        self,
        *,
        session_id: str | None = None,
        turn: int | None = None,
        policy: HoldPolicy | None = None,
        branch: str | None = None,
        call_id: str | None = None,
    ) -> list[HeldEffect]:
        """Effects in the outbox, filtered by whichever of the arguments are given."""
        where, params = [], []
        for column, value in (
            ("o.call_id", call_id),
            ("o.session_id", session_id),
            ("o.turn", turn),
            ("o.policy", policy),
            ("o.branch", branch),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        rows = self._rows(
            "SELECT o.*, c.tool, c.args FROM outbox_held o JOIN ledger_calls c ON c.call_id = o.call_id"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY o.held_at, o.rowid",
            params,
        )
        return [
            HeldEffect(
                call_id=r["call_id"],
                tool=r["tool"],
                session_id=r["session_id"],
                lineage=r["lineage"],
                branch=r["branch"],
                turn=r["turn"],
                policy=r["policy"],
                held_at=r["held_at"],
                args=_json_decode(r["args"]),
            )
            for r in rows
        ]

    # Branches ---------------------------------------------------------------------------------

    def branch(self, branch: str) -> Branch | None:
        """One branch by id."""
        rows = self._rows("SELECT * FROM branches WHERE branch = ?", [branch])
        return _branch(rows[0]) if rows else None

    def branch_with_status(self, lineage: str, status: BranchStatus) -> Branch | None:
        """The lineage's branch in `status` (there is at most one live and one replay branch)."""
        rows = self._rows(
            "SELECT * FROM branches WHERE lineage = ? AND status = ? ORDER BY created_at DESC LIMIT 1",
            [lineage, status],
        )
        return _branch(rows[0]) if rows else None

    def open_operation(self, branch: str, lineage: str) -> None:
        """Record a branch operation of the lineage as open (inside `transaction()`)."""
        self._db.execute("INSERT INTO branches (branch, lineage, status, kind, created_at) VALUES (?, ?, 'open', "
                         "'replay', ?)", [branch, lineage, self._clock()])

    def attach_replay(self, branch: str, parent: str, from_turn: int) -> None:
        """Make the open branch operation `branch` a replay of `parent` (inside `transaction()`)."""
        self._db.execute("UPDATE branches SET parent = ?, from_turn = ? WHERE branch = ?", [parent, from_turn, branch])

    def create_branch(
        self, lineage: str, parent: str | None, status: BranchStatus, from_turn: int | None
    ) -> str:
        """Create the next branch of a lineage (inside `transaction()`); ids are `<lineage>#<n>`."""
        row = self._db.execute("SELECT COUNT(*) FROM branches WHERE lineage = ?", [lineage]).fetchone()
        branch = f"{lineage}#{int(row[0])}"
        self._db.execute(
            "INSERT INTO branches (branch, lineage, parent, status, from_turn, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [branch, lineage, parent, status, from_turn, self._clock()],
        )
        return branch

    def set_branch_status(self, branch: str, status: BranchStatus) -> None:
        """Change a branch's status (inside `transaction()`)."""
        self._db.execute(
            "UPDATE branches SET status = ?, finished_at = ? WHERE branch = ?",
            [status, self._clock(), branch],
        )

    def inherit_prefix(self, parent: str, branch: str, before_turn: int) -> int:
        """Copy the parent's calls of turns before `before_turn` into `branch` as reached; returns a count."""
        cursor = self._db.execute(
            "INSERT INTO ledger_reached (branch, call_id, lineage, session_id, intent_key, occurrence, "
            "turn, reached_at) SELECT ?, call_id, lineage, session_id, intent_key, occurrence, turn, "
            "reached_at FROM ledger_reached WHERE branch = ? AND turn IS NOT NULL AND turn < ?",
            [branch, parent, before_turn],
        )
        self._db.execute(
            "INSERT INTO ledger_aliases (branch, agent_call_id, call_id) SELECT ?, a.agent_call_id, "
            "a.call_id FROM ledger_aliases a JOIN ledger_reached r ON r.call_id = a.call_id "
            "AND r.branch = ? WHERE a.branch = ?",
            [branch, branch, parent],
        )
        return int(cursor.rowcount)

    def inherit_until(self, parent: str, branch: str, at: float, session_id: str | None = None) -> int:
        """Copy the parent's calls reached at or before `at` into `branch` as reached (a rollback or a fork
        keeps what happened before its point); with `session_id`, as reached by that session (a fork)."""
        cursor = self._db.execute(
            "INSERT INTO ledger_reached (branch, call_id, lineage, session_id, intent_key, occurrence, "
            "turn, reached_at) SELECT ?, call_id, lineage, COALESCE(?, session_id), intent_key, occurrence, turn, "
            "reached_at FROM ledger_reached WHERE branch = ? AND reached_at <= ?",
            [branch, session_id, parent, at],
        )
        self._db.execute(
            "INSERT INTO ledger_aliases (branch, agent_call_id, call_id) SELECT ?, a.agent_call_id, "
            "a.call_id FROM ledger_aliases a JOIN ledger_reached r ON r.call_id = a.call_id "
            "AND r.branch = ? WHERE a.branch = ?",
            [branch, branch, parent],
        )
        return int(cursor.rowcount)

    def reached_after(self, branch: str, at: float) -> list[CallRecord]:
        """Calls `branch` reached after `at`, in the order reached."""
        rows = self._rows(
            "SELECT c.* FROM ledger_reached r JOIN ledger_calls c ON c.call_id = r.call_id "
            "WHERE r.branch = ? AND r.reached_at > ? ORDER BY r.reached_at, r.rowid", [branch, at])
        return [_record(row) for row in rows]

    def unreached(self, parent: str, branch: str, states: Iterable[CallState]) -> list[CallRecord]:
        """Calls the parent reached, now in one of `states`, that `branch` did not reach."""
        wanted = list(states)
        marks = ",".join("?" * len(wanted))
        rows = self._rows(
            "SELECT c.* FROM ledger_reached p JOIN ledger_calls c ON c.call_id = p.call_id "
            f"WHERE p.branch = ? AND c.state IN ({marks}) AND p.call_id NOT IN "
            "(SELECT call_id FROM ledger_reached WHERE branch = ?) ORDER BY p.reached_at, p.rowid",
            [parent, *wanted, branch],
        )
        return [_record(row) for row in rows]


def _chunks(items: list[str], size: int = 500) -> Iterator[list[str]]:
    """Slices short enough for SQLite's limit on bound parameters."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _record(row: dict[str, Any]) -> CallRecord:
    return CallRecord(
        call_id=row["call_id"],
        tool=row["tool"],
        state=row["state"],
        session_id=row["session_id"],
        lineage=row["lineage"],
        branch=row["branch"],
        occurrence=row["occurrence"],
        intent_key=row["intent_key"],
        intent=json.loads(row["intent"]),
        args=_json_decode(row["args"]),
        policy=row["policy"],
        turn=row["turn"],
        result=None if row["result"] is None else _json_decode(row["result"]),
        simulated=None if row["simulated"] is None else _json_decode(row["simulated"]),
        error=row["error"],
        attempts=row["attempts"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        recovered_from=row["recovered_from"],
    )


def _branch(row: dict[str, Any]) -> Branch:
    return Branch(
        branch=row["branch"],
        lineage=row["lineage"],
        parent=row["parent"],
        status=row["status"],
        from_turn=row["from_turn"],
        created_at=row["created_at"],
    )

