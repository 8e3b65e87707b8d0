"""Injection detectors: checks the daemon runs over tool observations after the agent consumed them.

A detector returns the character spans of injected instructions; each span becomes the target `z`
of a revocation event whose source is the observation, so the session is rewound and replayed as if
the injection had never been read. The default is a rule set for common prompt-injection phrasing
(including the AgentDojo attack templates); `load_detector("module:Class")` plugs in another one,
such as a classifier.

A false negative leaves the injection's effects in place, while a false positive costs a replay and
some benign text, so spans err on the side of covering the whole instruction: from the start of the
sentence holding the trigger to the end of its paragraph.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Literal, Protocol, runtime_checkable

import msgspec

Extent = Literal["match", "paragraph"]


class Finding(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An injected instruction found in an observation: its character span [start, end) and the rule(s) that fired.

    It holds no excerpt of the text, only its length, so a finding can be logged and stored
    without keeping the very value that is about to be revoked.
    """

    start: int
    end: int
    rule: str
    excerpt_len: int

    def target(self, text: str) -> str:
        """The injected text itself, cut from the observation the finding was made in."""
        return text[self.start : self.end]


@runtime_checkable
class InjectionDetector(Protocol):
    """What the daemon needs of a detector: a name for the revocation event and a scan."""

    name: str

    def scan(self, text: str) -> list[Finding]:
        """Spans of injected instructions in `text`, sorted and non-overlapping."""
        ...


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """One phrasing of an injection and how far its span reaches around a match."""

    name: str
    pattern: str
    extent: Extent = "paragraph"
    """match: the regex match is the whole injection (a delimited block); paragraph: see module doc."""
    alone: bool = True
    """False for phrasing that is common in benign text: it only widens a span some other rule found."""
    case_sensitive: bool = False


DEFAULT_RULES: tuple[Rule, ...] = (
    # AgentDojo's "important_instructions" attack wraps the goal in this block.
    Rule(name="information_block", pattern=r"<INFORMATION>.*?(?:</INFORMATION>|\Z)", extent="match"),
    Rule(
        name="ignore_previous_instructions",
        pattern=r"\b(?:ignore|disregard|forget|override)\s+(?:all\s+|any\s+|of\s+)*(?:the\s+|your\s+|my\s+|these\s+)?"
        r"(?:previous|prior|above|earlier|preceding|former|original|system)\s+"
        r"(?:\w*nstruct\w*|prompts?|directions?|rules|messages?|context|guidelines|commands?)",
    ),
    Rule(
        name="disregard",
        pattern=r"\bdisregard\s+(?:all|any|everything|anything|the\s+(?:above|user|task)|your\s+(?:task|instructions?))\b",
    ),
    Rule(name="important_banner", pattern=r"\bIMPORTANT\s*!{2,}", case_sensitive=True),
    Rule(name="you_must_now", pattern=r"\byou\s+must\s+now\b"),
    Rule(name="new_instructions", pattern=r"\b(?:new|updated|real)\s+instructions?\s*:"),
    Rule(
        name="system_prompt_override",
        pattern=r"\bsystem\s+prompt\s+override\b|\boverride\s+(?:the\s+|your\s+)?system\s+prompt\b"
        r"|#{2,}\s*\(?\s*system[_ ]message\s*\)?",
    ),
    Rule(
        name="task_preamble",
        pattern=r"\bbefore\s+you\s+(?:can\s+)?(?:solve|complete|finish|continue)\s+(?:with\s+)?(?:the|your|my)\s+task\b",
    ),
    # A tool result asking for mail to be sent is suspicious only next to stronger phrasing:
    # ordinary mail says "please send me the report" all the time.
    Rule(name="send_email", pattern=r"\bsend\s+(?:an?\s+|the\s+)?e-?mails?\s+to\b", alone=False),
)

# A paragraph ends at a blank line. In text without blank lines (a CSV, a log) that would be the rest
# of the file, so a span reaches at most this far past its trigger, rounded out to the end of a line.
MAX_PARAGRAPH_TAIL = 1000

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")


class RuleBasedDetector:
    """The default detector: regular expressions for prompt-injection phrasing."""

    name = "rules"

    def __init__(self, rules: Iterable[Rule] = DEFAULT_RULES, max_tail: int = MAX_PARAGRAPH_TAIL) -> None:
        self.rules = tuple(rules)
        self.max_tail = max_tail
        self._compiled = [
            (rule, re.compile(rule.pattern, re.DOTALL if rule.case_sensitive else re.DOTALL | re.IGNORECASE))
            for rule in self.rules
        ]

    def scan(self, text: str) -> list[Finding]:
        """Spans of injected instructions in `text`, merged where they overlap."""
        blocks: list[tuple[int, int, str]] = []
        for rule, regex in self._compiled:
            if rule.extent == "match" and rule.alone:
                blocks.extend((m.start(), m.end(), rule.name) for m in regex.finditer(text) if m.end() > m.start())
        spans = list(blocks)
        corroborating: list[tuple[int, int, str]] = []
        for rule, regex in self._compiled:
            if rule.extent == "match" and rule.alone:
                continue
            for m in regex.finditer(text):
                # A trigger inside a delimited block is already covered, and its paragraph could
                # run past the block's end.
                if any(start <= m.start() < end for start, end, _ in blocks):
                    continue
                span = (m.start(), m.end()) if rule.extent == "match" else self._paragraph(text, m.start(), m.end())
                (spans if rule.alone else corroborating).append((*span, rule.name))
        return _merge(spans, corroborating)

    def _paragraph(self, text: str, trigger_start: int, trigger_end: int) -> tuple[int, int]:
        """From the start of the trigger's sentence to the end of its paragraph (bounded)."""
        para_start = 0
        for para_break in _PARAGRAPH_BREAK.finditer(text, 0, trigger_start):
            para_start = para_break.end()
        start = para_start
        for sentence_end in _SENTENCE_END.finditer(text, para_start, trigger_start):
            start = sentence_end.end()
        brk = _PARAGRAPH_BREAK.search(text, trigger_end)
        end = brk.start() if brk else len(text)
        if end - trigger_end > self.max_tail:
            line_end = text.find("\n", trigger_end + self.max_tail)
            end = min(end, line_end if line_end != -1 else len(text))
        return _strip(text, start, end)


class NullDetector:
    """A detector that finds nothing: revocations come only from users and operators."""

    name = "none"

    def scan(self, text: str) -> list[Finding]:
        """Nothing, always."""
        return []


def load_detector(name: str = "rules") -> InjectionDetector:
    """The detector configured by `name`: "rules" (default), "none", or "package.module:Class" for a plug-in."""
    if name in ("", "rules"):
        return RuleBasedDetector()
    if name == "none":
        return NullDetector()
    module_name, sep, class_name = name.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"unknown detector {name!r}: use 'rules', 'none' or 'package.module:Class'")
    try:
        factory = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load detector {name!r}: {exc}") from exc
    try:
        detector = factory()
    except TypeError as exc:
        raise ValueError(f"detector {name!r} must be constructible without arguments: {exc}") from exc
    if not isinstance(detector, InjectionDetector) or not isinstance(getattr(detector, "name", None), str):
        raise ValueError(f"detector {name!r} must have a str `name` and a `scan(text) -> list[Finding]` method")
    return detector


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _merge(spans: list[tuple[int, int, str]], corroborating: list[tuple[int, int, str]]) -> list[Finding]:
    """Union overlapping spans; a corroborating span joins only where it overlaps a confirmed one."""
    merged = _union(spans)
    pending = list(corroborating)
    # Absorbing one corroborating span widens a span, which may make it overlap another; repeat.
    while True:
        joining = [c for c in pending if any(c[0] < end and start < c[1] for start, end, _ in merged)]
        if not joining:
            break
        pending = [c for c in pending if c not in joining]
        merged = _union([(start, end, rule) for start, end, rules in merged for rule in rules] + joining)
    return [
        Finding(start=s, end=e, rule="+".join(dict.fromkeys(rules)), excerpt_len=e - s) for s, e, rules in merged
    ]


def _union(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, list[str]]]:
    out: list[tuple[int, int, list[str]]] = []
    for start, end, rule in sorted(spans):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end), out[-1][2] + [rule])
        else:
            out.append((start, end, [rule]))
    return out
