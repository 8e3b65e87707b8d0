"""What a revocation forgets, and the filter that keeps it out of everything the daemon returns or keeps.

One canonical form. A revoked value is matched as text a reader sees, not as bytes some serializer
wrote: the filter looks at the decoded views of every string (JSON escapes undone, once and twice;
percent-encoding undone; whitespace runs folded) and walks every structure down to its strings,
dict keys included. The daemon filters values before it serializes them, so every serialization it
writes (JSON with or without ASCII escapes, MessagePack, UTF-16, a log line) is clean by construction.

A target may be given in any form the agent saw it in: `target_forms` adds its decoded forms (an
escaped target also forgets what it stands for) and, when the target is a structured observation
(a tool result rendered as JSON, or JSON lines), the strings it carries, so revoking a whole
observation also takes its content out of the structured results later calls return.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from sandboxd.revocation.detector import InjectionDetector
from sandboxd.revocation.fingerprint import (
    FingerprintSet,
    RevokedFingerprint,
    decode_escapes,
    decode_percent,
    fingerprint,
)

#: Fields of the project's own result structures whose strings are structure, not content from the
#: outside world: a listing's entry type and mode, an HTTP answer's content type, a held call's status.
#: Forgetting a whole observation forgets its other strings, not these.
METADATA_FIELDS = frozenset({"type", "mode", "content_type", "status", "call_id", "message_id", "policy",
                             "message", "state"})

# Decoding a decoded form again finds JSON inside JSON; deeper nesting is not something the project writes.
_DECODE_ROUNDS = 2


def payload_texts(text: str) -> list[str]:
    """The decoded texts an observation carries: the strings of a JSON document or of JSON lines (metadata
    fields aside), else the text itself. This is what a reader of the observation reads."""
    document = _json_document(text)
    if document is None:
        return [text]
    leaves: list[str] = []
    for value in document:
        leaves.extend(_leaves(value, depth=0))
    return leaves


def _json_document(text: str) -> list[Any] | None:
    """The JSON values `text` is (one document, or one per non-empty line); None when it is not JSON."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "[{\"":
        return None
    try:
        return [json.loads(stripped)]
    except ValueError:
        pass
    values = []
    for line in stripped.splitlines():
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except ValueError:
            return None
    return values


def _leaves(value: Any, depth: int, key: str | None = None) -> list[str]:
    if isinstance(value, str):
        if key in METADATA_FIELDS:
            return []
        # A string that is itself a JSON document (a webhook body, a tool printing JSON) is read as such too.
        inner = _json_document(value) if depth < _DECODE_ROUNDS else None
        return [value, *(leaf for item in inner or [] for leaf in _leaves(item, depth + 1))]
    if isinstance(value, dict):
        return [leaf for name, item in value.items() for leaf in _leaves(item, depth, name)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item, depth, key)]
    return []


def detected_targets(detector: InjectionDetector, content: str) -> list[str]:
    """What `detector` flags in an observation, read decoded (each string of a structured result on its own),
    so a finding is text the agent read and never carries serialization syntax with it."""
    found = []
    for text in payload_texts(content):
        found += [finding.target(text) for finding in detector.scan(text)]
    return [target for target in dict.fromkeys(found) if target.strip()]


def target_forms(target: str) -> list[str]:
    """Every form of a revoked target to forget: as given, decoded (JSON escapes, percent-encoding), and
    the strings it carries when it is a structured observation. Empty and all-space forms are dropped."""
    forms = [target]
    frontier = [target]
    for _ in range(_DECODE_ROUNDS):
        found = []
        for form in frontier:
            found += [d for d in (decode_escapes(form), decode_percent(form)) if d not in forms]
        forms += list(dict.fromkeys(found))
        frontier = found
    for form in list(forms):
        forms += [leaf for leaf in payload_texts(form) if leaf not in forms]
    return [form for form in dict.fromkeys(forms) if form.strip()]


def fingerprints_for(target: str, salt: bytes) -> list[RevokedFingerprint]:
    """The fingerprints that forget `target` in every form (decoded matching, whitespace folded)."""
    return [fingerprint(form, salt, spacefold=True, decoded=True) for form in target_forms(target)]


def piece_fingerprints(pieces: list[str], salt: bytes) -> list[RevokedFingerprint]:
    """Fingerprints of a target split across consecutive results: the first piece as it ends a result,
    the last as it starts one, the middle ones as whole results."""
    out = []
    for index, piece in enumerate(pieces):
        if not piece.strip():
            continue
        anchor = "end" if index == 0 else "start" if index == len(pieces) - 1 else ""
        out.append(fingerprint(piece, salt, spacefold=True, decoded=True, anchor=anchor))  # type: ignore[arg-type]
    return out


_SYNTAX = frozenset('"{}[],:')


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    kept, position = [], 0
    for start, end in sorted(spans):
        if start >= position:
            kept.append(text[position:start])
        position = max(position, end)
    return "".join(kept) + text[position:]


def field_name(key: Any) -> bool:
    """A key that names a field of a result structure (`body`, `content_type`): structure, kept as it is,
    or a one-letter target would rename every field. Other keys (content used as a key) are filtered."""
    return isinstance(key, str) and key.isascii() and key.isidentifier() and key == key.lower() and len(key) <= 40


class ForgetFilter:
    """A session's forgotten values as salted fingerprints, applied to texts and to whole structures."""

    def __init__(self, fingerprints: Iterable[RevokedFingerprint], salt: bytes) -> None:
        self.fingerprints = list(fingerprints)
        self.salt = salt
        self._set = FingerprintSet(self.fingerprints, salt)

    def __bool__(self) -> bool:
        return bool(self.fingerprints)

    def text(self, text: str) -> str:
        """`text` with every forgotten value excised."""
        return self._set.excise(text)[0] if self.fingerprints and text else text

    def holds(self, text: str) -> bool:
        """Whether a forgotten value occurs in `text`, in any of its decoded views."""
        return bool(self.fingerprints and text) and self._set.contains(text)

    def value(self, value: Any) -> Any:
        """`value` (str, list, tuple, dict with its keys, struct) with every string filtered."""
        if not self.fingerprints:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.value(item) for item in value)
        if isinstance(value, dict):
            return {key if field_name(key) else self.value(key): self.value(item) for key, item in value.items()}
        if isinstance(value, msgspec.Struct):
            return msgspec.structs.replace(value, **{
                name: self.value(getattr(value, name)) for name in value.__struct_fields__})
        return value

    def holds_value(self, value: Any) -> bool:
        """Whether a forgotten value occurs anywhere in `value`."""
        if isinstance(value, str):
            return self.holds(value)
        if isinstance(value, (list, tuple)):
            return any(self.holds_value(item) for item in value)
        if isinstance(value, dict):
            return any((not field_name(k) and self.holds_value(k)) or self.holds_value(v) for k, v in value.items())
        if isinstance(value, msgspec.Struct):
            return any(self.holds_value(getattr(value, name)) for name in value.__struct_fields__)
        return False

    def holds_record(self, text: str) -> bool:
        """Whether a stored record says a forgotten value: a JSON record by its values (its syntax, numbers
        and field names are structure), any other text as text."""
        if not self.fingerprints or not text:
            return False
        if text.lstrip()[:1] in ("{", "["):
            try:
                return self.holds_value(json.loads(text))
            except ValueError:
                pass
        return self.holds(text)

    def rendered(self, text: str, render: Callable[[Any], str], data: Any = None) -> tuple[str, Any]:
        """A result filtered as its data: (clean text, clean data, None without data).

        The one way structured results are sanitized, whether a call returns them now (`data` given) or a
        recorded observation is re-fed (`data` None: read back from `text`, a JSON object). When `text` is
        `render(data)`, the data is filtered value by value and rendered again, so no serialization of it
        (escaped or not) carries a forgotten value and revoking a whole structured result leaves its
        structure, as a fresh call filtered by value does; any other text is filtered as text."""
        given = data is not None
        if not given and self.fingerprints:
            data = _json_object(text)
        clean = self.value(data) if data is not None and self.fingerprints else data
        if data is not None and self.fingerprints and render(data) == text:
            return self.across_structure(render(clean)), clean if given else None
        return self.text(text), clean if given else None

    def across_structure(self, rendered: str) -> str:
        """A rendering of clean data without the forgotten values that span its syntax (`{"to": ["eve@...`).

        Its strings are clean already; a match that stays inside one token is inside a number, a keyword
        or a field name (`0` in `200`), which is structure, not the value, and is left alone."""
        text = rendered
        while True:
            spans = [(start, end) for start, end, _ in self._set.occurrences(text)
                     if any(ch in _SYNTAX for ch in text[start:end])]
            if not spans:
                return text
            text = _cut(text, spans)

    def json_text(self, text: str | None) -> str | None:
        """A stored JSON document filtered value by value (its serialization untouched where clean)."""
        if not text or not self.fingerprints:
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return self.text(text)
        clean = self.value(value)
        return text if clean == value else json.dumps(clean, sort_keys=True, separators=(",", ":"),
                                                      ensure_ascii=False)


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` read as a JSON object, None when it is not one."""
    if text.lstrip()[:1] != "{":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
