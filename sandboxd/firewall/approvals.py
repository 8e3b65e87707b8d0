"""What an operator sees to judge a call: where it goes, what it says, a digest of it, who decided it and why.

The outbox and `calls` views are built here from the ledger's rows, so the CLI's tables and `--json` show
the same facts. The digest is of the arguments exactly as they will be sent (sorted keys, nothing
normalised): approving a digest approves that payload and no other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from sandboxd import protocol as p

PREVIEW_CHARS = 120
#: argument names that say where an effect goes: shown as its target, not in its preview
_TARGET_ARGS = ("to", "url", "method")


def digest(args: dict[str, Any]) -> str:
    """sha256 of the arguments as stable JSON."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def preview(args: dict[str, Any], limit: int = PREVIEW_CHARS) -> str:
    """The payload's start on one line: `name=value` for each argument that is not the target."""
    parts = []
    for name in sorted(args):
        if name in _TARGET_ARGS:
            continue
        value = args[name]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
        parts.append(f"{name}={text}")
    line = " ".join(" ".join(parts).split())  # newlines and runs of spaces: one space
    return line if len(line) <= limit else line[: limit - 1] + "…"


def unknown_advice(call_id: str, target: str) -> str:
    """What to do about an effect whose outcome is unknown."""
    where = target or "the far side"
    return (f"it may or may not have reached {where}: look there for {call_id} (it is the Message-ID or "
            f"Idempotency-Key it was sent with), then run `sandboxd calls resolve {call_id} --outcome done` if it "
            "arrived or `--outcome failed` if it did not; it is never sent again before that, and a failed call "
            "may then be retried")


class Describer:
    """Fills the operator's fields of ledger and outbox views."""

    def __init__(self, target: Callable[[str, dict[str, Any]], str],
                 decisions: Callable[[list[str]], dict[str, tuple[str, str]]],
                 agent_ids: Callable[[list[str]], dict[str, list[str]]]) -> None:
        self.target = target
        self.decisions = decisions
        self.agent_ids = agent_ids

    def calls(self, calls: list[p.LedgerCall]) -> list[p.LedgerCall]:
        """The calls with target, preview, digest, the caller's ids, the latest decision and advice filled."""
        external = [c.call_id for c in calls if c.effect == "external"]
        decided, aliases = self.decisions(external), self.agent_ids(external)
        for call in calls:
            call.preview, call.digest = preview(call.args), digest(call.args)
            if call.effect != "external":
                continue
            call.target = self.target(call.tool, call.args)
            call.agent_call_ids = aliases.get(call.call_id, [])
            if call.call_id in decided:
                call.decided_by, call.reason = decided[call.call_id]
            if call.state == "unknown":
                call.advice = unknown_advice(call.call_id, call.target)
        return calls

    def held(self, held: list[p.HeldCall]) -> list[p.HeldCall]:
        """Held calls with target, preview, digest and the caller's ids filled."""
        aliases = self.agent_ids([h.call_id for h in held])
        for call in held:
            call.target = self.target(call.tool, call.args)
            call.preview, call.digest = preview(call.args), digest(call.args)
            call.agent_call_ids = aliases.get(call.call_id, [])
        return held
