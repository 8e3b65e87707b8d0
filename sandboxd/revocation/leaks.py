"""What is left after a revocation's erasure: the leak scan, by meaning and by bytes, each hit with its reason.

By meaning: every content cell of the session's records (decoded, as the filter reads it) and the
blocks of the agent's context. By bytes: everything under the state directory (the database with its
WAL, the log), the session's snapshot store and its sandbox's scratch space, for every byte form of
every form of the target. A hit either has a reason it may stay (the sandbox's own files, which the
counterfactual world holds too; what the agent wrote itself in the replay; what an effect sent) or it
is a leak; the report lists every hit with its reason and never says a hit is something it is not.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandboxd import protocol as p
from sandboxd.db import Database
from sandboxd.revocation.erasure import (
    AGENT_WROTE_IT,
    CONTENT_COLUMNS,
    MIN_NEEDLE_BYTES,
    SENT_OUT,
    SYSTEM_PROMPT,
    Exempt,
    cells,
    distinctive,
    minted,
)
from sandboxd.revocation.forgetting import ForgetFilter, field_name
from sandboxd.revocation.leakscan import Hit, LeakReport, scan_paths

#: artifacts the model writes (as opposed to what it reads)
AGENT_TYPES = ("model_turn", "plan", "tool_call", "reply", "summary")
#: ledger states of an effect that reached (or may have reached) the outside world
SENT_STATES = ("fired", "released", "done", "orphaned", "unknown")
#: what under the state directory holds no data: the daemon's own code, its sockets, its salt, and the
#: outside world's environments (which keep what they were sent, as any far side does)
NOT_DATA = ("snapshots", "bin", "ctl", "forget.salt", "worlds")
#: why database bytes that no content says may stay
STRUCTURE = ("spelled by the daemon's own structure (a table's definition; a field name or number of a record or a "
             "log line; an id, a tool's name or a state it writes), not by any content: the counterfactual world's "
             "records hold it too")


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
        # Told apart by their labels before the names are filtered: a label may spell the target (`sandbox:`).
        environment = [forget.text(w) for w, r in self.found if w.startswith(("sandbox:", "container:")) and r]
        found = [(forget.text(where), reason) for where, reason in self.found]
        counterfactual = environment + [w for w, r in found if r in (AGENT_WROTE_IT, SYSTEM_PROMPT, STRUCTURE)]
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
                 file_trees: Callable[[str], list[Path]], scan_scratch: Callable[[str, list[bytes]], LeakReport],
                 context: Callable[[str], list[p.Artifact]]) -> None:
        self.db = db
        self.salt = salt
        self.state_dir = state_dir
        self.store_paths = store_paths
        self.file_trees = file_trees
        """The directories of the store whose entries the sandbox named (the rest the store named)."""
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
        structure: dict[str, Spellings] = {}
        for hit in db_hits:
            name = Path(hit.location).relative_to(self.state_dir).as_posix()
            store = "database" if name.startswith("state.db") else "log" if name.startswith("sandboxd.log") else ""
            reason = db_reason if store == "database" else ""
            if hit.part == "name":  # the state directory's own files, named by the daemon
                reason = STRUCTURE
            elif not reason and store:
                # Read only now, as a target the structure spells is rare: this reads every row, or the log.
                key = "state.db" if store == "database" else name
                if key not in structure:
                    structure[key] = Spellings.of_database(self.db) if store == "database" else \
                        Spellings.of_log(Path(hit.location))
                reason = STRUCTURE if structure[key].spell(hit, binary[hit.needle]) else ""
            scan.add(f"{name}@{hit.offset}", reason)
        scan.locations_checked += len(shared)
        root = str(self.state_dir) + "/"
        files = [path for path in self.store_paths(session_id) if path.is_dir()]
        live = scan_paths(needles, files)
        trees = [str(tree) + "/" for tree in self.file_trees(session_id)]
        for hit in [hit for hit in live.hits if hit.part == "name" and not hit.location.startswith(tuple(trees))]:
            live.hits.remove(hit)  # a name the store gave (`snapshots`, `stack.json`): no file of the sandbox's
            scan.add(f"store:{hit.location.removeprefix(root)}@{hit.offset}", STRUCTURE)
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


#: a JSON string token (the record is valid JSON, so quotes outside strings do not occur)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_KEY_COLON = re.compile(r"\s*:")
#: bytes of a spelling compared on each side of a hit: a record split over an overflow page breaks one side
_CONTEXT = 16


def skeleton(text: str) -> list[str]:
    """The runs of a JSON record's text that carry no content: its syntax, numbers, literals and field names,
    which the filter reads as structure (`ForgetFilter.holds_record`). Every string value, and a key that is
    content used as a key, ends a run. Text that is not JSON has none."""
    if text.lstrip()[:1] not in ("{", "["):
        return []
    try:
        json.loads(text)
    except ValueError:
        return []
    runs, position = [], 0
    for match in _JSON_STRING.finditer(text):
        if _KEY_COLON.match(text, match.end()) and field_name(json.loads(match.group())):
            continue
        runs.append(text[position:match.start() + 1])
        position = match.end() - 1
    runs.append(text[position:])
    return [run for run in runs if run]


class Spellings:
    """What the daemon's stores spell by their structure alone (see `of_database` and `of_log`). A hit whose
    bytes are inside one of these spellings is structure: the counterfactual world's stores spell it too."""

    def __init__(self, texts: list[str]) -> None:
        self.spellings = {text.encode("utf-8", "surrogatepass") for text in texts}
        self._holding: dict[bytes, list[bytes]] = {}

    @classmethod
    def of_database(cls, db: Database) -> Spellings:
        """Its schema, every value of a column that holds no content (ids, tool names, states, hashes:
        `erasure.CONTENT_COLUMNS` names the others), and the skeleton of every JSON record of a content column."""
        texts: list[str] = []
        for row in db.rows("SELECT type, name, tbl_name, sql FROM sqlite_master"):
            texts += [value for value in row.values() if isinstance(value, str)]
        for table in [row["name"] for row in db.rows("SELECT name FROM sqlite_master WHERE type = 'table'")]:
            content = CONTENT_COLUMNS.get(table, ())
            for row in db.rows(f'SELECT * FROM "{table}"'):
                for column, value in row.items():
                    if isinstance(value, str):
                        texts += skeleton(value) if column in content else [value]
        return cls(texts)

    @classmethod
    def of_log(cls, path: Path) -> Spellings:
        """The skeleton of every line of the daemon's log (one JSON record a line): its field names and numbers.
        Its messages are values, so a message that says the target is no structure."""
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            return cls([run for line in fh for run in skeleton(line)])

    def spell(self, hit: Hit, needle: bytes) -> bool:
        """Whether the bytes around `hit` (of `needle`, in a file of the store) are one of the spellings."""
        if hit.part != "content":
            return False
        holding = self._holding.setdefault(needle, [s for s in self.spellings if needle in s])
        if not holding:
            return False
        fd = os.open(hit.location, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return any(_around(fd, hit.offset, spelling, needle) for spelling in holding)
        finally:
            os.close(fd)


def _around(fd: int, offset: int, spelling: bytes, needle: bytes) -> bool:
    """Whether `needle` at `offset` of the file is an occurrence of it inside `spelling`, told by the bytes on
    either side of it (a record split over an overflow page breaks at most one side)."""
    index = spelling.find(needle)
    while index != -1:
        left = spelling[max(0, index - _CONTEXT):index]
        right = spelling[index + len(needle):index + len(needle) + _CONTEXT]
        if offset >= len(left):
            around = os.pread(fd, len(left) + len(needle) + len(right), offset - len(left))
            if around[:len(left)] == left or around[len(left) + len(needle):] == right:
                return True
        index = spelling.find(needle, index + 1)
    return False


def _grouped(found: list[tuple[str, str]]) -> list[str]:
    """One line per place (a file, a table column) and reason: how many hits, where, and why they stay."""
    places: dict[tuple[str, str], int] = {}
    for where, reason in found:
        place = where.rsplit("@", 1)[0] if "@" in where else where.split("[", 1)[0]
        places[place, reason] = places.get((place, reason), 0) + 1
    return [f"{place} ({count} {'hit' if count == 1 else 'hits'}): "
            f"{reason or 'still holds it after erasure; the cause is not known'}"
            for (place, reason), count in places.items()]
