"""What is left after a revocation's erasure: the leak scan, by meaning and by bytes, each hit with its reason.

By meaning: every content cell of the session's records (decoded, as the filter reads it) and the
blocks of the agent's context. By bytes: everything under the state directory (the database with its
WAL, the log), the session's snapshot store and its sandbox's scratch space, for every byte form of
every form of the target. A hit either has a reason it may stay (the sandbox's own files, which the
counterfactual world holds too; what the agent wrote itself in the replay; what an effect sent) or it
is a leak; the report lists every hit with its reason and never says a hit is something it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandboxd import protocol as p
from sandboxd.db import Database
from sandboxd.revocation.erasure import (
    AGENT_WROTE_IT,
    MIN_NEEDLE_BYTES,
    SENT_OUT,
    SYSTEM_PROMPT,
    Exempt,
    cells,
    distinctive,
    minted,
)
from sandboxd.revocation.forgetting import ForgetFilter
from sandboxd.revocation.leakscan import LeakReport, scan_paths

#: artifacts the model writes (as opposed to what it reads)
AGENT_TYPES = ("model_turn", "plan", "tool_call", "reply", "summary")
#: ledger states of an effect that reached (or may have reached) the outside world
SENT_STATES = ("fired", "released", "done", "orphaned", "unknown")
#: what under the state directory holds no data: the daemon's own code, its sockets, its salt, and the
#: outside world's environments (which keep what they were sent, as any far side does)
NOT_DATA = ("snapshots", "bin", "ctl", "forget.salt", "worlds")


@dataclass
class LeakScan:
    """The hits of one scan, each with where it is and why it may stay (empty reason: it must not)."""

    locations_checked: int = 0
    found: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """What was not searched, and why."""

    def add(self, location: str, reason: str = "") -> None:
        self.found.append((location, reason))

    def extend(self, report: LeakReport, label: str, reason: str, strip: str = "") -> None:
        self.locations_checked += report.locations_checked
        for hit in report.hits:
            self.add(f"{label}{hit.location.removeprefix(strip)}@{hit.offset}", reason)
        for skipped in report.skipped:
            self.add(f"{label}{skipped.removeprefix(strip)}", "could not be read, so not searched")

    @property
    def unexplained(self) -> list[str]:
        return [where for where, reason in self.found if not reason]

    def summary(self, forget: ForgetFilter) -> tuple[dict[str, Any], list[str]]:
        """The report's `leak_scan` and its `not_erased` lines. A location may name a file whose name is the
        target: `forget` takes it out of the report too."""
        found = [(forget.text(where), reason) for where, reason in self.found]
        environment = [w for w, r in found if w.startswith(("sandbox:", "container:")) and r]
        counterfactual = environment + [w for w, r in found if r in (AGENT_WROTE_IT, SYSTEM_PROMPT)]
        sent = [w for w, r in found if r == SENT_OUT]
        leaks = [w for w, r in found if not r]
        leak = {"locations_checked": self.locations_checked, "hits": len(leaks), "where": leaks,
                "counterfactual_hits": len(counterfactual), "counterfactual_where": counterfactual,
                "environment_hits": len(environment), "environment_where": environment,
                "sent_hits": len(sent), "sent_where": sent,
                "other_sessions": sum(1 for _, r in found if r.startswith("another session")),
                "skipped": self.skipped}
        return leak, _grouped(found)


def scan_cells(db: Database, forget: ForgetFilter, session_id: str, exempt: Exempt,
               everyone: bool = False) -> LeakScan:
    """Every content cell of the session's rows (of every row, with `everyone`), read as the filter reads it
    (decoded views, whitespace folded)."""
    scan = LeakScan()
    for table, column, rowid, value, row in cells(db, None if everyone else session_id):
        scan.locations_checked += 1
        if not minted(column, value) and forget.holds_record(value):
            owner = row.get("session_id")
            reason = exempt(table, column.name, row) or ("" if owner in (None, session_id) else
                                                         f"another session ({owner}) holds it in its own record: "
                                                         "not this session's to forget")
            scan.add(f"state.db:{table}.{column.name}[{rowid}]", reason)
    return scan


def kept_cells(session_id: str, branch: str, since: float) -> Exempt:
    """Cells that keep what they say after a revocation of `session_id` replayed as `branch`, and why.

    What the agent wrote itself after the splice (its turns, plans, replies, summaries and the arguments of
    its calls): the replay decoded them from a context without the target, so if they hold it, the
    counterfactual agent wrote it too; rewriting them would make the record something no run of the agent
    produced. What an effect already sent (a fired call's arguments): the far side has it, and an operator
    needs it to compensate the effect. The scan reports both instead of hiding them."""

    def kept(table: str, column: str, row: dict[str, Any]) -> str:
        if row.get("session_id") != session_id:
            return ""
        if table == "prov_artifacts":
            if column == "content" and row.get("type") == "system":
                return SYSTEM_PROMPT  # the agent's engine keeps it too: the record stays what the agent read
            return AGENT_WROTE_IT if column in ("content", "meta") and row.get("type") in AGENT_TYPES else ""
        if table == "calls":  # the old suffix's calls are deleted by now: the later ones are the replay's
            return AGENT_WROTE_IT if column == "args" and (row.get("created_at") or 0.0) > since else ""
        if table == "ledger_calls" and column in ("args", "intent"):
            if row.get("state") in SENT_STATES:
                return SENT_OUT
            return AGENT_WROTE_IT if row.get("branch") == branch else ""
        return ""

    return kept


class LeakScanner:
    """Scans one session's state for one revoked target (see the module docstring)."""

    def __init__(self, db: Database, salt: bytes, state_dir: Path, store_paths: Callable[[str], list[Path]],
                 scan_scratch: Callable[[str, list[bytes]], LeakReport],
                 context: Callable[[str], list[p.Artifact]]) -> None:
        self.db = db
        self.salt = salt
        self.state_dir = state_dir
        self.store_paths = store_paths
        self.scan_scratch = scan_scratch
        self.context = context
        """The session's recorded context blocks, whose text the agent's engine holds."""

    def scan(self, session_id: str, wanted: ForgetFilter, needles: list[bytes], kept: Exempt) -> LeakScan:
        """Where `wanted` (one revoked target's filter) still finds it, by meaning in the records and by its
        byte forms `needles` (`erasure.byte_needles`) in files, pages, the sandbox and the agent's context."""
        scan = scan_cells(self.db, wanted, session_id, kept)
        shared = [path for path in self.state_dir.iterdir() if path.name not in NOT_DATA]
        binary = [n for n in needles if distinctive(n)]
        if len(binary) < len(needles):
            scan.skipped.append(f"byte forms under {MIN_NEEDLE_BYTES} bytes were not searched in the database pages, "
                                "the log and the disk image: so short a value occurs in such files by chance; the "
                                "records holding content were read by meaning instead")
        db_hits = scan_paths(binary, shared).hits if binary else []
        if any(Path(h.location).name.startswith("state.db") for h in db_hits) and not scan.found:
            # Bytes in the database that no cell of this session explains: another session's rows, or pages
            # a vacuum has not rewritten yet. Only now is every session's record read to tell which.
            others = scan_cells(self.db, wanted, session_id, kept, everyone=True)
            scan.found += [(where, reason) for where, reason in others.found if reason.startswith("another")]
        explained = [reason for where, reason in scan.found if reason and where.startswith("state.db")]
        db_reason = explained[0] if explained and not scan.unexplained else ""
        for hit in db_hits:
            name = Path(hit.location).relative_to(self.state_dir).as_posix()
            scan.add(f"{name}@{hit.offset}", db_reason if name.startswith("state.db") else "")
        scan.locations_checked += len(shared)
        root = str(self.state_dir) + "/"
        files = [path for path in self.store_paths(session_id) if path.is_dir()]
        live = scan_paths(needles, files)
        scan.extend(live, "sandbox:", "the sandbox's files as the replay left them, snapshot layers kept for "
                    "checkpoints before tau included: the counterfactual world holds them too", root)
        for image in (path for path in self.store_paths(session_id) if path.is_file() and binary):
            scan.extend(scan_paths(binary, [image]), "sandbox:image:", "blocks of the disk image holding the "
                        "sandbox files above" if live.hits else "", root)
        # What only the sandbox holds is its scratch tmpfs, read as its runtime allows (gVisor keeps it
        # in its own kernel); hits are located by their paths in the sandbox.
        scan.extend(self.scan_scratch(session_id, needles), "container:", "the sandbox's scratch space as the "
                    "replay left it: the counterfactual world holds it too")
        scan.locations_checked += 1
        for reason in self._context_reasons(session_id, wanted):
            scan.add("agent:context", reason)
        return scan

    def _context_reasons(self, session_id: str, wanted: ForgetFilter) -> list[str]:
        """Why the agent's context (its recorded blocks) may spell the target, one line per cause (none: it
        does not); one empty reason (a leak) when a block the agent read says it."""
        reasons: list[str] = []
        for artifact in self.context(session_id):
            if artifact.type in p.OBSERVATION_TYPES and wanted.holds_record(artifact.content):
                return [""]
            if artifact.type == "system" and wanted.holds(artifact.content):
                reason = SYSTEM_PROMPT
            elif artifact.type in AGENT_TYPES and wanted.holds(artifact.content):
                reason = AGENT_WROTE_IT
            else:
                continue
            if reason not in reasons:  # every cause is reported, not only the first block's
                reasons.append(reason)
        return reasons


def _grouped(found: list[tuple[str, str]]) -> list[str]:
    """One line per place (a file, a table column) and reason: how many hits, where, and why they stay."""
    places: dict[tuple[str, str], int] = {}
    for where, reason in found:
        place = where.rsplit("@", 1)[0] if "@" in where else where.split("[", 1)[0]
        places[place, reason] = places.get((place, reason), 0) + 1
    return [f"{place} ({count} {'hit' if count == 1 else 'hits'}): "
            f"{reason or 'still holds it after erasure; the cause is not known'}"
            for (place, reason), count in places.items()]
