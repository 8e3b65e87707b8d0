"""Salted fingerprints of revoked values: the only form in which a revoked target may be kept.

After a revocation the target `z` must occur nowhere in the daemon's state, yet the daemon still has
to notice when `z` comes back in a later observation. A `RevokedFingerprint` lets it do both: it
holds the target's length, an HMAC-SHA256 of the target under a per-daemon secret salt, and a
sealed keyed rolling hash. Without the salt none of these says anything about the target; a plain
SHA-256 would not do, since a short target (a code, an address) is recovered from it by guessing.

Finding the target in a new text of n characters costs O(n) per distinct target length: a
polynomial rolling hash over every window of `length` characters picks candidates, and each
candidate is confirmed with the HMAC of the window, so a rolling-hash collision never counts as a
match. The rolling hash's base comes from HMAC(salt, "roll"), so an adversary who can choose the
text cannot aim collisions at it either.

The rolling hash value of the target is stored XOR a mask derived from the salt and the digest.
Stored in the clear it would be a second, unsalted-in-effect equation in the target: two
fingerprints of the same length share the secret base, so guessing one target would yield the base
and let the guess of the other be checked offline.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence

import msgspec

FINGERPRINT_VERSION = 1
MIN_SALT_BYTES = 32

# The Mersenne prime 2^61 - 1: a product of two residues fits comfortably in Python ints and the
# collision probability per window is about length / 2^61.
_MODULUS = (1 << 61) - 1
_MASK_BITS = 61
# Whitespace that is not already a single space: a run of two or more, or one newline, tab, etc.
_SPACE_RUN = re.compile(r"\s{2,}|[^\S ]")


class RevokedFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A revoked target as the daemon may keep it: salted digests and a length, never the text."""

    length: int
    """Characters in the (case-folded, if `casefold`) target: the window size of a scan."""
    digest: str
    """Hex HMAC-SHA256(salt, domain | casefold flag | target as UTF-8)."""
    sealed_roll: int
    """The target's keyed rolling hash XOR a mask only the salt's holder can compute."""
    casefold: bool = False
    """Match case-insensitively (Unicode full case folding) instead of exactly."""
    spacefold: bool = False
    """Match with every run of whitespace as one space: the same text re-flowed by a tool (YAML folding
    a long line, indenting a block) is the same text."""
    version: int = FINGERPRINT_VERSION


def fingerprint(target: str, salt: bytes, *, casefold: bool = False, spacefold: bool = False) -> RevokedFingerprint:
    """Fingerprint a revoked target under the daemon's secret salt."""
    _check_salt(salt)
    view = _View(target, casefold, spacefold).folded
    if not view or (spacefold and view.isspace()):  # all whitespace would match every gap between words
        raise ValueError("cannot fingerprint an empty target")
    digest = _window_digest(view, salt, casefold, spacefold)
    roll = _roll_of(view, _base(salt))
    return RevokedFingerprint(length=len(view), digest=digest, sealed_roll=roll ^ _mask(salt, digest),
                              casefold=casefold, spacefold=spacefold)


def find(text: str, fp: RevokedFingerprint, salt: bytes) -> list[tuple[int, int]]:
    """Character spans [start, end) of every occurrence of the fingerprinted target in `text`, overlaps included."""
    return sorted({(start, end) for start, end, _ in _occurrences(text, [fp], salt)})


def contains(text: str, fps: Iterable[RevokedFingerprint], salt: bytes) -> bool:
    """Whether any of the fingerprinted targets occurs in `text`."""
    return bool(_occurrences(text, list(fps), salt))


def excise(text: str, fps: Iterable[RevokedFingerprint], salt: bytes) -> tuple[str, int]:
    """Remove every occurrence of every fingerprinted target; return the new text and how many were removed.

    Removal can join two halves into a fresh occurrence ("aabb" minus "ab" leaves "ab"), so it
    repeats until none is left; each round shortens the text, so it ends.
    """
    fps = list(fps)
    removed = 0
    while True:
        found = _occurrences(text, fps, salt)
        if not found:
            return text, removed
        removed += len(found)
        text = _cut(text, _union((start, end) for start, end, _ in found))


# Internals ----------------------------------------------------------------------------------


class _View:
    """The text as matched (case-folded, whitespace-folded or neither) with a map back to the original's
    character offsets."""

    def __init__(self, text: str, casefold: bool, spacefold: bool = False) -> None:
        self.text = text
        self.folded = text
        self._origin: list[int] | None = None
        self._first: list[bool] | None = None
        self._last: list[bool] | None = None
        self._runs: tuple[list[int], list[int]] | None = None
        if casefold:
            self._fold(text)
        if spacefold:
            self._fold_space(self.folded)

    def _fold_space(self, text: str) -> None:
        # Each character of the result is a whole piece of `text`: a character, or a whitespace run
        # folded to one space; `_runs` holds each piece's [start, end) in `text`.
        parts: list[str] = []
        starts: list[int] = []
        ends: list[int] = []
        position = 0
        for match in _SPACE_RUN.finditer(text):
            start, end = match.span()
            parts.append(text[position:start])
            starts.extend(range(position, start))
            ends.extend(range(position + 1, start + 1))
            parts.append(" ")
            starts.append(start)
            ends.append(end)
            position = end
        if not parts:
            return
        parts.append(text[position:])
        starts.extend(range(position, len(text)))
        ends.extend(range(position + 1, len(text) + 1))
        self.folded = "".join(parts)
        self._runs = (starts, ends)

    def _fold(self, text: str) -> None:
        # Full case folding can lengthen a character ("ß" -> "ss"), so offsets need a map; it is
        # built only when some character actually grew.
        pieces = [ch.casefold() for ch in text]
        self.folded = "".join(pieces)
        if len(self.folded) == len(text):
            return
        self._origin, self._first, self._last = [], [], []
        for index, piece in enumerate(pieces):
            for k in range(len(piece)):
                self._origin.append(index)
                self._first.append(k == 0)
                self._last.append(k == len(piece) - 1)

    def span(self, start: int, end: int) -> tuple[int, int] | None:
        """The original span of folded [start, end), or None if it cuts through a folded character."""
        if self._runs is not None:
            start, end = self._runs[0][start], self._runs[1][end - 1]
        if self._origin is None or self._first is None or self._last is None:
            return start, end
        if not (self._first[start] and self._last[end - 1]):
            return None
        return self._origin[start], self._origin[end - 1] + 1


def _occurrences(
    text: str, fps: Sequence[RevokedFingerprint], salt: bytes
) -> list[tuple[int, int, RevokedFingerprint]]:
    _check_salt(salt)
    for fp in fps:
        if fp.version != FINGERPRINT_VERSION:
            raise ValueError(f"fingerprint version {fp.version} is not supported (want {FINGERPRINT_VERSION})")
    groups: dict[tuple[int, bool, bool], dict[int, list[RevokedFingerprint]]] = {}
    for fp in fps:
        wanted = fp.sealed_roll ^ _mask(salt, fp.digest)
        groups.setdefault((fp.length, fp.casefold, fp.spacefold), {}).setdefault(wanted, []).append(fp)
    views = {(casefold, spacefold): _View(text, casefold, spacefold) for _, casefold, spacefold in groups}
    base = _base(salt)
    found: list[tuple[int, int, RevokedFingerprint]] = []
    for (length, casefold, spacefold), by_roll in groups.items():
        view = views[casefold, spacefold]
        for start, roll in _candidates(view.folded, length, base, by_roll.keys()):
            digest = _window_digest(view.folded[start : start + length], salt, casefold, spacefold)
            for fp in by_roll[roll]:
                span = view.span(start, start + length) if hmac.compare_digest(digest, fp.digest) else None
                if span is not None:
                    found.append((span[0], span[1], fp))
    return found


def _candidates(text: str, length: int, base: int, wanted: Iterable[int]) -> list[tuple[int, int]]:
    """(start, hash) of the windows whose rolling hash is one of `wanted`: one pass, O(len(text))."""
    if length > len(text):
        return []
    targets = set(wanted)
    top = pow(base, length - 1, _MODULUS)
    roll = _roll_of(text[:length], base)
    hits = [(0, roll)] if roll in targets else []
    for start in range(1, len(text) - length + 1):
        roll = ((roll - ord(text[start - 1]) * top) * base + ord(text[start + length - 1])) % _MODULUS
        if roll in targets:
            hits.append((start, roll))
    return hits


def _roll_of(text: str, base: int) -> int:
    roll = 0
    for ch in text:
        roll = (roll * base + ord(ch)) % _MODULUS
    return roll


def _base(salt: bytes) -> int:
    key = int.from_bytes(hmac.new(salt, b"sandboxd.revocation.roll", hashlib.sha256).digest()[:8], "big")
    # Keep the base away from 0, 1 and -1, which would make the hash ignore order or content.
    return 2 + key % (_MODULUS - 3)


def _mask(salt: bytes, digest: str) -> int:
    raw = hmac.new(salt, b"sandboxd.revocation.mask\x00" + digest.encode("ascii"), hashlib.sha256).digest()
    return int.from_bytes(raw[:8], "big") & ((1 << _MASK_BITS) - 1)


def _window_digest(window: str, salt: bytes, casefold: bool, spacefold: bool = False) -> str:
    # One flag byte; without spacefold it is the byte version 1 always had, so stored digests still match.
    head = b"sandboxd.revocation.fp.v1\x00" + bytes([casefold | spacefold << 1])
    # surrogatepass: a lone surrogate in a decoded observation must still fingerprint, not crash.
    return hmac.new(salt, head + window.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def _check_salt(salt: bytes) -> None:
    if len(salt) < MIN_SALT_BYTES:
        raise ValueError(f"the fingerprint salt must be at least {MIN_SALT_BYTES} secret random bytes")


def _union(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    kept: list[str] = []
    position = 0
    for start, end in spans:
        kept.append(text[position:start])
        position = end
    kept.append(text[position:])
    return "".join(kept)
