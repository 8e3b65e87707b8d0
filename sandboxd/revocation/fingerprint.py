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

Texts are matched as decoded, not as serialized (`decoded`): a value that reached a record or a
tool result JSON-escaped (`\u00dc`, `\n`, `\"`, once or twice) or percent-encoded is found there
too, through views of the text that undo those encodings and map every match back to the span of
the original text it covers, so excising it leaves the surrounding serialization intact.

The rolling hash value of the target is stored XOR a mask derived from the salt and the digest.
Stored in the clear it would be a second, unsalted-in-effect equation in the target: two
fingerprints of the same length share the secret base, so guessing one target would yield the base
and let the guess of the other be checked offline.

Why one module of this size: the fingerprint, the decoded views it matches in and the span mapping
back to the original text are one security argument (what is stored, what it reveals, how a match is
confirmed); kept together, a reader can check it in one sitting.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Literal

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
    decoded: bool = False
    """Also match in the text's decoded views (JSON escapes undone once and twice, percent-encoding undone):
    the value as a reader of the text sees it, whatever serialization carried it."""
    anchor: Literal["", "start", "end"] = ""
    """Match only at the start or the end of a text (leading/trailing whitespace aside): the piece of a
    target that was split across two tool results, as each result carries it."""
    version: int = FINGERPRINT_VERSION


def fingerprint(target: str, salt: bytes, *, casefold: bool = False, spacefold: bool = False,
                decoded: bool = False, anchor: Literal["", "start", "end"] = "") -> RevokedFingerprint:
    """Fingerprint a revoked target under the daemon's secret salt."""
    _check_salt(salt)
    view = _View(target).fold(casefold, spacefold).folded
    if not view or (spacefold and view.isspace()):  # all whitespace would match every gap between words
        raise ValueError("cannot fingerprint an empty target")
    digest = _window_digest(view, salt, casefold, spacefold)
    roll = _roll_of(view, _base(salt))
    return RevokedFingerprint(length=len(view), digest=digest, sealed_roll=roll ^ _mask(salt, digest),
                              casefold=casefold, spacefold=spacefold, decoded=decoded, anchor=anchor)


def folded(text: str, casefold: bool, spacefold: bool) -> str:
    """`text` as a fingerprint with these flags reads it: what `fingerprint` hashes, and the view a match is
    searched in (its decoded views aside). The text alone, without `_View`'s map back to the original."""
    if casefold:
        text = "".join([ch.casefold() for ch in text])
    return _SPACE_RUN.sub(" ", text) if spacefold else text


def stands_for(fp: RevokedFingerprint, text: str, salt: bytes) -> bool:
    """Whether `fp` is the fingerprint of `text` (folded as its flags say), its anchor aside."""
    view = folded(text, fp.casefold, fp.spacefold)
    return len(view) == fp.length and hmac.compare_digest(_window_digest(view, salt, fp.casefold, fp.spacefold),
                                                          fp.digest)


def find(text: str, fp: RevokedFingerprint, salt: bytes) -> list[tuple[int, int]]:
    """Character spans [start, end) of every occurrence of the fingerprinted target in `text`, overlaps included."""
    return sorted({(start, end) for start, end, _ in FingerprintSet([fp], salt).occurrences(text)})


def contains(text: str, fps: Iterable[RevokedFingerprint], salt: bytes) -> bool:
    """Whether any of the fingerprinted targets occurs in `text`."""
    return FingerprintSet(fps, salt).contains(text)


def excise(text: str, fps: Iterable[RevokedFingerprint], salt: bytes) -> tuple[str, int]:
    """Remove every occurrence of every fingerprinted target; return the new text and how many were removed."""
    return FingerprintSet(fps, salt).excise(text)


class FingerprintSet:
    """Fingerprints unsealed and grouped once under the salt, for matching many texts."""

    def __init__(self, fps: Iterable[RevokedFingerprint], salt: bytes) -> None:
        _check_salt(salt)
        self.salt = salt
        self.fingerprints = list(fps)
        self._base = _base(salt)
        self._groups: dict[tuple[int, bool, bool, bool, str], dict[int, list[RevokedFingerprint]]] = {}
        for fp in self.fingerprints:
            if fp.version != FINGERPRINT_VERSION:
                raise ValueError(f"fingerprint version {fp.version} is not supported (want {FINGERPRINT_VERSION})")
            wanted = fp.sealed_roll ^ _mask(salt, fp.digest)
            key = (fp.length, fp.casefold, fp.spacefold, fp.decoded, fp.anchor)
            self._groups.setdefault(key, {}).setdefault(wanted, []).append(fp)
        self._decoded = any(key[3] for key in self._groups)

    def __bool__(self) -> bool:
        return bool(self.fingerprints)

    def contains(self, text: str) -> bool:
        """Whether any of the targets occurs in `text`."""
        return bool(self.occurrences(text, first=True))

    def excise(self, text: str) -> tuple[str, int]:
        """Remove every occurrence of every target; return the new text and how many were removed.

        Removal can join two halves into a fresh occurrence ("aabb" minus "ab" leaves "ab"), so it
        repeats until none is left; each round shortens the text, so it ends.
        """
        removed = 0
        while True:
            found = self.occurrences(text)
            if not found:
                return text, removed
            removed += len(found)
            text = _cut(text, _union((start, end) for start, end, _ in found))

    def occurrences(self, text: str, first: bool = False) -> list[tuple[int, int, RevokedFingerprint]]:
        """(start, end, fingerprint) of every occurrence in `text`, in original character offsets."""
        if not self._groups or not text:
            return []
        raw = _View(text)
        bases = {False: [raw], True: raw.decoded() if self._decoded else [raw]}
        views: dict[tuple[bool, bool, bool], list[_View]] = {}
        found: list[tuple[int, int, RevokedFingerprint]] = []
        for (length, casefold, spacefold, decoded, anchor), by_roll in self._groups.items():
            if (casefold, spacefold, decoded) not in views:
                views[casefold, spacefold, decoded] = [v.fold(casefold, spacefold) for v in bases[decoded]]
            for view in views[casefold, spacefold, decoded]:
                for start, roll in _candidates(view.folded, length, self._base, by_roll.keys(), anchor):
                    digest = _window_digest(view.folded[start : start + length], self.salt, casefold, spacefold)
                    for fp in by_roll[roll]:
                        span = view.span(start, start + length) if hmac.compare_digest(digest, fp.digest) else None
                        if span is not None:
                            found.append((span[0], span[1], fp))
                            if first:
                                return found
        return found


# Internals ----------------------------------------------------------------------------------


class _View:
    """A text as matched (decoded, case-folded, whitespace-folded, or as it is) with a map back to the
    original text: folded character i came from original characters [starts[i], ends[i])."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.folded = text
        self._starts: list[int] | None = None  # None: the identity map
        self._ends: list[int] | None = None

    def _then(self, out: str, starts: list[int], ends: list[int]) -> _View:
        """A further view whose character i came from this view's [starts[i], ends[i])."""
        view = _View(self.text)
        view.folded = out
        if self._starts is None or self._ends is None:
            view._starts, view._ends = starts, ends
        else:
            view._starts = [self._starts[s] for s in starts]
            view._ends = [self._ends[e - 1] for e in ends]
        return view

    def fold(self, casefold: bool, spacefold: bool) -> _View:
        """This view case-folded and/or whitespace-folded."""
        view = self
        if casefold:
            view = view._casefolded()
        if spacefold:
            view = view._spacefolded()
        return view

    def _casefolded(self) -> _View:
        # Full case folding can lengthen a character ("ß" -> "ss"): both pieces map to the one character.
        pieces = [ch.casefold() for ch in self.folded]
        out = "".join(pieces)
        if len(out) == len(self.folded):
            view = _View(self.text)
            view.folded, view._starts, view._ends = out, self._starts, self._ends
            return view
        starts: list[int] = []
        ends: list[int] = []
        for index, piece in enumerate(pieces):
            starts.extend([index] * len(piece))
            ends.extend([index + 1] * len(piece))
        return self._then(out, starts, ends)

    def _spacefolded(self) -> _View:
        # Each character of the result is a whole piece: a character, or a whitespace run folded to one space.
        text = self.folded
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
            return self
        parts.append(text[position:])
        starts.extend(range(position, len(text)))
        ends.extend(range(position + 1, len(text) + 1))
        return self._then("".join(parts), starts, ends)

    def decoded(self) -> list[_View]:
        """This view and the views that undo an encoding the text may carry: JSON string escapes (once,
        and again for a JSON document inside a JSON string) and URL percent-encoding."""
        views = [self]
        once = _replaced(self, _JSON_ESCAPE, _json_escape_text)
        if once is not None:
            views.append(once)
            twice = _replaced(once, _JSON_ESCAPE, _json_escape_text)
            if twice is not None:
                views.append(twice)
        percent = _replaced(self, _PERCENT_RUN, _percent_text)
        if percent is not None:
            views.append(percent)
        return views

    def span(self, start: int, end: int) -> tuple[int, int] | None:
        """The original span of folded [start, end), or None if it cuts through a folded character."""
        if self._starts is None or self._ends is None:
            return start, end
        if start > 0 and self._ends[start - 1] > self._starts[start]:
            return None
        if end < len(self._starts) and self._ends[end - 1] > self._starts[end]:
            return None
        return self._starts[start], self._ends[end - 1]


# A JSON string escape: \" \\ \/ \b \f \n \r \t, or \uXXXX (a surrogate pair is two of them).
_JSON_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PERCENT_RUN = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _json_escape_text(match: re.Match[str], text: str) -> list[tuple[str, int, int]]:
    """The characters one JSON escape stands for, each with its span in `text`."""
    body = match.group(0)[1:]
    if body[0] != "u":
        return [(_SIMPLE_ESCAPES[body], match.start(), match.end())]
    code = int(body[1:], 16)
    # A high surrogate followed by an escaped low one is one character, spanning both escapes.
    if 0xD800 <= code < 0xDC00 and text.startswith("\\u", match.end()):
        low = text[match.end() + 2 : match.end() + 6]
        if len(low) == 4 and all(c in "0123456789abcdefABCDEF" for c in low) and 0xDC00 <= int(low, 16) < 0xE000:
            char = chr(0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00))
            return [(char, match.start(), match.end() + 6)]
    return [(chr(code), match.start(), match.end())]


def _percent_text(match: re.Match[str], text: str) -> list[tuple[str, int, int]]:
    """The characters a run of %XX escapes stands for (as UTF-8), each with the span of its escapes."""
    raw = bytes(int(match.group(0)[i + 1 : i + 3], 16) for i in range(0, len(match.group(0)), 3))
    out: list[tuple[str, int, int]] = []
    position = match.start()
    for char in raw.decode("utf-8", "surrogateescape"):
        size = 1 if 0xDC80 <= ord(char) <= 0xDCFF else len(char.encode("utf-8"))
        out.append((char, position, position + 3 * size))
        position += 3 * size
    return out


def _replaced(view: _View, pattern: re.Pattern[str], expand: object) -> _View | None:
    """`view` with every match of `pattern` replaced by the characters `expand` says it stands for; None
    when nothing matches (no view to add). A surrogate pair consumes the escape after it, so matches that
    an earlier expansion already covered are skipped."""
    text = view.folded
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    parts: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    position = 0
    for match in matches:
        if match.start() < position:
            continue
        parts.append(text[position : match.start()])
        starts.extend(range(position, match.start()))
        ends.extend(range(position + 1, match.start() + 1))
        for char, start, end in expand(match, text):  # type: ignore[operator]
            parts.append(char)
            starts.append(start)
            ends.append(end)
            position = end
    parts.append(text[position:])
    starts.extend(range(position, len(text)))
    ends.extend(range(position + 1, len(text) + 1))
    return view._then("".join(parts), starts, ends)


def decode_escapes(text: str) -> str:
    """`text` with its JSON string escapes undone (leniently: anything else is left as it is)."""
    view = _replaced(_View(text), _JSON_ESCAPE, _json_escape_text)
    return view.folded if view is not None else text


def decode_percent(text: str) -> str:
    """`text` with its URL percent-encoding undone (leniently; invalid UTF-8 is kept as escapes)."""
    view = _replaced(_View(text), _PERCENT_RUN, _percent_text)
    if view is None:
        return text
    return "".join(ch if not 0xDC80 <= ord(ch) <= 0xDCFF else text[s:e]
                   for ch, s, e in zip(view.folded, view._starts or [], view._ends or [], strict=True))


def _anchored_starts(text: str, length: int, anchor: str) -> list[int]:
    """Where an anchored window of `length` may start: at the text's very start or end, or there once the
    text's leading or trailing whitespace is set aside."""
    if anchor == "start":
        starts = {0, len(text) - len(text.lstrip())}
    else:
        starts = {len(text) - length, len(text.rstrip()) - length}
    return sorted(s for s in starts if 0 <= s and s + length <= len(text))


def _candidates(text: str, length: int, base: int, wanted: Iterable[int], anchor: str = "") -> list[tuple[int, int]]:
    """(start, hash) of the windows whose rolling hash is one of `wanted`: one pass, O(len(text))."""
    if length > len(text):
        return []
    targets = set(wanted)
    if anchor:
        return [(start, roll) for start in _anchored_starts(text, length, anchor)
                if (roll := _roll_of(text[start : start + length], base)) in targets]
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
