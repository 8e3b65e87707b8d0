"""Tool calls in the field's formats, parsed by SGLang's detectors: round trips over generated calls, each
format's documented shape, and malformed or unknown calls answered, never raised."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.scenario import ToolStep
from agent.toolcalls import ToolCallParser

pytest.importorskip("sglang.srt.function_call.function_call_parser")

TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}}
    for name in ("read_file", "write_file", "send_email")]
FORMATS = ("hermes", "llama3", "mistral", "json")

values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=3), max_leaves=6)
calls = st.builds(ToolStep, name=st.sampled_from(["read_file", "write_file", "send_email"]),
                  arguments=st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=4))


@settings(max_examples=40, deadline=None)
@given(call=calls, fmt=st.sampled_from(FORMATS))
def test_a_call_written_in_a_format_reads_back(call: ToolStep, fmt: str) -> None:
    parser = ToolCallParser(fmt, TOOLS)
    parsed = parser.parse(parser.format_call(call))
    assert parsed.calls == [call] and parsed.errors == [None] and parsed.answer is None


@pytest.mark.parametrize(("fmt", "text", "expected"), [
    # Qwen2.5 / Hermes: a plan, then the call in tags
    ("hermes", 'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>',
     ("Reading it.", [ToolStep(name="read_file", arguments={"path": "a.txt"})])),
    ("hermes", '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "write_file", "arguments": {"path": "b"}}\n</tool_call>',
     ("", [ToolStep(name="read_file", arguments={"path": "a"}), ToolStep(name="write_file", arguments={"path": "b"})])),
    # Llama 3.1: a bare JSON call with "parameters", or after <|python_tag|>
    ("llama3", '{"name": "read_file", "parameters": {"path": "a"}}',
     ("", [ToolStep(name="read_file", arguments={"path": "a"})])),
    ("llama3", '<|python_tag|>{"name": "read_file", "parameters": {"n": 3}}',
     ("", [ToolStep(name="read_file", arguments={"n": 3})])),
    # Mistral: [TOOL_CALLS] and a JSON list
    ("mistral", '[TOOL_CALLS] [{"name": "send_email", "arguments": {"path": "x"}}]',
     ("", [ToolStep(name="send_email", arguments={"path": "x"})])),
])
def test_documented_examples(fmt: str, text: str, expected: tuple[str, list[ToolStep]]) -> None:
    parsed = ToolCallParser(fmt, TOOLS).parse(text)
    assert (parsed.plan, parsed.calls) == expected and all(e is None for e in parsed.errors)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_plain_text_is_an_answer(fmt: str) -> None:
    parsed = ToolCallParser(fmt, TOOLS).parse("Q3 revenue was 1,250,000.")
    assert parsed.calls == [] and parsed.answer == "Q3 revenue was 1,250,000."


@pytest.mark.parametrize(("fmt", "text", "why"), [
    ("hermes", '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"</tool_call>', "invalid JSON"),
    ("hermes", "<tool_call>\n</tool_call>", "malformed"),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "unknown tool 'rm_rf'"),
    ("hermes", '<tool_call>\n{"name": "read_file", "arguments": "[1, 2]"}\n</tool_call>', "JSON object"),
    ("mistral", '[TOOL_CALLS] [{"name": "read_file", "arguments": {"pa', "invalid JSON"),
    ("mistral", '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', "unknown tool 'nope'"),
    ("json", '{"tool_calls": [{"function": {"name": "read_file", "arguments": "{bad"}}]}', "malformed"),
])
def test_a_bad_call_is_explained_not_raised(fmt: str, text: str, why: str) -> None:
    parsed = ToolCallParser(fmt, TOOLS).parse(text)
    assert parsed.calls and parsed.answer is None
    assert any(e is not None and why in e for e in parsed.errors), parsed.errors


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200), fmt=st.sampled_from(FORMATS))
def test_any_text_parses_without_raising(text: str, fmt: str) -> None:
    parsed: Any = ToolCallParser(fmt, TOOLS).parse("<tool_call>\n" + text if fmt == "hermes" else text)
    assert len(parsed.calls) == len(parsed.errors)
    assert parsed.answer is not None or parsed.calls
