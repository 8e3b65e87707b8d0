"""Prompts in the model's own chat template, rendered append-only so checkpoints stay token offsets.

A checkpoint is a token offset, so the tokens of blocks[:k] must be a prefix of those of
blocks[:k+1]. Each block is therefore rendered as a delta: the template applied to the messages so
far plus the new one, minus the template applied to the messages so far. Templates that keep that
difference a pure suffix ("prefix-stable") render exactly as a whole-conversation rendering would.
Some do not: Qwen2.5's merges consecutive tool results into one user turn (closing the turn only
after the last), Mistral's moves the tool list before the last user message. For those the new
message is rendered after the first message alone (`[first, new] - [first]`), which keeps the
session append-only at the price of a rendering the template would have laid out differently
(consecutive results in separate turns; the tool list before each user message). `exact` says
which of the two a block got. A template that folds an earlier message into a later one (Mistral's
puts the system prompt inside the last user message) renders that message's content again inside
the later block, as content; the earlier block's own span holds only its framing.

Every message is rendered with a placeholder for its content, and the content is tokenized apart
from the framing: the framing's special-token spellings become special tokens, the content's never
do, so a tool result that spells `<|im_end|>` cannot forge a turn boundary. A model turn is not
rendered at all: the turn header is prefilled, the model's own tokens are kept verbatim, and the
template's tail after the content (`<|im_end|>\\n`: its end token is the stop token, the rest is
appended) closes it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

_OPEN, _CLOSE = "\ue000", "\ue001"
"""Private-use characters around a placeholder's index: no template or content produces them."""
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

#: The chat role of each context-block type
ROLES = {"system": "system", "memory": "system", "user": "user", "observation": "tool", "model_turn": "assistant",
         "summary": "assistant"}


class TemplateError(Exception):
    """The chat template cannot render this conversation append-only."""


class Piece(msgspec.Struct, frozen=True):
    """A run of a block's text: template framing (special spellings parsed) or message content (never)."""

    text: str
    framing: bool


def _placeholder(i: int) -> str:
    return f"{_OPEN}{i}{_CLOSE}"


class ChatRenderer:
    """A tokenizer's chat template over context blocks; see the module docstring for the contract."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = (), *, template: str | None = None,
                 memory_role: str = "system") -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template = template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat_template: pass one, or use a model directory with one")
        self.roles = {**ROLES, "memory": memory_role}
        self._messages: list[dict[str, Any]] = []
        self._contents: list[str] = []
        self.exact = True
        """False once a block was rendered by the fallback (the template is not prefix-stable here)."""
        self._header, self._tail = self._turn_frame()

    @classmethod
    def from_dir(cls, path: str | Path, tools: Sequence[dict[str, Any]] = (), **kw: Any) -> ChatRenderer:
        """The chat template of a local model directory (its tokenizer_config.json)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), tools, **kw)

    # Rendering ---------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, Any]], *, generation: bool = False) -> str:
        """The template applied to messages, tools included, as text."""
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
        if self.template is not None:
            kwargs["chat_template"] = self.template
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tools=self.tools or None, **kwargs)
        except Exception as exc:  # jinja's TemplateError, a template's raise_exception, a missing key
            raise TemplateError(f"the chat template refused the conversation: {exc}") from exc
        return str(text)

    def message(self, kind: str, index: int, *, tool: str | None = None) -> dict[str, Any]:
        """The chat message of a block, its content a placeholder."""
        message: dict[str, Any] = {"role": self.roles[kind], "content": _placeholder(index)}
        if message["role"] == "tool":
            message["name"] = tool or "tool"
            message["tool_call_id"] = f"call_{index}"
        return message

    def _turn_frame(self) -> tuple[str, str]:
        """The assistant turn's header (generation prompt) and its tail after the content."""
        base = [{"role": "system", "content": _placeholder(0)}, {"role": "user", "content": _placeholder(1)}]
        plain = self.render(base)
        prompted = self.render(base, generation=True)
        if not prompted.startswith(plain):
            raise TemplateError("the generation prompt is not appended after the conversation")
        header = prompted[len(plain):]
        full = self.render([*base, {"role": "assistant", "content": _placeholder(2)}])
        if not full.startswith(plain) or _placeholder(2) not in full:
            raise TemplateError("an assistant turn does not follow the conversation before it")
        after = full[len(plain):]
        head, tail = after.split(_placeholder(2), 1)
        if head.strip() != header.strip():
            raise TemplateError(f"the assistant turn opens with {head!r}, the generation prompt is {header!r}")
        return header, tail

    def add(self, kind: str, content: str, *, tool: str | None = None) -> list[Piece]:
        """The pieces that append a non-model block to the session."""
        index = len(self._messages)
        message = self.message(kind, index, tool=tool)
        before = self.render(self._messages) if self._messages else ""
        after = self.render([*self._messages, message])
        if after.startswith(before) and (_placeholder(index) in after[len(before):] or not self._messages):
            # (The first message may render nothing of its own: a template that folds it into a later one.)
            delta, exact = after[len(before):], True
        else:
            first = self._messages[:1]
            alone = self.render(first)
            with_new = self.render([*first, message])
            if not with_new.startswith(alone):
                raise TemplateError(f"cannot append a {kind} block: the template rewrites the first message")
            delta, exact = with_new[len(alone):], False
        count = delta.count(_placeholder(index))
        if count > 1 or (count == 0 and self._messages):
            raise TemplateError(f"the template renders a {kind} block together with other messages")
        self.exact = self.exact and exact
        self._messages.append(message)
        self._contents.append(content)
        # A template may fold an earlier message into this one (Mistral's puts the system prompt in the last
        # user message): its content is rendered here again, as content, never as framing.
        parts = _PLACEHOLDER.split(delta)
        pieces = [Piece(part, True) if n % 2 == 0 else Piece(self._contents[int(part)], False)
                  for n, part in enumerate(parts)]
        return [p for p in pieces if p.text]

    def turn_header(self) -> str:
        """Framing prefilled before a model turn (e.g. `<|im_start|>assistant\\n`)."""
        return self._header

    def turn_tail(self) -> str:
        """Framing after a model turn's content (e.g. `<|im_end|>\\n`); its first token is the stop token."""
        return self._tail

    def add_turn(self, content: str) -> None:
        """Record a model turn (its tokens are the model's own, appended by the caller)."""
        index = len(self._messages)
        self._messages.append({"role": "assistant", "content": _placeholder(index)})
        self._contents.append(content)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far as chat messages with their real contents."""
        return [{**m, "content": c} for m, c in zip(self._messages, self._contents, strict=True)]

    def truncate(self, count: int) -> None:
        """Keep the first `count` messages (a restored checkpoint)."""
        del self._messages[count:]
        del self._contents[count:]

    def whole(self) -> str:
        """The template's own rendering of the whole conversation (for comparison with the deltas)."""
        text = self.render(self._messages)
        for i, content in enumerate(self._contents):
            text = text.replace(_placeholder(i), content)
        return text
