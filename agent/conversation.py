"""How context blocks reach a model: as tokens (local, SGLang, scripted) or as chat messages (OpenAI API).

`TokenConversation` lays blocks out as token ids in a backend's session: through the model's chat
template (`agent.chat.ChatRenderer`) for a model directory that has one, else with the byte
tokenizer's role markers (the tiny seeded model of the scripted baselines). A model turn is the
template's turn header by prefill, then the model's own tokens, verbatim, then the template's tail.
Spans and checkpoints are token offsets.

`MessageConversation` keeps chat messages for a chat-completions endpoint: a block is a message, a
span is a message index range, a checkpoint is a message count with a digest of the messages
(restoring is truncating the list; the server's prefix cache, if any, serves the rest). A turn's calls
go back as `tool_calls` when the server returned them so; calls it left in its content go back as the
model wrote them, so the model reads its own turn back whatever the server does with `tool_calls`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol

from agent.chat import ChatRenderer
from agent.models.base import GREEDY, Checkpoint, ModelBackend, Sampling, TokenMeter, prefix_handle
from agent.models.errors import CheckpointInvalid
from agent.replay import token_digest
from agent.scenario import ToolStep

ROLE = {"system": "<|system|>", "memory": "<|system|>", "user": "<|user|>", "observation": "<|tool|>",
        "model_turn": "<|assistant|>", "summary": "<|assistant|>"}
END = "<|end|>"


class Conversation(Protocol):
    """The model side of a session, whatever the backend speaks."""

    @property
    def meter(self) -> TokenMeter: ...

    def __len__(self) -> int: ...

    def add(self, kind: str, text: str, *, tool: str | None = None, call_id: str | None = None) -> tuple[int, int]:
        """Append a block the model reads; its span."""
        ...

    def turn(self, max_tokens: int, sampling: Sampling) -> tuple[str, tuple[int, int]]:
        """Decode a model turn; its text and span (the turn stays open until `close_turn`)."""
        ...

    def close_turn(self, text: str, calls: Sequence[tuple[str, ToolStep]], plan: str) -> None:
        """Record the parsed turn (a message backend sends it back in the API's shape)."""
        ...

    def checkpoint(self) -> Checkpoint: ...

    def restore(self, checkpoint: Checkpoint, blocks: int) -> None:
        """Crop back to a checkpoint that held `blocks` blocks."""
        ...

    def crop(self, offset: int, blocks: int) -> None:
        """Crop back to `offset` (of the blocks held now), which held `blocks` blocks."""
        ...

    def digest(self, span: tuple[int, int]) -> str | None:
        """A digest of a span's tokens (None: this conversation has no tokens to digest)."""
        ...

    def replay_turn(self, text: str, digest: str | None) -> tuple[int, int] | None:
        """Prefill a recorded model turn (open until `close_turn`), if its tokens match `digest` (None: any);
        its span, or None with nothing appended."""
        ...

    def text(self) -> str:
        """What the model holds, as text (special tokens spelled out)."""
        ...


class TokenConversation:
    """Blocks as token ids in a `ModelBackend` (see the module docstring)."""

    def __init__(self, backend: ModelBackend, renderer: ChatRenderer | None = None) -> None:
        self.backend = backend
        self.renderer = renderer
        self._blocks = 0

    @property
    def meter(self) -> TokenMeter:
        return self.backend.meter

    def __len__(self) -> int:
        return len(self.backend)

    def _ids(self, text: str, framing: bool) -> list[int]:
        return self.backend.tokenize(text, specials=framing) if text else []

    def add(self, kind: str, text: str, *, tool: str | None = None, call_id: str | None = None) -> tuple[int, int]:
        start = len(self.backend)
        if self.renderer is None:
            ids = self._ids(ROLE[kind], True) + self._ids(text, False) + self._ids(END, True)
        else:
            pieces = self.renderer.add(kind, text, tool=tool)
            ids = [i for piece in pieces for i in self._ids(piece.text, piece.framing)]
        self.backend.append(ids)
        self._blocks += 1
        return start, len(self.backend)

    def turn(self, max_tokens: int, sampling: Sampling = GREEDY) -> tuple[str, tuple[int, int]]:
        start = len(self.backend)
        header = self.renderer.turn_header() if self.renderer else ROLE["model_turn"]
        tail = self.renderer.turn_tail() if self.renderer else END
        self.backend.append(self._ids(header, True))
        tail_ids = self._ids(tail, True)
        stops = [tail_ids[0]] if tail_ids else []
        result = self.backend.decode(max_tokens, stop_token_ids=stops, sampling=sampling)
        ids = list(result.token_ids)
        stopped = result.matched_stop is not None and ids and ids[-1] == result.matched_stop
        content = ids[:-1] if stopped else ids
        # The template's tail closes the turn: what the model did not write of it is appended. A turn
        # stopped by an EOS that is not the template's end token is left as the model closed it.
        if stopped and tail_ids and ids[-1] == tail_ids[0]:
            rest = tail_ids[1:]
        else:
            rest = [] if stopped else tail_ids
        if rest:
            self.backend.append(rest)
        return self.backend.detokenize(content), (start, len(self.backend))

    def close_turn(self, text: str, calls: Sequence[tuple[str, ToolStep]], plan: str) -> None:
        self._blocks += 1
        if self.renderer is not None:
            self.renderer.add_turn(text)

    def digest(self, span: tuple[int, int]) -> str | None:
        return token_digest(self.backend.token_ids()[span[0]:span[1]])

    def replay_turn(self, text: str, digest: str | None) -> tuple[int, int] | None:
        header = self.renderer.turn_header() if self.renderer else ROLE["model_turn"]
        tail = self.renderer.turn_tail() if self.renderer else END
        # The model's own tokens were kept verbatim; its text re-tokenized (its special spellings as the
        # specials it emitted) must give them back, which the digest checks.
        ids = self._ids(header, True) + self._ids(text, True) + self._ids(tail, True)
        if digest is not None and token_digest(ids) != digest:
            return None
        start = len(self.backend)
        self.backend.append(ids)
        return start, len(self.backend)

    def crop(self, offset: int, blocks: int) -> None:
        ids = self.backend.token_ids()
        kind = self.backend.checkpoint().cache_handle.split(":", 1)[0]
        self.restore(Checkpoint(offset=offset, cache_handle=prefix_handle(kind, ids, offset)), blocks)

    def checkpoint(self) -> Checkpoint:
        return self.backend.checkpoint()

    def restore(self, checkpoint: Checkpoint, blocks: int) -> None:
        self.backend.restore(checkpoint)
        self._blocks = blocks
        if self.renderer is not None:
            self.renderer.truncate(blocks)

    def text(self) -> str:
        return self.backend.detokenize(self.backend.token_ids())


class MessageBackend(Protocol):
    """A chat-completions endpoint (`agent.models.openai.OpenAIBackend`)."""

    @property
    def meter(self) -> TokenMeter: ...

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
                 sampling: Sampling) -> tuple[str, list[ToolStep]]: ...


def messages_handle(messages: Sequence[dict[str, Any]]) -> str:
    """The cache handle of a message list: its length and a digest of its canonical JSON."""
    digest = hashlib.blake2b(json.dumps(list(messages), sort_keys=True).encode(), digest_size=16).hexdigest()
    return f"openai:{len(messages)}:{digest}"


class MessageConversation:
    """Blocks as chat messages for a chat-completions endpoint (see the module docstring)."""

    def __init__(self, backend: MessageBackend, tools: list[dict[str, Any]], call_format: Any) -> None:
        self.backend = backend
        self.tools = tools
        self.format = call_format
        self.messages: list[dict[str, Any]] = []
        self._native: list[ToolStep] = []

    @property
    def meter(self) -> TokenMeter:
        return self.backend.meter

    def __len__(self) -> int:
        return len(self.messages)

    def add(self, kind: str, text: str, *, tool: str | None = None, call_id: str | None = None) -> tuple[int, int]:
        start = len(self.messages)
        if kind == "observation":
            self.messages.append({"role": "tool", "tool_call_id": _wire_id(call_id or f"call-{start}"),
                                  "content": text})
        else:
            role = {"system": "system", "memory": "system", "user": "user"}.get(kind, "assistant")
            self.messages.append({"role": role, "content": text})
        return start, len(self.messages)

    def turn(self, max_tokens: int, sampling: Sampling = GREEDY) -> tuple[str, tuple[int, int]]:
        start = len(self.messages)
        content, native = self.backend.complete(self.messages, self.tools, max_tokens, sampling)
        self._native = native
        # Calls the server parsed are written back into the turn in the model's format, so the turn's
        # text alone says what it did (the graph keeps it; a resumed session re-reads it).
        text = "\n".join([content.strip(), *(self.format.format_call(c) for c in native)]).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text, (start, start + 1)

    def close_turn(self, text: str, calls: Sequence[tuple[str, ToolStep]], plan: str) -> None:
        if not calls or not self._native:
            # No calls; or a server that left the calls in its content (it did not parse the model's format):
            # the turn goes back as the model wrote it. Such a server may not render `tool_calls` the way the
            # model writes them (`transformers serve` drops an assistant message's content, the plan, when it
            # has tool_calls), and the model must read its own turn back.
            return
        # The API's own shape: the calls as tool_calls (arguments as a JSON string), their ids answered by
        # the tool messages that follow; the plan stays the content.
        self.messages[-1] = {"role": "assistant", "content": plan or None, "tool_calls": [
            {"id": _wire_id(cid), "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for cid, call in calls]}

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(offset=len(self.messages), cache_handle=messages_handle(self.messages))

    def crop(self, offset: int, blocks: int) -> None:
        del self.messages[offset:]

    def digest(self, span: tuple[int, int]) -> str | None:
        return None

    def replay_turn(self, text: str, digest: str | None) -> tuple[int, int] | None:
        return None  # the server renders the messages: no token digest certifies a recorded turn here

    def restore(self, checkpoint: Checkpoint, blocks: int) -> None:
        if checkpoint.offset > len(self.messages) or \
                messages_handle(self.messages[:checkpoint.offset]) != checkpoint.cache_handle:
            raise CheckpointInvalid(checkpoint.offset, "the conversation no longer holds these messages")
        del self.messages[checkpoint.offset:]

    def text(self) -> str:
        return "".join(f"<|{m['role']}|>{m.get('content') or ''}{json.dumps(m.get('tool_calls') or '')}"
                       for m in self.messages)


def _wire_id(call_id: str) -> str:
    """A tool-call id as APIs accept it (letters, digits, underscores)."""
    return "call_" + "".join(ch if ch.isalnum() else "_" for ch in call_id)
