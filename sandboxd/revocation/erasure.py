"""Physical forgetting once a revocation commits: scrub what the daemon keeps, then look for what is left.

`scrub_database` walks every text cell of every table (the ledger's arguments and results, call
records and their ids, provenance content, snapshot labels, reports) and filters it; a key cell (an
agent's call id made from a value, `seed/<name>`) is replaced whole by a salted digest, since half an
id is neither the id nor clean. `scrub_log` rewrites the daemon's log in place, line by line.

`LeakScan` then searches, by meaning and by bytes: every text cell again (decoded, as the filter
reads it), and the bytes of everything under the state directory, the session's snapshot store and
its container's scratch space, for every byte form of every form of the target. Each hit is either
gone after a second round of erasure (VACUUM, trim) or kept in the report with the real reason it
could not be erased; the report never says a hit is something it is not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sandboxd.revocation.forgetting import ForgetFilter, fingerprints_for, piece_fingerprints, target_forms
from sandboxd.revocation.leakscan import LeakReport

log = logging.getLogger("sandboxd")

#: fingerprints only: what forgetting is allowed to keep
_KEPT_TABLES = frozenset({"forgotten"})


def needles_for_forms(forms: list[str]) -> list[bytes]:
    """Every byte form the project could have written each form in: UTF-8, UTF-16 (both orders), JSON
    (ASCII-escaped, raw, and escaped twice), MessagePack and percent-encoding."""
    out: list[bytes] = []
    for form in forms:
        escaped = json.dumps(form)[1:-1]
        out += [form.encode("utf-8", "surrogatepass"), form.encode("utf-16-le", "surrogatepass"),
                form.encode("utf-16-be", "surrogatepass"), escaped.encode(),
                json.dumps(form, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass"),
                json.dumps(escaped)[1:-1].encode(), msgspec.msgpack.encode(form),
                urllib.parse.quote(form, safe="").encode()]
    return [needle for needle in dict.fromkeys(out) if needle]


def redacted_id(value: str, salt: bytes) -> str:
    """A stable stand-in for a key that held a forgotten value: unique per value, says nothing of it."""
    return "redacted-" + hmac.new(salt, b"sandboxd.redacted-id\x00" + value.encode("utf-8", "surrogatepass"),
                                  hashlib.sha256).hexdigest()[:20]


@dataclass
class _Column:
    name: str
    key: bool


def _text_columns(conn: sqlite3.Connection) -> dict[str, list[_Column]]:
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                         "AND name NOT LIKE 'sqlite_%'")]
    out: dict[str, list[_Column]] = {}
    for table in tables:
        if table in _KEPT_TABLES:
            continue
        columns = [_Column(name=row[1], key=bool(row[5])) for row in conn.execute(f'PRAGMA table_info("{table}")')
                   if (row[2] or "TEXT").upper() in ("TEXT", "")]
        if columns:
            out[table] = columns
    return out


Exempt = Callable[[str, str, dict[str, Any]], bool]
"""(table, column, row) -> whether the cell is the agent's own writing in the replayed branch, kept."""

#: the reason an exempt cell may keep a forgotten value
AGENT_WROTE_IT = ("written by the agent itself in the replay, from a context that never held it: the "
                  "counterfactual agent writes it too")


def _session_rows(conn: sqlite3.Connection, table: str, session_id: str | None) -> tuple[str, list[str]]:
    """The WHERE clause selecting a session's rows of `table` (every row when it names no session)."""
    columns = {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}
    if session_id is None:
        return "1", []
    if "session_id" in columns:
        return "session_id = ?", [session_id]
    if "lineage" in columns:
        return "lineage = ?", [session_id]
    if table == "ledger_aliases":
        return "branch IN (SELECT branch FROM ledger_branches WHERE lineage = ?)", [session_id]
    if table == "ledger_events":
        return "call_id IN (SELECT call_id FROM ledger_calls WHERE session_id = ?)", [session_id]
    return "1", []


def _cells(conn: sqlite3.Connection, session_id: str | None = None
           ) -> list[tuple[str, _Column, int, str, dict[str, Any]]]:
    """(table, column, rowid, text, row) for every text cell of the database (of one session's rows)."""
    cells = []
    for table, columns in _text_columns(conn).items():
        where, params = _session_rows(conn, table, session_id)
        cursor = conn.execute(f'SELECT rowid AS "__rowid", * FROM "{table}" WHERE {where}', params)
        names = [d[0] for d in cursor.description]
        for values in cursor.fetchall():
            row = dict(zip(names, values, strict=True))
            for column in columns:
                value = row.get(column.name)
                if isinstance(value, str) and value:
                    cells.append((table, column, row["__rowid"], value, row))
    return cells


def scrub_database(conn: sqlite3.Connection, lock: threading.RLock, forget: ForgetFilter, session_id: str,
                   exempt: Exempt) -> int:
    """Filter every text cell of the session's rows that holds a forgotten value (keys replaced by a digest)
    unless `exempt`; returns how many cells changed."""
    changed = 0
    with lock:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table, column, rowid, value, row in _cells(conn, session_id):
                if exempt(table, column.name, row) or not forget.holds(value):
                    continue
                clean = redacted_id(value, forget.salt) if column.key else forget.json_text(value)
                conn.execute(f'UPDATE "{table}" SET "{column.name}" = ? WHERE rowid = ?', [clean, rowid])
                changed += 1
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    return changed


def scrub_log(path: Path, forget: ForgetFilter) -> int:
    """Rewrite the daemon's log in place without any forgotten value; returns how many lines changed.

    In place, under the log handler's own lock, so a line logged meanwhile is neither lost nor written
    into the old file; the handler appends (O_APPEND), so it goes on writing at the new end."""
    if not path.exists():
        return 0
    handler = next((h for h in logging.getLogger("sandboxd").handlers
                    if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve()), None)
    if handler is not None:
        handler.acquire()
    try:
        if handler is not None:
            handler.flush()
        with open(path, "r+b") as fh:
            lines = fh.read().decode("utf-8", "surrogateescape").splitlines(keepends=True)
            clean = [_clean_line(line, forget) for line in lines]
            changed = sum(a != b for a, b in zip(lines, clean, strict=True))
            if changed:
                fh.seek(0)
                fh.write("".join(clean).encode("utf-8", "surrogateescape"))
                fh.truncate()
                fh.flush()
                os.fsync(fh.fileno())
        return changed
    finally:
        if handler is not None:
            handler.release()


def _clean_line(line: str, forget: ForgetFilter) -> str:
    if not forget.holds(line):
        return line
    body = line.rstrip("\n")
    try:
        entry = json.loads(body)
    except ValueError:
        return forget.text(body) + "\n"
    return json.dumps(forget.value(entry)) + "\n"


@dataclass
class LeakScan:
    """The hits of one scan, each with where it is and why it may stay (empty reason: it must not)."""

    locations_checked: int = 0
    found: list[tuple[str, str]] = field(default_factory=list)

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


def scan_cells(conn: sqlite3.Connection, lock: threading.RLock, forget: ForgetFilter, session_id: str,
               exempt: Exempt, everyone: bool = False) -> LeakScan:
    """Every text cell of the session's rows (of every row, with `everyone`), read as the filter reads it
    (decoded views, whitespace folded)."""
    scan = LeakScan()
    with lock:
        cells = _cells(conn, None if everyone else session_id)
    for table, column, rowid, value, row in cells:
        scan.locations_checked += 1
        if forget.holds(value):
            owner = row.get("session_id")
            reason = AGENT_WROTE_IT if exempt(table, column.name, row) else "" if owner in (None, session_id) else \
                f"another session ({owner}) holds it in its own record: not this session's to forget"
            scan.add(f"state.db:{table}.{column.name}[{rowid}]", reason)
    return scan


def target_filter(target: str, pieces: list[str], salt: bytes) -> ForgetFilter:
    """A filter that finds one revoked target (and its pieces) in every form, for the scan."""
    return ForgetFilter([*fingerprints_for(target, salt), *piece_fingerprints(pieces, salt)], salt)


def byte_needles(target: str, pieces: list[str]) -> list[bytes]:
    """Needles of the target's forms and of the pieces of a split target."""
    return needles_for_forms([*target_forms(target), *(p for p in pieces if p.strip())])

