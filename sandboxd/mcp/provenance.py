"""What an MCP session records in the provenance graph: one tool call, one observation, a checkpoint between.

An MCP server never sees the client's model: no turns, no context. What it does see is every call the
model made and every result the model was given, in order, so it records those as `agent/runtime.py`
does for its own agent: a `tool_call` artifact before the call runs (write-ahead: the agent call id is
in its meta, so a retry after a restart finds it), a checkpoint before the result is handed over (and
before an external call), then the result as an `observation`, the step o_t the client consumed.

Dependencies are what the client could have known. A call depends on the call before it (the model
issued it later, knowing everything it knew then) and on every result handed over since that call was
issued; a result depends on its call. So everything handed over after a result is reachable from it,
and a result that was already on its way when another arrived is not. A turn is one call: on_commit
effects wait for `sandboxd commit SESSION TURN` with that number.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sandboxd import protocol as p

#: artifact and checkpoint ids are positional, as the agent runtime's, under a prefix of their own
CALL_PREFIX = "mcp-call-"
OBSERVATION_PREFIX = "mcp-obs-"
CHECKPOINT_PREFIX = "mcp-cp-"


@dataclass
class CallRecorder:
    """The session's positions (turn, step), the recorded ids and the dependency frontier."""

    turn: int = 0
    step: int = 0
    recorded: list[str] = field(default_factory=list)
    """Live artifact ids in recording order: a checkpoint's manifest."""
    last_call: str | None = None
    since_last_call: list[str] = field(default_factory=list)
    """Observations handed over since the last call was issued."""
    calls: dict[str, str] = field(default_factory=dict)
    """tool_call artifact id -> agent call id, for the calls still recorded."""

    def tool_call(self, tool: str, args: dict[str, Any], agent_call_id: str, signature: str,
                  key: str | None) -> p.Artifact:
        """The next call's artifact; advances the turn and the frontier."""
        self.turn += 1
        artifact = p.Artifact(
            artifact_id=f"{CALL_PREFIX}{self.turn}", type="tool_call",
            parents=[*([self.last_call] if self.last_call else []), *self.since_last_call],
            turn=self.turn, step=self.step, content=json.dumps({"name": tool, "arguments": args}, sort_keys=True),
            meta={"tool": tool, "agent_call_id": agent_call_id, "signature": signature, "key": key,
                  "issued_at": time.time()})
        self.last_call, self.since_last_call = artifact.artifact_id, []
        self.recorded.append(artifact.artifact_id)
        self.calls[artifact.artifact_id] = agent_call_id
        return artifact

    def checkpoint(self, reason: str, turn: int) -> p.CheckpointRecord:
        """A checkpoint at the current step: what a revocation restores before the next observation."""
        return p.CheckpointRecord(
            checkpoint_id=f"{CHECKPOINT_PREFIX}{self.step}-{turn}-{reason}", step=self.step, turn=turn,
            token_offset=0, cache_handle="", reason=reason,  # type: ignore[arg-type]
            manifest=list(self.recorded))

    def observation(self, call_artifact: str, text: str, meta: dict[str, Any], branch: str = "") -> p.Artifact:
        """The result handed over for a call: the next step."""
        self.step += 1
        artifact = p.Artifact(
            artifact_id=f"{OBSERVATION_PREFIX}{self.step}", type="observation", parents=[call_artifact],
            turn=self.turn, step=self.step, committed=not branch, content=text, meta=meta)
        self.recorded.append(artifact.artifact_id)
        self.since_last_call.append(artifact.artifact_id)
        return artifact

    def splice(self, checkpoint: p.CheckpointRecord) -> list[str]:
        """Go back to a checkpoint (the suffix after it is discarded); returns the discarded ids."""
        keep = set(checkpoint.manifest)
        discarded = [aid for aid in self.recorded if aid not in keep]
        self.recorded = [aid for aid in self.recorded if aid in keep]
        self.step, self.turn = checkpoint.step, checkpoint.turn
        calls = [aid for aid in self.recorded if aid.startswith(CALL_PREFIX)]
        self.last_call = calls[-1] if calls else None
        after = self.recorded.index(self.last_call) + 1 if self.last_call else 0
        self.since_last_call = [aid for aid in self.recorded[after:] if aid.startswith(OBSERVATION_PREFIX)]
        for aid in discarded:
            self.calls.pop(aid, None)
        return discarded

    def rebuild(self, artifacts: list[p.Artifact]) -> None:
        """Take up a session recorded before (attaching to it, or after a restart)."""
        mine = [a for a in artifacts if a.artifact_id.startswith((CALL_PREFIX, OBSERVATION_PREFIX))]
        self.recorded = [a.artifact_id for a in mine]
        self.calls = {a.artifact_id: str(a.meta.get("agent_call_id", "")) for a in mine if a.type == "tool_call"}
        self.turn = max((a.turn for a in mine if a.type == "tool_call"), default=0)
        self.step = max((a.step for a in artifacts if a.type in p.OBSERVATION_TYPES), default=0)
        calls = [a.artifact_id for a in mine if a.type == "tool_call"]
        self.last_call = calls[-1] if calls else None
        after = self.recorded.index(self.last_call) + 1 if self.last_call else 0
        self.since_last_call = [aid for aid in self.recorded[after:] if aid.startswith(OBSERVATION_PREFIX)]
