"""Branches of a session's history, and the participants that move to one together or not at all.

A revocation (and a rollback or a fork) moves a session to another branch of its history. Whoever
opens the operation mints one `Branch` value here, and every participant that holds session state
(the sandbox's files, the firewall's ledger, provenance, the outside world, the call records) is told
to `begin` it, to `commit` it or to `abandon` it. `Branches` records the operation once, in the
`branches` table (the ledger's branches live there too): `open` while it runs, `committing` once its
commit started, then `committed` or `abandoned`. A commit is repeated after a crash until every
participant has done it (each participant's commit is idempotent), and an open branch found at start-up
is abandoned, so a crash leaves the session before or after the operation, never between.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import msgspec

from sandboxd import protocol as p
from sandboxd.db import Database
from sandboxd.errors import InvalidState

BranchKind = Literal["replay", "rollback", "fork"]
BranchStatus = Literal["live", "open", "committing", "superseded", "abandoned"]


def new_branch_id() -> str:
    """The one id format of a branch, live or not (`br-` and 12 hex digits): opaque, never parsed."""
    return "br-" + uuid.uuid4().hex[:12]


class Branch(msgspec.Struct, frozen=True, kw_only=True):
    """One branch operation of a session: minted once, carried by every participant."""

    id: str
    session_id: str
    kind: BranchKind
    splice: p.CheckpointRecord
    """The checkpoint the branch starts from: everything before it is shared with the live history."""

    @property
    def from_turn(self) -> int:
        """The first turn the branch re-decides (turns before the splice are not replayed)."""
        return self.splice.turn + 1


class Participant(Protocol):
    """What holds a share of a session's state and moves with its branches."""

    name: str

    def begin(self, branch: Branch) -> None:
        """Open the branch: from now on the session's work is recorded under it."""
        ...

    def commit(self, branch: Branch) -> dict[str, Any]:
        """Make the branch the session's; idempotent (repeated after a crash part-way through).
        Returns what the participant has to report (orphaned effects, say)."""
        ...

    def abandon(self, branch: Branch) -> None:
        """Throw the branch away and put the session back as it was; idempotent."""
        ...


class BranchRow(msgspec.Struct, kw_only=True):
    """A row of the `branches` table: a branch operation's, or a firewall ledger's line of calls (its live
    branch, or a replay beside it), one table and one row type for both."""

    branch: str
    lineage: str
    status: BranchStatus
    kind: str | None = None
    splice: str | None = None
    parent: str | None = None
    from_turn: int | None = None
    created_at: float = 0.0
    finished_at: float | None = None


class Branches:
    """Opens, commits and abandons branch operations over a fixed list of participants, in order.

    The last participant is the firewall's ledger, whose commit (or abandon) marks the branch live (or
    abandoned) in the one row this operation shares with it: once that is done every other participant has
    done its part, so a crash is either before it (`unfinished` finds the operation and it is finished
    again) or after it (nothing is left to do)."""

    def __init__(self, db: Database, participants: Sequence[Participant],
                 reached: Callable[[str], None] = lambda _point: None) -> None:
        self.db = db
        self.participants = list(participants)
        self.reached = reached
        """Told each point an operation passes (begun, committing, committed:NAME): crash tests stop there."""

    def open(self, session_id: str, kind: BranchKind, splice: p.CheckpointRecord) -> Branch:
        """Mint a branch and begin it in every participant; if one fails, those begun abandon it."""
        branch = Branch(id=new_branch_id(), session_id=session_id, kind=kind, splice=splice)
        open_ = self.open_branch(session_id)
        if open_ is not None:
            raise InvalidState(open_.id, "open", "no open branch", f"{open_.kind} {open_.id} of {session_id} is "
                               "still open: commit or abandon it first")
        # Durable, not at the request's end: a crash must find the branch open once any participant acted.
        with self.db.transaction(durable=True):
            self.db.insert("branches", BranchRow(branch=branch.id, lineage=session_id, status="open", kind=kind,
                                                 splice=msgspec.json.encode(splice).decode(),
                                                 from_turn=branch.from_turn, created_at=time.time()))
        begun: list[Participant] = []
        try:
            for participant in self.participants:
                participant.begin(branch)
                begun.append(participant)
        except BaseException:
            for participant in reversed(begun):
                participant.abandon(branch)
            self._finish(branch.id, "abandoned")
            raise
        self.reached("begun")
        return branch

    def commit(self, branch: Branch) -> dict[str, dict[str, Any]]:
        """Commit the branch in every participant, in order; safe to repeat after a crash."""
        with self.db.transaction(durable=True):  # on disk before a participant commits (see `open`)
            self.db.update("branches", {"branch": branch.id}, status="committing")
        self.reached("committing")
        reports = {}
        for participant in self.participants:
            reports[participant.name] = participant.commit(branch)
            self.reached(f"committed:{participant.name}")
        self._finish(branch.id, "committed")
        return reports

    def abandon(self, branch: Branch) -> None:
        """Abandon the branch in every participant, in order."""
        for participant in self.participants:
            participant.abandon(branch)
        self._finish(branch.id, "abandoned")

    def _finish(self, branch_id: str, outcome: str) -> None:
        # A committed operation's branch is the ledger's live one from now on (the firewall marked it live);
        # only the operation's own record changes here.
        with self.db.transaction():
            self.db.execute("UPDATE branches SET kind = COALESCE(kind, 'replay'), finished_at = ?, "
                            "status = CASE WHEN status IN ('open', 'committing') THEN ? ELSE status END "
                            "WHERE branch = ?", [time.time(), "abandoned" if outcome == "abandoned" else "live",
                                                 branch_id])

    # Reading -----------------------------------------------------------------------------------

    def get(self, branch_id: str) -> tuple[Branch, str] | None:
        """A branch operation by id, with its status."""
        row = self.db.struct("SELECT * FROM branches WHERE branch = ? AND splice IS NOT NULL", [branch_id], BranchRow)
        return None if row is None else (_branch(row), row.status)

    def open_branch(self, session_id: str) -> Branch | None:
        """The session's branch operation that is open (at most one), if any."""
        row = self.db.struct("SELECT * FROM branches WHERE lineage = ? AND status IN ('open', 'committing') "
                             "AND splice IS NOT NULL", [session_id], BranchRow)
        return None if row is None else _branch(row)

    def unfinished(self) -> list[tuple[Branch, str]]:
        """Every operation a crash left open or committing, oldest first."""
        rows = self.db.structs("SELECT * FROM branches WHERE status IN ('open', 'committing') AND splice IS NOT NULL "
                               "ORDER BY created_at", [], BranchRow)
        return [(_branch(row), row.status) for row in rows]


def _branch(row: BranchRow) -> Branch:
    assert row.splice is not None and row.kind is not None, f"branch {row.branch} is not an operation's"
    return Branch(id=row.branch, session_id=row.lineage, kind=row.kind,  # type: ignore[arg-type]
                  splice=msgspec.json.decode(row.splice, type=p.CheckpointRecord))

