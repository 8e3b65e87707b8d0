"""An independent reader of what the daemon stores and returns, for the any-text forgetting tests.

It decodes what a reader would decode (JSON, JSON lines, percent-encoding) and searches raw bytes for every
encoding a string could be stored in, with nothing of the daemon's own leak scan: the two must agree.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

import msgspec


def folded(text: str) -> str:
    """Every run of whitespace as one space, as the daemon matches (a tool may re-flow a value)."""
    return re.sub(r"\s+", " ", text)


def readings(text: str) -> list[str]:
    """What a reader of `text` reads in it, decoded by the standard library: the strings of a JSON document
    or of JSON lines (and of JSON inside them: numbers and field names are structure), else the text and
    its percent-decoding."""
    values = []
    for candidate in [text] if text.strip()[:1] in ("{", "[") else []:
        try:
            values = [json.loads(candidate)]
        except ValueError:
            try:
                values = [json.loads(line) for line in text.splitlines() if line.strip()]
            except ValueError:
                values = []
    if not values:
        return [text, urllib.parse.unquote(text)] if "%" in text else [text]
    out = []
    for leaf in (s for value in values for s in _strings(value)):
        out.append(leaf)
        try:
            out += _strings(json.loads(leaf))
        except ValueError:
            pass
    return out


def _field(key: str) -> bool:
    """A field name of a result structure (`body`): structure the daemon keeps as it is."""
    return key.isascii() and key.isidentifier() and key == key.lower() and len(key) <= 40


#: fields of the daemon's records whose values it mints or enumerates (a random call id, a state): structure
STRUCTURE = frozenset({"call_id", "tool", "kind", "state", "status", "type", "mode", "content_type", "message_id",
                       "raised_by"})


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if k not in STRUCTURE
                for s in [*([] if _field(k) else [k]), *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def holds(value: Any, target: str) -> bool:
    """Whether `value` (a text or any structure) says `target`, whitespace runs read as one space."""
    texts = readings(value) if isinstance(value, str) else [t for s in _strings(value) for t in readings(s)]
    return any(folded(target) in folded(t) for t in texts)


def byte_forms(target: str) -> list[bytes]:
    """The independent byte search's needles: every encoding the project could store a string in."""
    forms = {target.encode(), target.encode("utf-16-le"), target.encode("utf-16-be"),
             json.dumps(target)[1:-1].encode(), json.dumps(target, ensure_ascii=False)[1:-1].encode(),
             msgspec.msgpack.encode(target)}
    return [f for f in forms if f]


#: where the sandbox's own files are under the state directory (a snapshot layer, the upper layer, the live
#: workspace); every other name there is one the daemon gives (`layers`, `state.db`, a minted session id)
SANDBOX_FILES = re.compile(r"snapshots/layers/s-[0-9a-f]+/(snap-[0-9a-f]+|upper|base)/.+"
                           r"|snapshots/mounts/s-[0-9a-f]+/ws/.+", re.DOTALL)


def byte_search(root: Path, needles: list[bytes]) -> set[str]:
    """Relative paths under `root` whose bytes, or whose name if the sandbox chose it, hold a needle
    (symlinks not followed)."""
    found = set()
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(base) / name
            rel = path.relative_to(root).as_posix()
            if SANDBOX_FILES.fullmatch(rel) and any(n in os.fsencode(name) for n in needles):
                found.add(rel)
            if path.is_file() and not path.is_symlink() and any(n in stored_bytes(path) for n in needles):
                found.add(rel)
    return found


def stored_bytes(path: Path) -> bytes:
    """A file's stored data: a session's disk image is a sparse GiB whose holes hold nothing to find."""
    chunks, fd = [], os.open(path, os.O_RDONLY)
    try:
        size, position = os.fstat(fd).st_size, 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            chunks.append(os.pread(fd, end - start, start))
            position = end
    finally:
        os.close(fd)
    return b"\0".join(chunks)
