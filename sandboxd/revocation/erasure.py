"""Physical forgetting once a revocation commits: scrub what the daemon keeps, then look for what is left.

`scrub_database` walks every text cell of every table (the ledger's arguments and results, call
records and their ids, provenance content, snapshot labels, reports) and filters it; a key cell (an
agent's call id made from a value, `seed/<name>`) is replaced whole by a salted digest, since half an
id is neither the id nor clean. `scrub_log` rewrites the daemon's log in place, line by line.

Only content columns are read and rewritten (`CONTENT_COLUMNS`): ids the daemon mints, states and
hashes are structure, which spells a short target only by chance. `sandboxd.revocation.leaks` then
looks for what is left.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandboxd.db import Database
from sandboxd.revocation.fingerprint import folded, stands_for
from sandboxd.revocation.forgetting import ForgetFilter, fingerprints_for, piece_fingerprints, target_forms
from sandboxd.revocation.leakscan import needles_for

log = logging.getLogger("sandboxd")


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


def _text_columns(db: Database) -> dict[str, list[_Column]]:
    return {table: [_Column(name=c, key=(table, c) in KEY_COLUMNS) for c in columns]
            for table, columns in CONTENT_COLUMNS.items() if db.columns(table)}


Exempt = Callable[[str, str, dict[str, Any]], str]
"""(table, column, row) -> why the cell keeps what it says (the agent's own writing in the replay, what an
effect sent to the outside world), or "" when it must be scrubbed."""

#: the reason an exempt cell may keep a forgotten value
AGENT_WROTE_IT = ("written by the agent itself in the replay, from a context that never held it: the "
                  "counterfactual agent writes it too")
SYSTEM_PROMPT = ("the system prompt spells it: it was in the context before anything was observed, in the "
                 "counterfactual world too")
SENT_OUT = ("what an external effect sent to the outside world: the far side holds it anyway, and the ledger keeps "
            "it so the effect can be compensated")


def _session_rows(db: Database, table: str, session_id: str | None) -> tuple[str, list[str]]:
    """The WHERE clause selecting a session's rows of `table` (every row when it names no session)."""
    columns = db.columns(table)
    if session_id is None:
        return "1", []
    if "session_id" in columns:
        return "session_id = ?", [session_id]
    if "lineage" in columns:
        return "lineage = ?", [session_id]
    if table == "ledger_aliases":
        return "branch IN (SELECT branch FROM branches WHERE lineage = ?)", [session_id]
    if table == "ledger_events":
        return "call_id IN (SELECT call_id FROM ledger_calls WHERE session_id = ?)", [session_id]
    return "1", []


def cells(db: Database, session_id: str | None = None) -> list[tuple[str, _Column, int, str, dict[str, Any]]]:
    """(table, column, rowid, text, row) for every content cell of the database (of one session's rows)."""
    found = []
    for table, columns in _text_columns(db).items():
        where, params = _session_rows(db, table, session_id)
        for row in db.rows(f'SELECT rowid AS "__rowid", * FROM "{table}" WHERE {where}', params):
            for column in columns:
                value = row.get(column.name)
                if isinstance(value, str) and value:
                    found.append((table, column, row["__rowid"], value, row))
    return found


#: a call id the daemon minted (random), or one the agent runtime composes of a branch id and the call's
#: position in its turn (`br-0123456789ab/call-3-0`, `live/call-3-0`)
_MINTED_CALL_ID = re.compile(r"c-[0-9a-f]{32}|(?:live|br-[0-9a-f]{12})/call-[0-9]+-[0-9]+")


def minted(column: _Column, value: str) -> bool:
    """A call id made of structure alone: it can spell a short target only by chance, and is no content."""
    return column.key and _MINTED_CALL_ID.fullmatch(value) is not None


def distinctive(needle: bytes) -> bool:
    """Whether finding these bytes in a binary store (a database page, a disk image, a log) means anything:
    a needle of a few bytes is in any such file by chance (`:` in every JSON record)."""
    return len(needle) >= MIN_NEEDLE_BYTES


#: shorter byte forms are not searched in binary stores (see `distinctive`); their records are read by meaning
MIN_NEEDLE_BYTES = 8


def scrub_database(db: Database, forget: ForgetFilter, session_id: str, exempt: Exempt,
                   plain: Iterable[str] = ()) -> int:
    """Filter every content cell of the session's rows that holds a forgotten value (keys replaced by a
    digest) unless `exempt`; returns how many cells changed. `plain` as for `scrub_log`: the cells are read
    under the writers' lock, so what the screen spares is time every other session waits."""
    changed = 0
    may_hold = record_screen(forget, plain)
    with db.transaction():
        for table, column, rowid, value, row in cells(db, session_id):
            if exempt(table, column.name, row) or minted(column, value) or not may_hold(value) \
                    or not forget.holds_record(value):
                continue
            clean = redacted_id(value, forget) if column.key else forget.json_text(value)
            db.execute(f'UPDATE "{table}" SET "{column.name}" = ? WHERE rowid = ?', [clean, rowid])
            changed += 1
    return changed


def scrub_log(path: Path, forget: ForgetFilter, plain: Iterable[str] = ()) -> int:
    """Rewrite the daemon's log in place without any forgotten value; returns how many lines changed.

    In place, under the log handler's own lock, so a line logged meanwhile is neither lost nor written
    into the old file; the handler appends (O_APPEND), so it goes on writing at the new end. `plain`: the
    texts `forget` was made from, when known (see `record_screen`)."""
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
            text = fh.read().decode("utf-8", "surrogateescape")
            lines = text.splitlines(keepends=True)
            may_hold = record_screen(forget, plain, text)
            clean = [_clean_line(line, forget) if may_hold(line) else line for line in lines]
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


def record_screen(forget: ForgetFilter, plain: Iterable[str], whole: str | None = None) -> Callable[[str], bool]:
    """A quick test a stored record (a log line, a database cell) must pass to hold a forgotten value
    (False: it holds none); only records that pass it are read by meaning (`ForgetFilter.holds_record`),
    which costs ~0.1 ms a log line in Python, and a revocation reads the whole log and every content cell
    of its session: the log alone was most of a revocation's CPU. Below, "line" is any such record.

    It needs to know the text behind each fingerprint: among `plain` (the target's forms and pieces, which
    the revocation holds in memory), a text whose fold the fingerprint hashes to. Unless all are found,
    every line passes. Why the test is sound: a match is a fingerprint's folded text inside a view of a
    string the line holds. A line without a backslash or a percent sign has no decoded view other than
    itself, and each of its strings (a JSON value or key, delimited by quotes, which folding leaves
    alone; or the whole line) is a piece of it, folded the same in place: so the folded text is in the
    folded line too. A line with either goes to the full reading.

    `whole`: the text the lines are cut from. Folding turns each maximal run of whitespace into one space
    and case-folds character by character, so a line's fold is a piece of the whole text's fold: if no
    folded form is in the latter, no line without escapes holds one, and one pass over the whole text
    (in C) answers for all of them."""
    forms: list[tuple[str, bool, bool]] = []
    candidates = [text for text in dict.fromkeys(plain) if text]
    for fp in forget.fingerprints:
        text = next((t for t in candidates if stands_for(fp, t, forget.salt)), None)
        if text is None:
            return lambda line: True
        forms.append((folded(text, fp.casefold, fp.spacefold), fp.casefold, fp.spacefold))
    forms = list(dict.fromkeys(forms))
    anywhere = whole is None or any(text in folded(whole, casefold, spacefold) for text, casefold, spacefold in forms)

    def may_hold(line: str) -> bool:
        if "\\" in line or "%" in line:
            return True
        return anywhere and any(text in folded(line, casefold, spacefold) for text, casefold, spacefold in forms)

    return may_hold


def _clean_line(line: str, forget: ForgetFilter) -> str:
    if not forget.holds_record(line):
        return line
    body = line.rstrip("\n")
    try:
        entry = json.loads(body)
    except ValueError:
        return forget.text(body) + "\n"
    return json.dumps(forget.value(entry)) + "\n"


def target_filter(target: str, pieces: list[str], salt: bytes) -> ForgetFilter:
    """A filter that finds one revoked target (and its pieces) in every form, for the scan."""
    return ForgetFilter([*fingerprints_for(target, salt), *piece_fingerprints(pieces, salt)], salt)


def target_texts(target: str, pieces: list[str]) -> list[str]:
    """The texts `target_filter` fingerprints (the target's forms, the pieces)."""
    return [*target_forms(target), *pieces]


def byte_needles(target: str, pieces: list[str]) -> list[bytes]:
    """Needles of the target's forms and of the pieces of a split target."""
    return needles_for(*target_forms(target), *(p for p in pieces if p.strip()))

