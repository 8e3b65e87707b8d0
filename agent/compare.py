"""Comparing two sessions' final states: the test of forgetting is equality with a run that never saw z."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from agent.runtime import AgentSession

#: Python run inside a sandbox that prints its workspace tree: path, type, mode, size, digest
TREE_LISTING = (
    "import hashlib, json, os, stat\n"
    "out = []\n"
    "for base, dirs, files in os.walk('/workspace/', followlinks=False):\n"
    "    for name in sorted(dirs + files):\n"
    "        full = os.path.join(base, name); st = os.lstat(full)\n"
    "        kind = 'link' if stat.S_ISLNK(st.st_mode) else 'dir' if stat.S_ISDIR(st.st_mode) else 'file'\n"
    "        digest = os.readlink(full) if kind == 'link' else (\n"
    "            hashlib.sha256(open(full, 'rb').read()).hexdigest() if kind == 'file' else '')\n"
    "        out.append([os.path.relpath(full, '/workspace'), kind, oct(st.st_mode), st.st_size, digest])\n"
    "print(json.dumps(sorted(out)))\n"
)


# Ledger ids name an effect within one world (they derive from the session's lineage), so a fresh
# reference session gives the same email another id; comparisons mask them and nothing else.
_EFFECT_ID = re.compile(r"fx-[0-9a-f]{8,}")


def mask_effect_ids(text: str) -> str:
    """`text` with firewall ledger ids replaced by a placeholder."""
    return _EFFECT_ID.sub("fx-*", text)


Artifacts = list[tuple[str, str, str, tuple[str, ...]]]
"""Recorded artifacts as compared: (id, type, content with effect ids masked, parents)."""


class SessionState(msgspec.Struct, kw_only=True):
    """What a session ended with: its artifacts, context, sandbox tree, answer and effects."""

    artifacts: Artifacts
    context: str
    context_tokens: int
    tree: list[list[Any]]
    answer: str | None
    external: list[tuple[str, str]]


def final_state(agent: AgentSession) -> SessionState:
    """Read a session's final state from the daemon and the agent's engine."""
    client, sid = agent.client, agent.session_id
    graph = client.graph(sid)
    artifacts = [(a.artifact_id, str(a.type), mask_effect_ids(a.content), tuple(a.parents)) for a in graph.artifacts]
    listing = client.call(sid, "python", {"code": TREE_LISTING}, call_id=f"inspect/tree/{len(artifacts)}")
    tree = json.loads(listing.stdout)
    effects = [(c.tool, json.dumps(c.args, sort_keys=True)) for c in client.calls(sid)
               if c.effect == "external" and c.state not in ("orphaned", "dropped", "shadowed")]
    conversation = agent.conversation
    assert conversation is not None
    return SessionState(artifacts=artifacts, context=mask_effect_ids(conversation.text()),
                        context_tokens=len(conversation), tree=tree, answer=agent.answer(), external=effects)


def agreement(a: Any, b: Any, fields: tuple[str, ...] | None = None) -> dict[str, bool]:
    """Field-by-field equality of two final states (of `fields`, default every field), and `all`.

    The one agreement model: the evaluation's score (agent.eval.metrics) is its mean over answer and tree."""
    equal = {name: getattr(a, name) == getattr(b, name) for name in fields or a.__struct_fields__}
    return {**equal, "all": all(equal.values())}


def artifact_difference(mine: Artifacts, reference: Artifacts) -> tuple[int, int]:
    """(artifacts of `reference` missing from `mine`, artifacts of `mine` absent from `reference`)."""
    left, right = set(mine), set(reference)
    return len(right - left), len(left - right)


def counterfactual_artifact_distance(a: SessionState, b: SessionState) -> int:
    """CAD: artifacts in b's state missing from a's, plus artifacts in a's absent from b's."""
    return sum(artifact_difference(a.artifacts, b.artifacts))
