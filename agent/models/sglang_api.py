"""SGLang's native HTTP API as this client speaks it: endpoint paths and message structs.

Every name here was read from sgl-project/sglang (main branch; the commits are those of the stored
copies read when this module was written):

- `python/sglang/srt/managers/io_struct.py` @001067ff: `GenerateReqInput` (`input_ids`,
  `sampling_params`, `rid`, `stream`, `return_logprob`, `session_params`, `cache_salt`; also
  `session_id`, which must not be combined with `session_params`), `SessionParams` (`id`, `rid`,
  `offset`, `replace`, `drop_previous_output`), `OpenSessionReqInput` (`capacity_of_str_len`,
  `session_id`, `streaming`, `timeout`), `CloseSessionReqInput` (`session_id`).
- `python/sglang/srt/sampling/sampling_params.py` @00c17caf: `max_new_tokens`, `temperature`
  (server default 1.0, so it is always sent), `stop_token_ids`, `sampling_seed`.
- `python/sglang/srt/managers/tokenizer_manager.py` @001067ff: a non-streaming `/generate` answers
  `{"text", "output_ids", "meta_info"}` with top-level `output_ids` (the whole completion);
  `meta_info` has `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`. An
  abort carrying status 400 becomes HTTP 400 `{"error": {"message"}}`, one carrying 500/503 becomes
  that HTTP status with `{"message", ...}`, any other abort is HTTP 200 with an abort finish reason.
  Older releases returned `output_ids` only in some modes; this client requires it.
- `python/sglang/srt/managers/schedule_batch.py`: `finish_reason` is `{"type": "stop", "matched"}`,
  `{"type": "length", "length"}` or `{"type": "abort", "message", "status_code", "err_type"}`.
- `python/sglang/srt/entrypoints/http_server.py` @0025436e: `GET /health` (200, or 503; empty body),
  `GET /get_model_info`, `POST /generate`, `POST /flush_cache` (200, or 400 while requests run),
  `POST /open_session` (answers the session id as a JSON string), `POST /close_session` (200, empty),
  `POST /tokenize`, `POST /detokenize`.
- `python/sglang/srt/entrypoints/openai/serving_tokenize.py` @0351c1fa: `/tokenize` takes `prompt`,
  `add_special_tokens` and answers `tokens`, `count`, `max_model_len`; `/detokenize` takes `tokens`,
  `skip_special_tokens` and answers `text`.
- `python/sglang/srt/managers/session_controller.py` @00385336: a session request continuing `rid`
  sees that request's `origin_input_ids + output_ids`, cut to `[:offset]` when `offset` is non-zero
  (an offset of 0 means "append"), followed by its own `input_ids`; `replace` drops the children of
  `rid` first.
- The radix cache never serves the last prompt token (`max_prefix_len = input_len - 1`), so
  `cached_tokens <= prompt_tokens - 1`.
"""

from __future__ import annotations

import msgspec

HEALTH = "/health"
MODEL_INFO = "/get_model_info"
GENERATE = "/generate"
FLUSH_CACHE = "/flush_cache"
OPEN_SESSION = "/open_session"
CLOSE_SESSION = "/close_session"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """`sampling_params` of a generate request; `temperature` has no default so it is always sent."""

    max_new_tokens: int
    temperature: float
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None


class SessionParams(msgspec.Struct, omit_defaults=True):
    """`session_params`: continue request `rid` of session `id`, cut at `offset`."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    """Body of `POST /generate` (non-streaming, token ids in and out)."""

    input_ids: list[int]
    sampling_params: SamplingParams
    rid: str | None = None
    stream: bool = False
    session_params: SessionParams | None = None
    cache_salt: str | None = None


class FinishReason(msgspec.Struct):
    """`meta_info.finish_reason`."""

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class MetaInfo(msgspec.Struct):
    """The `meta_info` keys this client reads; the server sends more, which are ignored."""

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerateResponse(msgspec.Struct):
    """Answer of a non-streaming `POST /generate`."""

    output_ids: list[int]
    meta_info: MetaInfo
    text: str | None = None


class OpenSessionRequest(msgspec.Struct, omit_defaults=True):
    """Body of `POST /open_session`."""

    capacity_of_str_len: int
    session_id: str | None = None


class CloseSessionRequest(msgspec.Struct):
    """Body of `POST /close_session`."""

    session_id: str


class TokenizeRequest(msgspec.Struct):
    """Body of `POST /tokenize`; `add_special_tokens` is always sent (the server adds BOS otherwise)."""

    prompt: str
    add_special_tokens: bool


class TokenizeResponse(msgspec.Struct):
    """Answer of `POST /tokenize` for a single prompt."""

    tokens: list[int]
    count: int
    max_model_len: int | None = None


class DetokenizeRequest(msgspec.Struct):
    """Body of `POST /detokenize`."""

    tokens: list[int]
    skip_special_tokens: bool


class DetokenizeResponse(msgspec.Struct):
    """Answer of `POST /detokenize` for a single token list."""

    text: str


class ModelInfo(msgspec.Struct):
    """Answer of `GET /get_model_info` (the keys this client reads)."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None
