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
import re
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


_ID_ALPHABETS = ("0123456789", "ABCDEFGHJKLMNPQRSTUVWXYZ", "abcdefghijkmnpqrstuvwxyz")


def redacted_id(value: str, forget: ForgetFilter) -> str:
    """A stable stand-in for a key that held a forgotten value: unique per value, says nothing of it, and
    spells no forgotten value either (a one-character target is in any hex digest: one of three
    alphabets without a common character avoids it)."""
    digest = int.from_bytes(hmac.new(forget.salt, b"sandboxd.redacted-id\x00" + value.encode("utf-8", "surrogatepass"),
                                     hashlib.sha256).digest()[:12], "big")
    for alphabet in _ID_ALPHABETS:
        number, spelled = digest, []
        while number:
            number, digit = divmod(number, len(alphabet))
            spelled.append(alphabet[digit])
        candidate = "".join(spelled)
        if not forget.holds(candidate):
            return candidate
    raise AssertionError("no alphabet spells a redacted id without the forgotten values")


#: The cells that carry content from tool results, the agent or operators: what erasure filters and scans.
#: Every other column is structure (ids the daemon mints, states, hashes, positions), which can spell a
#: short target only by chance (`0` in a hex id) and is never rewritten.
CONTENT_COLUMNS: dict[str, tuple[str, ...]] = {
    "calls": ("call_id", "args", "result"),
    "ledger_calls": ("intent", "args", "result", "simulated", "error"),
    "ledger_aliases": ("agent_call_id",),
    "ledger_events": ("note",),
    "prov_artifacts": ("content", "meta"),
    "snapshots": ("label",),
    "revocations": ("target", "pieces", "report", "error"),
}
#: Content that is also a key: an id the agent chose (`seed/<name>`). Half an id is neither the id nor
#: clean, so a key that holds a forgotten value is replaced whole by a digest.
KEY_COLUMNS = frozenset({("calls", "call_id"), ("ledger_aliases", "agent_call_id")})


@dataclass
class _Column:
    name: str
    key: bool


def _text_columns(conn: sqlite3.Connection) -> dict[str, list[_Column]]:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {table: [_Column(name=c, key=(table, c) in KEY_COLUMNS) for c in columns]
            for table, columns in CONTENT_COLUMNS.items() if table in tables}


Exempt = Callable[[str, str, dict[str, Any]], str]
"""(table, column, row) -> why the cell keeps what it says (the agent's own writing in the replay, what an
effect sent to the outside world), or "" when it must be scrubbed."""

#: the reason an exempt cell may keep a forgotten value
AGENT_WROTE_IT = ("written by the agent itself in the replay, from a context that never held it: the "
                  "counterfactual agent writes it too")
SENT_OUT = ("what an external effect sent to the outside world: the far side holds it anyway, and the ledger keeps "
            "it so the effect can be compensated")


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


_MINTED_CALL_ID = re.compile(r"c-[0-9a-f]{32}")


def minted(column: _Column, value: str) -> bool:
    """A call id the daemon minted (random): it can spell a short target only by chance, and is no content."""
    return column.key and _MINTED_CALL_ID.fullmatch(value) is not None


def distinctive(needle: bytes) -> bool:
    """Whether finding these bytes in a binary store (a database page, a disk image, a log) means anything:
    a needle of a few bytes is in any such file by chance (`:` in every JSON record)."""
    return len(needle) >= MIN_NEEDLE_BYTES


#: shorter byte forms are not searched in binary stores (see `distinctive`); their records are read by meaning
MIN_NEEDLE_BYTES = 8


def scrub_database(conn: sqlite3.Connection, lock: threading.RLock, forget: ForgetFilter, session_id: str,
                   exempt: Exempt) -> int:
    """Filter every text cell of the session's rows that holds a forgotten value (keys replaced by a digest)
    unless `exempt`; returns how many cells changed."""
    changed = 0
    with lock:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table, column, rowid, value, row in _cells(conn, session_id):
                if exempt(table, column.name, row) or minted(column, value) or not forget.holds_record(value):
                    continue
                clean = redacted_id(value, forget) if column.key else forget.json_text(value)
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
    if not forget.holds_record(line):
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


def scan_cells(conn: sqlite3.Connection, lock: threading.RLock, forget: ForgetFilter, session_id: str,
               exempt: Exempt, everyone: bool = False) -> LeakScan:
    """Every text cell of the session's rows (of every row, with `everyone`), read as the filter reads it
    (decoded views, whitespace folded)."""
    scan = LeakScan()
    with lock:
        cells = _cells(conn, None if everyone else session_id)
    for table, column, rowid, value, row in cells:
        scan.locations_checked += 1
        if not minted(column, value) and forget.holds_record(value):
            owner = row.get("session_id")
            reason = exempt(table, column.name, row) or ("" if owner in (None, session_id) else
                      f"another session ({owner}) holds it in its own record: not this session's to forget")
            scan.add(f"state.db:{table}.{column.name}[{rowid}]", reason)
    return scan


def target_filter(target: str, pieces: list[str], salt: bytes) -> ForgetFilter:
    """A filter that finds one revoked target (and its pieces) in every form, for the scan."""
    return ForgetFilter([*fingerprints_for(target, salt), *piece_fingerprints(pieces, salt)], salt)


def byte_needles(target: str, pieces: list[str]) -> list[bytes]:
    """Needles of the target's forms and of the pieces of a split target."""
    return needles_for_forms([*target_forms(target), *(p for p in pieces if p.strip())])

