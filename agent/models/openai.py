"""A model behind any OpenAI-compatible chat-completions endpoint: SGLang's and vLLM's `/v1`, llama.cpp's
server, `transformers serve`, hosted APIs.

The session is a list of messages (`agent.conversation.MessageConversation`); each turn is one
`POST {base}/chat/completions` with the whole list and the tools. Tool calls are read from the
answer's `tool_calls`; a server that leaves them in the content (`transformers serve` returns the
model's text with special tokens stripped, tool-call markup included) is read by the runtime's
parser, the same as a token backend's turn, and that turn is sent back as the model wrote it (not as
`tool_calls`, whose content such a server may drop: see `agent.conversation.MessageConversation`).
The meter reads `usage`: `prompt_tokens` less `prompt_tokens_details.cached_tokens` is prefilled,
`completion_tokens` decoded, the cached tokens reused (a server that reports no cache reports 0, and the
whole prompt counts as recomputed).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from agent.models.base import GREEDY, Sampling, TokenMeter
from agent.models.errors import BackendHTTPError, BackendTimeout, BackendUnavailable, ProtocolMismatch
from agent.scenario import ToolStep


class OpenAIBackend:
    """One chat-completions endpoint and model; see the module docstring."""

    KIND = "openai"

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                 client: httpx.Client | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns = client is None
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self.timeout_s = timeout_s
        self._meter = TokenMeter()
        self.last_usage: dict[str, Any] = {}

    @property
    def meter(self) -> TokenMeter:
        """Everything the server metered for this backend."""
        return self._meter

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
                 sampling: Sampling = GREEDY) -> tuple[str, list[ToolStep]]:
        """One turn: the answer's content and the tool calls the server parsed."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": sampling.temperature, "stream": False}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if tools:
            body["tools"] = tools
        url = f"{self.base}/chat/completions"
        try:
            response = self._client.post(url, json=body)
        except httpx.TimeoutException as exc:
            raise BackendTimeout(url, self.timeout_s) from exc
        except httpx.TransportError as exc:
            raise BackendUnavailable(url, str(exc) or type(exc).__name__) from exc
        if response.status_code >= 400:
            raise BackendHTTPError(url, response.status_code, response.text.strip()[:500])
        try:
            answer = response.json()
            message = answer["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ProtocolMismatch(f"{url}: not a chat completion: {response.text[:200]!r}") from exc
        usage = answer.get("usage") or {}
        self.last_usage = usage
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        prompt = int(usage.get("prompt_tokens") or 0)
        self._meter += TokenMeter(prefilled=max(prompt - cached, 0), decoded=int(usage.get("completion_tokens") or 0),
                                  reused=cached)
        calls = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            raw = fn.get("arguments") or "{}"
            try:
                arguments = json.loads(raw) if isinstance(raw, str) else raw
            except json.JSONDecodeError:
                arguments = {"_unparsed": raw}
            calls.append(ToolStep(name=str(fn.get("name", "")), arguments=arguments if isinstance(arguments, dict)
                                  else {"_unparsed": raw}))
        return str(message.get("content") or ""), calls

    def close(self) -> None:
        """Close the HTTP client this backend made."""
        if self._owns:
            self._client.close()
