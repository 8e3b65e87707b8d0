"""The daemon's tools as MCP tools, and a call's outcome as an MCP tool result.

Annotations follow from the effect class (MCP's annotations are hints, never a security boundary):

| effect | readOnlyHint | openWorldHint | destructiveHint | idempotentHint |
|---|---|---|---|---|
| read | true | the manifest's `open_world` (`http_get`, a world's reads), else false | - | - |
| write | false | false | the manifest's `destructive`, else unset (MCP reads true) | - |
| external | false | true | the manifest's `destructive`, else true | false |

An external tool is not idempotent even though sandboxd never fires one intent twice: a second call with
the same arguments outside the retry window is a second email, and that is what the hint tells a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mcp_types as types
import msgspec

from sandboxd import protocol as p

#: the control tool `--close-tool` adds: the model may end the session (its sandbox is removed)
CLOSE_TOOL = "sandboxd_close_session"


def tool_annotations(manifest: p.ToolManifest) -> types.ToolAnnotations:
    """MCP annotations for a daemon tool, from its effect class and manifest."""
    if manifest.effect == "read":
        return types.ToolAnnotations(read_only_hint=True, open_world_hint=bool(manifest.open_world))
    if manifest.effect == "write":
        return types.ToolAnnotations(read_only_hint=False, open_world_hint=False,
                                     destructive_hint=manifest.destructive)
    return types.ToolAnnotations(
        read_only_hint=False, open_world_hint=True, idempotent_hint=False,
        destructive_hint=True if manifest.destructive is None else manifest.destructive)


def mcp_tool(manifest: p.ToolManifest) -> types.Tool:
    """A daemon tool as MCP lists it: name, description, the JSON schema as is, annotations."""
    return types.Tool(name=manifest.name, description=manifest.description, input_schema=manifest.parameters,
                      annotations=tool_annotations(manifest), _meta={"sandboxd/effect": manifest.effect})


def close_tool() -> types.Tool:
    return types.Tool(
        name=CLOSE_TOOL, description="End this sandboxd session: its sandbox and snapshots are removed and no "
        "further tool works.", input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        annotations=types.ToolAnnotations(read_only_hint=False, open_world_hint=False, destructive_hint=True,
                                          idempotent_hint=True))


@dataclass(frozen=True)
class Outcome:
    """What one call came to, as the client's model reads it; the same for every retry of the call."""

    text: str
    is_error: bool
    structured: dict[str, Any]
    observation: str | None = None
    """The artifact id the result was recorded as: what `sandboxd revoke --source` names."""


def result_outcome(result: p.CallResult) -> Outcome:
    """A daemon result: its text as the agent runtime shows it, the call's facts as structured content."""
    if result.state not in ("done",) and not result.simulated:
        text = f"[{result.state}] {result.stdout}"
    elif result.exit_code == 0:
        text = result.stdout
    else:
        text = f"exit {result.exit_code}\n{result.stdout}{result.stderr}"
    # stdout is the text already; a non-zero exit is a result (grep found nothing), not a failed call.
    structured = {k: v for k, v in msgspec.to_builtins(result).items() if k != "stdout"}
    return Outcome(text=text, is_error=result.state in ("failed", "unknown"), structured=structured)


def error_outcome(code: str, message: str, details: dict[str, Any] | None = None) -> Outcome:
    """A daemon error (or a refusal of the MCP layer) as a tool error the model can read and correct."""
    return Outcome(text=f"error {code}: {message}", is_error=True,
                   structured={"error": {"code": code, "message": message, "details": details or {}}})


def to_call_tool_result(outcome: Outcome, notices: list[dict[str, Any]] | None = None,
                        session_id: str | None = None) -> types.CallToolResult:
    """The MCP result; pending revocation notices ride in front, so the model reads them first."""
    content: list[types.ContentBlock] = []
    meta: dict[str, Any] = {"sandboxd/session": session_id} if session_id else {}
    if notices:
        content += [types.TextContent(text=notice["text"]) for notice in notices]
        meta["sandboxd/revocations"] = [{k: v for k, v in n.items() if k != "text"} for n in notices]
    content.append(types.TextContent(text=outcome.text))
    if outcome.observation is not None:
        meta["sandboxd/observation"] = outcome.observation
    return types.CallToolResult(content=content, structured_content=outcome.structured, is_error=outcome.is_error,
                                _meta=meta or None)
