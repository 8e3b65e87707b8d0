"""Information-flow control: an external call may not carry text the detector flagged as injected.

The rule is deliberately coarse, as sink-side flow control is: a string argument is tainted when one
of its words (8 characters or more, split on whitespace) occurs in the flagged span of an observation
of the session that is still pending revocation. It blocks a hijacked payment to the IBAN the injection
named, or a post of the URL it gave, and it also blocks a legitimate call that happens to share a long
word with the injection: the false positives are part of what the evaluation measures (B8).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

MIN_WORD = 8


def _strings(value: Any, path: str = "$") -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")


def tainted_argument(args: dict[str, Any], flagged: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """(argument path, flagged source) of the first argument carrying flagged text, or None."""
    for path, text in _strings(args):
        for word in {w for w in text.split() if len(w) >= MIN_WORD}:
            for source, span in flagged:
                if word in span:
                    return path, source
    return None
