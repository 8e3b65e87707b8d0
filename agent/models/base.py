"""The one interface every model backend implements, and the value types it trades in.

A backend holds one session: the token ids the model has seen so far, in order, and whatever cache
it keeps over them. The scaffold appends blocks (prompt, observations: prefill), decodes model turns,
and takes checkpoints. A checkpoint is metadata only (a token offset and a cache handle, never a
tensor): restoring it is cropping the session back to that offset, and the cache serves the prefix
(paper, Lemma 1: cropping is restoring).

Metering (`TokenMeter`) separates what the model computed from what a cache served:

- `prefilled`: prompt tokens the model computed (blocks it was given, not tokens it generated);
- `decoded`: tokens of model turns (generated, or teacher-forced by the scripted backend);
- `reused`: context tokens a call was served from cache instead of recomputing, counted per call the
  way SGLang counts `meta_info.cached_tokens` per request. A long session therefore counts its prefix
  once per call; compare backends and baselines on `recomputed` (prefilled + decoded), and read
  `reused` as what the cache saved.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from agent.models.errors import CheckpointInvalid


class TokenMeter(msgspec.Struct, frozen=True):
    """Token counts of a session or of one call; immutable so a snapshot never drifts."""

    prefilled: int = 0
    decoded: int = 0
    reused: int = 0

    @property
    def recomputed(self) -> int:
        """Tokens the model actually computed: the cost a restore is meant to cut."""
        return self.prefilled + self.decoded

    def __add__(self, other: TokenMeter) -> TokenMeter:
        return TokenMeter(self.prefilled + other.prefilled, self.decoded + other.decoded, self.reused + other.reused)

    def __sub__(self, other: TokenMeter) -> TokenMeter:
        return TokenMeter(self.prefilled - other.prefilled, self.decoded - other.decoded, self.reused - other.reused)

    def since(self, earlier: TokenMeter) -> TokenMeter:
        """What was metered between an earlier snapshot and this one."""
        return self - earlier


class Checkpoint(msgspec.Struct, frozen=True):
    """A splice point: a token offset and a handle naming the cached prefix. No tensors."""

    offset: int
    cache_handle: str


class Sampling(msgspec.Struct, frozen=True):
    """How a turn picks tokens. Greedy by default; sampling needs an explicit seed for replay."""

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 0.0 and self.seed is None:
            # An unseeded sample cannot be replayed, and replay is what revocation is built on.
            raise ValueError("sampling with temperature > 0 needs a seed")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the arg-max token."""
        return self.temperature == 0.0


GREEDY = Sampling()

FinishReason = Literal["stop", "length"]


class DecodeResult(msgspec.Struct, frozen=True):
    """One model turn: its token ids (already appended to the session) and what it cost."""

    token_ids: list[int]
    finish_reason: FinishReason
    usage: TokenMeter
    matched_stop: int | None = None


@runtime_checkable
class ModelBackend(Protocol):
    """A model session the scaffold drives: append blocks, decode turns, checkpoint, restore."""

    @property
    def meter(self) -> TokenMeter:
        """Everything metered since the backend was created (reset does not clear it)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a model turn by default, if the model has one."""
        ...

    def tokenize(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids of a text, nothing added around it; special spellings parsed only if asked."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens spelled out."""
        ...

    def token_ids(self) -> list[int]:
        """A copy of the session's token ids so far."""
        ...

    def __len__(self) -> int:
        """Number of tokens in the session."""
        ...

    def append(self, ids: Sequence[int]) -> None:
        """Add a block the model reads (prefill); it becomes part of the session."""
        ...

    def decode(
        self, max_new_tokens: int, *, stop_token_ids: Sequence[int] = (), sampling: Sampling = GREEDY
    ) -> DecodeResult:
        """Generate a model turn, stopping at EOS, a stop token (kept in the turn) or the limit."""
        ...

    def checkpoint(self) -> Checkpoint:
        """A splice point at the current end of the session."""
        ...

    def restore(self, checkpoint: Checkpoint) -> None:
        """Crop the session back to a checkpoint taken on this session's current branch."""
        ...

    def reset(self) -> None:
        """Forget the whole session (the full-reset baseline); the meter keeps counting."""
        ...

    def close(self) -> None:
        """Release what the backend holds (server sessions, connections, the live cache)."""
        ...


def prefix_handle(kind: str, ids: Sequence[int], offset: int) -> str:
    """The cache handle of `ids[:offset]`: backend kind, offset and a digest of the prefix."""
    packed = array("I", ids[:offset])
    if sys.byteorder == "big":
        # Handles are stored by the daemon and must compare equal across machines.
        packed.byteswap()
    digest = hashlib.blake2b(packed.tobytes(), digest_size=16).hexdigest()
    return f"{kind}:{offset}:{digest}"


def checkpoint_at_end(kind: str, ids: Sequence[int]) -> Checkpoint:
    """A checkpoint at the end of `ids`."""
    return Checkpoint(offset=len(ids), cache_handle=prefix_handle(kind, ids, len(ids)))


def check_restorable(kind: str, ids: Sequence[int], checkpoint: Checkpoint) -> None:
    """Raise `CheckpointInvalid` unless the session still holds the checkpoint's prefix."""
    offset = checkpoint.offset
    if offset < 0 or offset > len(ids):
        raise CheckpointInvalid(offset, f"past the end of the session ({len(ids)} tokens)")
    # Restoring forward onto a cropped-away suffix, or onto another branch, would splice in state
    # the session no longer holds; the digest catches both without keeping any tensor.
    if checkpoint.cache_handle != prefix_handle(kind, ids, offset):
        raise CheckpointInvalid(offset, "the session no longer holds this prefix (another branch)")


def check_token_ids(ids: Sequence[int], vocab_size: int | None) -> list[int]:
    """Validate a block of token ids and return it as a list."""
    out = [int(i) for i in ids]
    bad = [i for i in out if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise ValueError(f"token ids out of range (vocab {vocab_size}): {bad[:5]}")
    return out
