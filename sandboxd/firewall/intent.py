"""Intent-level call identity: canonical intent JSON, intent keys and derived call ids.

A consequential call is identified by what it does, not by where it sits in the session:
`(lineage, tool, canonical intent, k)` where k counts earlier calls of the same intent in the same
branch of that lineage. Two spellings of one intent (key order, runs of whitespace, `1` vs `1.0`,
`1e-7` vs `0.0000001`) must land on one key, or a replay that re-decodes a call with a cosmetic
difference would fire it a second time.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from decimal import Decimal
from typing import Any

CALL_ID_PREFIX = "fx-"


def normalize_text(text: str) -> str:
    """NFC-normalise a string, collapse whitespace runs to one space and strip both ends."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def canonical_number(value: int | float) -> str:
    """Decimal text of a number with no exponent, no trailing zeros, and integral floats as ints."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no canonical JSON form")
        if value.is_integer():
            return str(int(value))
        # repr is the shortest round-tripping form; Decimal then spells it out without an exponent.
        return format(Decimal(repr(value)), "f")
    return str(int(value))


def canonical_json(value: Any) -> str:
    """Stable JSON text of a JSON-like value: sorted keys, normalised strings and numbers, no spaces."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return canonical_number(value)
    if isinstance(value, str):
        return json.dumps(normalize_text(value), ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ",".join(canonical_json(item) for item in value) + "]"
    if isinstance(value, dict):
        return _canonical_object(value)
    raise ValueError(f"{type(value).__name__} is not a JSON value")


def _canonical_object(value: dict[Any, Any]) -> str:
    items: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"object key {key!r} is not a string")
        # Keys are only NFC-normalised: collapsing spaces in a key would change which field it names.
        name = unicodedata.normalize("NFC", key)
        if name in items:
            raise ValueError(f"object key {key!r} collides with another key after normalisation")
        items[name] = item
    parts = (
        json.dumps(name, ensure_ascii=False) + ":" + canonical_json(items[name]) for name in sorted(items)
    )
    return "{" + ",".join(parts) + "}"


def intent_key(tool: str, fields: dict[str, Any]) -> tuple[str, str]:
    """(key, canonical intent JSON) of a tool's intent fields; the key is a SHA-256 hex digest."""
    intent = canonical_json(fields)
    digest = hashlib.sha256(json.dumps([tool, intent], ensure_ascii=False).encode()).hexdigest()
    return digest, intent


def derive_call_id(lineage: str, tool: str, key: str, occurrence: int) -> str:
    """The ledger id of the `occurrence`-th call (from 0) of one intent in one lineage."""
    if occurrence < 0:
        raise ValueError("occurrence counts from 0")
    # Ids and names are used verbatim: only intent content is normalised.
    material = json.dumps([lineage, tool, key, occurrence], ensure_ascii=False).encode()
    return CALL_ID_PREFIX + hashlib.sha256(material).hexdigest()[:32]
