"""Model backends of the agent runtime: one interface (`base.ModelBackend`), three backends.

- `sglang.SGLangBackend`: an SGLang server over its native HTTP API, reuse metered by its radix cache;
- `local.LocalBackend`: a `transformers` model in process with a live KV cache (imports torch);
- `scripted.ScriptedBackend`: a policy's chosen turns teacher-forced through a `LocalBackend`.

Only the torch-free parts are imported here, so the SGLang client runs without torch installed.
"""

from agent.models.base import (
    GREEDY,
    Checkpoint,
    DecodeResult,
    ModelBackend,
    Sampling,
    TokenMeter,
)
from agent.models.errors import (
    BackendHTTPError,
    BackendTimeout,
    BackendUnavailable,
    CheckpointInvalid,
    ContextTooLong,
    GenerationAborted,
    ModelBackendError,
    ProtocolMismatch,
)

__all__ = [
    "GREEDY",
    "BackendHTTPError",
    "BackendTimeout",
    "BackendUnavailable",
    "Checkpoint",
    "CheckpointInvalid",
    "ContextTooLong",
    "DecodeResult",
    "GenerationAborted",
    "ModelBackend",
    "ModelBackendError",
    "ProtocolMismatch",
    "Sampling",
    "TokenMeter",
]
