"""What the openai path sends back of a model turn: the server's own `tool_calls` in the API's shape, calls it
left in its content as the model wrote them (a server may drop the content of a message with tool_calls, and
the model must read its plan back). The endpoint is a double here; tests/integration/test_model_agent.py runs a
real `transformers serve`."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.conversation import MessageConversation
from agent.models.base import TokenMeter
from agent.models.fixture_data import tool_manifests
from agent.scenario import ToolStep
from agent.toolcalls import ToolCallParser


class Endpoint:
    """A chat-completions double answering one fixed message (content and native tool calls)."""

    def __init__(self, content: str, native: list[ToolStep]) -> None:
        self.content, self.native = content, native
        self.meter = TokenMeter()

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
                 sampling: Any) -> tuple[str, list[ToolStep]]:
        return self.content, self.native


plans = st.text(st.characters(codec="ascii", categories=["L", "N", "Zs"]), max_size=30).map(str.strip)
paths = st.from_regex(r"[a-z]{1,8}/[a-z0-9]{1,8}\.(csv|md|txt)", fullmatch=True)


def _turn(endpoint: Endpoint) -> tuple[MessageConversation, str, list[tuple[str, ToolStep]], str]:
    parser = ToolCallParser("hermes", tool_manifests())
    conversation = MessageConversation(endpoint, tool_manifests(), parser)
    conversation.add("user", "Read it.")
    text, _ = conversation.turn(64)
    parsed = parser.parse(text)
    calls = [(f"call-1-{k}", c) for k, c in enumerate(parsed.calls)]
    conversation.close_turn(text, calls, parsed.plan)
    return conversation, text, calls, parsed.plan


@settings(deadline=None, max_examples=40)
@given(plan=plans, path=paths)
def test_calls_left_in_the_content_go_back_as_the_model_wrote_them(plan: str, path: str) -> None:
    call = ToolStep(name="read_file", arguments={"path": path})
    written = "\n".join(filter(None, [plan, ToolCallParser("hermes", []).format_call(call)]))
    conversation, text, calls, parsed_plan = _turn(Endpoint(written, []))
    assert [c for _, c in calls] == [call] and parsed_plan == plan
    assert conversation.messages[-1] == {"role": "assistant", "content": written} and text == written


@settings(deadline=None, max_examples=40)
@given(plan=plans, path=paths)
def test_the_servers_own_tool_calls_go_back_as_tool_calls(plan: str, path: str) -> None:
    call = ToolStep(name="read_file", arguments={"path": path})
    conversation, _, calls, _ = _turn(Endpoint(plan, [call]))
    last = conversation.messages[-1]
    assert last["content"] == (plan or None)
    [sent] = last["tool_calls"]
    assert sent["function"] == {"name": "read_file", "arguments": json.dumps({"path": path})}
    assert sent["id"] == "call_" + calls[0][0].replace("-", "_")
