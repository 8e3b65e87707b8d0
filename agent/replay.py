"""What a replay may take from the record instead of recomputing it, and the certificate for each.

Lemma 2 forbids carrying over any state computed at or after tau, but not re-materializing content
whose value is fixed in the counterfactual world. Two kinds are taken from the record here:

- A read (a `read`-class tool that stays in the sandbox) is answered from its recorded, sanitized
  result when the replay makes the same call (same tool, same arguments) and nothing was written to
  the sandbox since the splice checkpoint, neither in the original before its read nor in the replay
  before this one: both then read the checkpoint's snapshot. Any write-class call counts as a write
  of everything. Tracking paths instead was rejected: a `write_file` through a symlink made before
  the checkpoint changes a file of another name, and the record cannot tell.
- A model turn is prefilled from its recorded tokens when it is independent of z as the graph
  certifies it: the original turn is outside the taint closure I(z) (none of its recorded parents is
  tainted), and the replayed context holds exactly the parents it had, with the same contents (an
  observation re-executed on the restored sandbox may read what a tainted write left, which the
  graph does not record, so contents are compared too). Same prompt tokens, deterministic decoding:
  same turn. The recorded token digest must match the re-tokenized turn, else it is decoded.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from sandboxd import protocol as p

#: artifact meta key of a model turn's token digest (header, content and tail of its span)
DIGEST = "tokens"


def token_digest(ids: Sequence[int]) -> str:
    """A digest of a run of token ids (byte order fixed, as checkpoint handles are)."""
    packed = array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return hashlib.blake2b(packed.tobytes(), digest_size=16).hexdigest()


def call_key(tool: str, arguments: dict[str, Any]) -> str:
    """A call's identity for reuse: its tool and its arguments in canonical JSON."""
    return tool + " " + json.dumps(arguments, sort_keys=True)


class RecordedTurn(msgspec.Struct, frozen=True):
    """A model turn of the original outside I(z): its text and its token digest."""

    text: str
    digest: str


class ReplayPlan:
    """The reusable reads and the independent turns of one revocation's replay (see the module docstring)."""

    def __init__(self, graph: Iterable[p.Artifact], plan: p.BeginRevocationResponse, effects: dict[str, str],
                 reusable_tools: Iterable[str]) -> None:
        artifacts = list(graph)
        by_id = {a.artifact_id: a for a in artifacts}
        closure = set(plan.closure)
        self.turns: dict[tuple[tuple[str, str], ...], RecordedTurn] = {}
        for a in artifacts:
            if a.type != "model_turn" or a.artifact_id in closure or DIGEST not in a.meta:
                continue
            if any(parent in closure or parent not in by_id for parent in a.parents):
                continue
            key = tuple((str(by_id[parent].type), by_id[parent].content) for parent in a.parents)
            self.turns[key] = RecordedTurn(text=a.content, digest=str(a.meta[DIGEST]))
        self.reads = _reusable_reads(artifacts, plan, effects, set(reusable_tools))
        self.wrote = False
        """True once the replay ran a write-class call: from then on no read is reused."""
        self.reused = 0
        self.prefilled_turns = 0

    def turn_for(self, context: Sequence[tuple[str, str]]) -> RecordedTurn | None:
        """The recorded turn for a context, if it is certified independent of z."""
        return self.turns.get(tuple(context))

    def read(self, tool: str, arguments: dict[str, Any]) -> str | None:
        """The recorded result of a read the replay is about to make, if reusing it is certified."""
        if self.wrote:
            return None
        return self.reads.get(call_key(tool, arguments))


def _reusable_reads(artifacts: list[p.Artifact], plan: p.BeginRevocationResponse, effects: dict[str, str],
                    reusable: set[str]) -> dict[str, str]:
    """Call key -> sanitized recorded result of the original's reads that saw the checkpoint's sandbox."""
    recorded = {r.call: r.content for r in plan.recorded}
    answered = {a.parents[0]: a.step for a in artifacts if a.type == "observation" and a.parents}
    calls = [a for a in artifacts if a.type == "tool_call"]
    # Calls in the order they ran: by the step of their result (a call with none ran last, if at all).
    calls.sort(key=lambda a: answered.get(a.artifact_id, sys.maxsize))
    out: dict[str, str] = {}
    for call in calls:
        step = answered.get(call.artifact_id, sys.maxsize)
        if step <= plan.checkpoint.step or call.artifact_id == plan.source_call:
            continue  # ran before the checkpoint: its effect is in the restored snapshot
        tool = str(call.meta.get("tool", ""))
        if "error" in call.meta:
            continue  # an invalid call was answered, not run
        if effects.get(tool, "write") == "write":
            break  # everything read after this may have seen what it wrote
        if tool in reusable and call.artifact_id in recorded:
            step_ = msgspec.json.decode(call.content)
            out.setdefault(call_key(tool, step_.get("arguments", {})), recorded[call.artifact_id])
    return out
