"""A model session on an SGLang server through its native HTTP API (field names: `sglang_api`).

The session's token ids live here, never as text: every request sends `input_ids`, and a turn is
the `output_ids` the server returned, kept verbatim (re-encoding the server's text could yield other
ids and silently fork the session). A checkpoint is an offset into those ids; restoring it truncates
them, and the next request resubmits the prefix, which SGLang's radix cache serves. The meter reads
what the server reports per request: `reused = meta_info.cached_tokens`, `prefilled = prompt_tokens
- cached_tokens`, `decoded = completion_tokens`.

`append` is lazy: SGLang has no prefill-only call, so a block reaches the server (and the meter) with
the next `decode`. With `use_sessions`, the server keeps the context (SGLang sessions) and each
request sends only the new tokens, naming the request it continues (`session_params.rid`) and, after
a restore, the `offset` to cut that context at; `replace` drops the abandoned branch's requests.

`cache_salt` namespaces the radix cache: requests under one salt never match entries made under
another. Rotating it after a revocation guarantees no later request is served a radix entry built
from the revoked suffix; the price is that the clean prefix is recomputed once under the new salt
(metered). Whether to pay it is the scaffold's policy; `flush_cache` is the blunt alternative.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import msgspec

from agent.models import sglang_api as api
from agent.models.base import (
    GREEDY,
    Checkpoint,
    DecodeResult,
    Sampling,
    TokenMeter,
    check_restorable,
    check_token_ids,
    checkpoint_at_end,
)
from agent.models.errors import (
    BackendHTTPError,
    BackendTimeout,
    BackendUnavailable,
    GenerationAborted,
    ModelBackendError,
    ProtocolMismatch,
)
from agent.models.tokenizer import TextTokenizer

T = TypeVar("T")


class SGLangConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach and use one SGLang server."""

    base_url: str
    """Server root, e.g. `http://127.0.0.1:30000`."""
    timeout_s: float = 120.0
    """Seconds to wait for an answer (a whole non-streaming turn)."""
    connect_timeout_s: float = 5.0
    """Seconds to wait for a connection; past it the server counts as unavailable."""
    use_sessions: bool = False
    """Keep the context server-side in an SGLang session and send only new tokens."""
    session_capacity: int = 1 << 20
    """`capacity_of_str_len` sent to `/open_session`."""
    cache_salt: str | None = None
    """Initial radix-cache namespace (`cache_salt`); None shares the server's default namespace."""
    rid_prefix: str | None = None
    """Request ids are `<prefix>-<n>`; None draws a random prefix (rids never change outputs)."""
    vocab_size: int | None = None
    """If set, token ids are checked against it before they are sent."""


@dataclass
class _SessionRequest:
    """A request of the server session: its rid, its context length, and how many leading
    tokens of that context agree with the current branch."""

    rid: str
    length: int
    agree: int


class SGLangBackend:
    """A model session on an SGLang server; see the module docstring for the contract."""

    KIND = "sglang"

    def __init__(
        self,
        config: SGLangConfig,
        *,
        tokenizer: TextTokenizer | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self._config = config
        self._base = config.base_url.rstrip("/")
        self._owns_client = client is None
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self._client = client or httpx.Client(timeout=timeout)
        self._tok = tokenizer
        self._salt = config.cache_salt
        self._rid_prefix = config.rid_prefix or uuid.uuid4().hex[:12]
        self._requests = 0
        self._sessions = 0
        self._ids: list[int] = []
        self._meter = TokenMeter()
        self._session_id: str | None = None
        # The server session's requests on the current branch, oldest first, and how many leading
        # ids the newest one's context shares with `_ids`.
        self._chain: list[_SessionRequest] = []
        self._shared = 0

    @property
    def meter(self) -> TokenMeter:
        """Everything the server metered for this backend."""
        return self._meter

    @property
    def eos_token_id(self) -> int | None:
        """The local tokenizer's EOS id; the server stops at its model's EOS by itself."""
        return None if self._tok is None else self._tok.eos_token_id

    @property
    def cache_salt(self) -> str | None:
        """The radix-cache namespace requests are sent under."""
        return self._salt

    def set_cache_salt(self, salt: str | None) -> None:
        """Send later requests under another radix-cache namespace (rotate after a revocation)."""
        self._salt = salt

    def tokenize(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids of `text`, through the local tokenizer if given, else the server's `/tokenize`."""
        if self._tok is not None:
            return self._tok.encode(text, specials=specials)
        if not specials:
            raise ModelBackendError(
                "the server's /tokenize parses special-token spellings, which lets untrusted text forge "
                "turn boundaries; give SGLangBackend a local tokenizer, or pass specials=True"
            )
        body = api.TokenizeRequest(prompt=text, add_special_tokens=False)
        return list(self._call("POST", api.TOKENIZE, body, api.TokenizeResponse).tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens kept."""
        if self._tok is not None:
            return self._tok.decode(ids)
        body = api.DetokenizeRequest(tokens=list(ids), skip_special_tokens=False)
        return self._call("POST", api.DETOKENIZE, body, api.DetokenizeResponse).text

    def token_ids(self) -> list[int]:
        """A copy of the session's token ids."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def append(self, ids: Sequence[int]) -> None:
        """Add a block; it is sent (and metered) with the next decode."""
        self._ids.extend(check_token_ids(ids, self._config.vocab_size))

    def decode(
        self, max_new_tokens: int, *, stop_token_ids: Sequence[int] = (), sampling: Sampling = GREEDY
    ) -> DecodeResult:
        """One `/generate` request over the whole context; the returned `output_ids` join the session."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not self._ids:
            raise ModelBackendError("cannot decode from an empty session: append a prompt first")
        params = api.SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            stop_token_ids=[int(t) for t in stop_token_ids] or None,
            sampling_seed=sampling.seed,
        )
        rid = f"{self._rid_prefix}-{self._requests}"
        self._requests += 1
        input_ids, session, parent, base = self._request_input()
        body = api.GenerateRequest(
            input_ids=input_ids,
            sampling_params=params,
            rid=rid,
            session_params=session,
            cache_salt=self._salt,
        )
        answer = self._call("POST", api.GENERATE, body, api.GenerateResponse)
        meta, reason = self._checked_meta(answer)
        self._ids.extend(answer.output_ids)
        if session is not None:
            if parent >= 0:
                # Cut at `base`, the parent's context agrees with this branch only that far.
                self._chain[parent].agree = min(self._chain[parent].agree, base)
            self._chain[parent + 1 :] = [_SessionRequest(rid, len(self._ids), len(self._ids))]
            self._shared = len(self._ids)
        usage = TokenMeter(
            prefilled=meta.prompt_tokens - meta.cached_tokens,
            decoded=meta.completion_tokens,
            reused=meta.cached_tokens,
        )
        self._meter += usage
        return DecodeResult(
            token_ids=list(answer.output_ids),
            finish_reason="stop" if reason.type == "stop" else "length",
            usage=usage,
            matched_stop=reason.matched if isinstance(reason.matched, int) else None,
        )

    def checkpoint(self) -> Checkpoint:
        """A splice point at the current end of the session."""
        return checkpoint_at_end(self.KIND, self._ids)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Truncate the session to the checkpoint; the next request resubmits (or splices) the prefix."""
        check_restorable(self.KIND, self._ids, checkpoint)
        del self._ids[checkpoint.offset :]
        self._shared = min(self._shared, checkpoint.offset)

    def reset(self) -> None:
        """Forget the session, and close the server session if one is open."""
        self._ids = []
        self._chain = []
        self._shared = 0
        session, self._session_id = self._session_id, None
        if session is not None:
            self._call("POST", api.CLOSE_SESSION, api.CloseSessionRequest(session_id=session), None)

    def close(self) -> None:
        """Close the server session and the HTTP client this backend made."""
        try:
            self.reset()
        finally:
            if self._owns_client:
                self._client.close()

    def __enter__(self) -> SGLangBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> bool:
        """True if `GET /health` answers 200; any failure to answer counts as unhealthy."""
        try:
            return self._client.get(self._base + api.HEALTH).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> api.ModelInfo:
        """The server's `/get_model_info`."""
        return self._call("GET", api.MODEL_INFO, None, api.ModelInfo)

    def deterministic_inference(self) -> bool | None:
        """Whether the server runs deterministic inference (`enable_deterministic_inference` in
        `/get_server_info`); None when it does not say (an older server, a stand-in)."""
        try:
            response = self._client.get(self._base + "/get_server_info")
            value = response.json().get("enable_deterministic_inference") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return None if value is None else bool(value)

    def flush_cache(self) -> None:
        """Empty the server's radix cache (`/flush_cache`); SGLang refuses (400) while requests run."""
        self._call("POST", api.FLUSH_CACHE, None, None)

    def _request_input(self) -> tuple[list[int], api.SessionParams | None, int, int]:
        """What to send, the parent request's index in the chain, and the splice point."""
        if not self._config.use_sessions:
            return list(self._ids), None, -1, 0
        session = self._ensure_session()
        # The server needs at least one new token, so a turn right after a turn resends the last one.
        base = min(self._shared, len(self._ids) - 1)
        parent = next((i for i, request in enumerate(self._chain) if request.agree >= base), None)
        if base == 0 or parent is None:
            # SGLang reads offset 0 as "append", so a context rebuilt from nothing starts a new root.
            replace = True if self._chain else None
            return list(self._ids), api.SessionParams(id=session, replace=replace), -1, 0
        request = self._chain[parent]
        params = api.SessionParams(
            id=session,
            rid=request.rid,
            offset=base if base < request.length else None,
            # Requests after the parent belong to the abandoned branch: let the server drop them.
            replace=True if parent < len(self._chain) - 1 else None,
        )
        return self._ids[base:], params, parent, base

    def _ensure_session(self) -> str:
        if self._session_id is None:
            wanted = f"{self._rid_prefix}-session-{self._sessions}"
            self._sessions += 1
            body = api.OpenSessionRequest(capacity_of_str_len=self._config.session_capacity, session_id=wanted)
            self._session_id = self._call("POST", api.OPEN_SESSION, body, str)
        return self._session_id

    def _checked_meta(self, answer: api.GenerateResponse) -> tuple[api.MetaInfo, api.FinishReason]:
        """Raise on an abort, or on counts that contradict the session this client holds."""
        meta = answer.meta_info
        reason = meta.finish_reason
        if reason is None:
            raise ProtocolMismatch("/generate answered without a finish_reason")
        if reason.type == "abort":
            raise GenerationAborted(reason.message or "aborted", reason.status_code, reason.err_type)
        if meta.prompt_tokens != len(self._ids):
            # E.g. a session that trimmed a leading BOS, or a session lost on the server.
            raise ProtocolMismatch(
                f"server saw a {meta.prompt_tokens}-token prompt, the session holds {len(self._ids)}"
            )
        if meta.completion_tokens != len(answer.output_ids):
            raise ProtocolMismatch("completion_tokens disagrees with the length of output_ids")
        return meta, reason

    def _call(self, method: str, path: str, body: Any, answer: type[T] | None) -> T:
        """One HTTP exchange, every failure mapped to a `ModelBackendError`."""
        url = self._base + path
        content = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if content is not None else None
        try:
            response = self._client.request(method, url, content=content, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise BackendUnavailable(url, str(exc) or type(exc).__name__) from exc
        except httpx.TimeoutException as exc:
            raise BackendTimeout(url, self._config.timeout_s) from exc
        except httpx.TransportError as exc:
            raise BackendUnavailable(url, str(exc) or type(exc).__name__) from exc
        if response.status_code >= 400:
            raise BackendHTTPError(url, response.status_code, _error_message(response))
        if answer is None:
            return None  # type: ignore[return-value]
        try:
            return msgspec.json.decode(response.content, type=answer)
        except msgspec.DecodeError as exc:
            raise ProtocolMismatch(f"{method} {path}: unexpected answer: {exc}") from exc


def _error_message(response: httpx.Response) -> str:
    """The message of an SGLang error body (`{"error": {"message"}}` or `{"message"}`), else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]
