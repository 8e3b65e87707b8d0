"""The one error root of the model backends, with structured fields the scaffold can branch on.

A failed call leaves the backend's session unchanged (token ids, cache, meter), so the scaffold may
retry it or restore a checkpoint; nothing is half-applied.
"""

from __future__ import annotations


class ModelBackendError(Exception):
    """Root of every error a model backend raises."""


class BackendUnavailable(ModelBackendError):
    """The model server could not be reached (connection refused, DNS failure, reset)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"model server unreachable at {url}: {reason}")
        self.url = url
        self.reason = reason


class BackendTimeout(ModelBackendError):
    """The model server did not answer within the configured time."""

    def __init__(self, url: str, seconds: float) -> None:
        super().__init__(f"model server at {url} did not answer within {seconds:g} s")
        self.url = url
        self.seconds = seconds


class BackendHTTPError(ModelBackendError):
    """The model server answered with a non-success HTTP status."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"model server at {url} answered HTTP {status}: {message}")
        self.url = url
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        """True for server-side failures (5xx), which may pass; 4xx means the request is wrong."""
        return self.status >= 500


class GenerationAborted(ModelBackendError):
    """The server aborted the request (`meta_info.finish_reason.type == "abort"`)."""

    def __init__(self, message: str, status_code: int | None = None, err_type: str | None = None) -> None:
        super().__init__(f"generation aborted: {message}")
        self.message = message
        self.status_code = status_code
        self.err_type = err_type


class ProtocolMismatch(ModelBackendError):
    """The server's answer lacks a field this client relies on, or contradicts the session."""


class CheckpointInvalid(ModelBackendError):
    """A checkpoint cannot be restored: past the end of the session, or on another branch."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"cannot restore checkpoint at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class ContextTooLong(ModelBackendError):
    """The session would exceed the model's context window."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"context of {length} tokens exceeds the model's limit of {limit}")
        self.length = length
        self.limit = limit
