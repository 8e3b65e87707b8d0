"""Tool calls read from a model turn, in the field's formats, with SGLang's own parsers.

Formats (`FORMATS`): `hermes` (Qwen2.5, Hermes: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`),
`llama3` (Llama 3.1/3.2 JSON calls, `{"name", "parameters"}`, optionally after `<|python_tag|>`),
`mistral` (`[TOOL_CALLS] [{"name", "arguments"}]`), and `json`, this project's own turn JSON that the
scripted policy writes. The first three are parsed by SGLang's detectors
(`sglang.srt.function_call.FunctionCallParser`, installed without its serving dependencies by the
`toolcalls` extra), imported only when such a format is used: the import takes seconds.

A turn that tries to call a tool and fails (malformed JSON, arguments that are not an object, a tool
the daemon does not serve) is not an error of the agent: each failed call becomes a `ToolStep` with
`error` set, which the runtime answers with an observation telling the model what was wrong, as agent
frameworks do. A turn with no call attempt is a final answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec

from agent.scenario import ToolStep, parse_turn

#: Our format names and the SGLang detector each maps to
FORMATS = {"hermes": "qwen25", "qwen25": "qwen25", "llama3": "llama3", "mistral": "mistral", "json": None}
_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


class ParsedTurn(msgspec.Struct, kw_only=True):
    """What a model turn holds: its calls (failed ones with `error`), its answer, and its plan (text before
    the calls)."""

    calls: list[ToolStep]
    errors: list[str | None]
    """Per call: None, or what was wrong with it (told to the model as the call's observation)."""
    answer: str | None
    plan: str


@lru_cache(maxsize=16)
def _parser(detector: str, tools_json: str) -> Any:
    try:
        from sglang.srt.entrypoints.openai.protocol import Function, Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
    except ImportError as exc:  # pragma: no cover - the extra is part of every set-up
        raise RuntimeError("tool-call parsing needs SGLang's parsers: pip install --no-deps sglang and "
                           "pip install 'sandboxd[toolcalls]'") from exc
    tools = [Tool(type="function", function=Function(name=t["function"]["name"],
                                                     description=t["function"].get("description", ""),
                                                     parameters=t["function"].get("parameters", {})))
             for t in json.loads(tools_json)]
    return FunctionCallParser(tools, detector)


class ToolCallParser:
    """Reads model turns of one format against the tools a session offers."""

    def __init__(self, fmt: str, tools: Sequence[dict[str, Any]]) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.format = fmt
        self.tools = list(tools)
        self.names = sorted(t["function"]["name"] for t in self.tools)

    def parse(self, text: str) -> ParsedTurn:
        """The calls, answer and plan of a turn; never raises on what a model wrote."""
        if FORMATS[self.format] is None:
            return self._parse_json(text)
        parser = _parser(FORMATS[self.format], json.dumps(self.tools, sort_keys=True))
        if not parser.has_tool_call(text):
            return ParsedTurn(calls=[], errors=[], answer=text.strip(), plan="")
        try:
            plain, items = parser.parse_non_stream(text)
        except Exception as exc:  # a detector that chokes on garbage: still only the model's mistake
            plain, items = "", []
            return self._failed(text, f"the tool call could not be parsed ({exc})")
        calls: list[ToolStep] = []
        errors: list[str | None] = []
        for item in items:
            arguments, problem = _arguments(item.parameters)
            calls.append(ToolStep(name=str(item.name), arguments=arguments))
            errors.append(problem)
        unknown = [n for n in _NAME.findall(text) if n not in self.names]
        for name in unknown:
            calls.append(ToolStep(name=name, arguments={}))
            errors.append(f"unknown tool {name!r}; the tools are: {', '.join(self.names)}")
        if not calls:
            return self._failed(text, _why_malformed(text))
        return ParsedTurn(calls=calls, errors=errors, answer=None, plan=str(plain or "").strip())

    def _failed(self, text: str, why: str) -> ParsedTurn:
        name = (_NAME.findall(text) or ["(unnamed)"])[0]
        return ParsedTurn(calls=[ToolStep(name=name, arguments={})], errors=[why], answer=None, plan="")

    def _parse_json(self, text: str) -> ParsedTurn:
        try:
            calls, answer, plan = parse_turn(text)
        except (ValueError, TypeError, AttributeError) as exc:
            return self._failed(text, f"malformed tool call: {exc}")
        errors: list[str | None] = [None if c.name in self.names or not self.names else
                                    f"unknown tool {c.name!r}; the tools are: {', '.join(self.names)}" for c in calls]
        return ParsedTurn(calls=calls, errors=errors, answer=answer, plan=plan)

    def format_call(self, call: ToolStep) -> str:
        """A call as this format writes it (what a model turn that makes it contains)."""
        if self.format in ("hermes", "qwen25"):
            return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"
        if self.format == "llama3":
            return json.dumps({"name": call.name, "parameters": call.arguments})
        if self.format == "mistral":
            return "[TOOL_CALLS] " + json.dumps([{"name": call.name, "arguments": call.arguments}])
        return json.dumps({"tool_calls": [{"type": "function", "function": {"name": call.name,
                                                                             "arguments": call.arguments}}]})


def _arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """Arguments as an object; a JSON string of an object is unwrapped (some models double-encode)."""
    value = raw
    for _ in range(2):
        if isinstance(value, str):
            try:
                value = json.loads(value or "{}")
            except json.JSONDecodeError as exc:
                return {}, f"the arguments are not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(value, dict):
        return {}, f"the arguments must be a JSON object, not {type(value).__name__}"
    return value, None


def _why_malformed(text: str) -> str:
    """What is wrong with a call attempt the detector could not read: the JSON error if there is one."""
    start = text.find("{")
    if start < 0:
        return "malformed tool call: no JSON object with a name and arguments"
    body = text[start:].split("</tool_call>")[0].strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"malformed tool call: invalid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(value, dict) or "name" not in value:
        return "malformed tool call: the JSON object needs a name and arguments"
    return "malformed tool call: it does not follow the format"
