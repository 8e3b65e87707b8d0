"""A deterministic policy whose turns run through the real local engine (teacher forcing).

For reproducible scenarios the text of each model turn is chosen by a policy (a scenario script, or
a hijacked agent that obeys instructions found in observations), not sampled. The chosen tokens are
still fed through the engine's KV cache as a model turn, so the cache, checkpoints and token
accounting are those of a real run: a scripted turn meters as decoded tokens.

The policy must be a function of the context it is shown (token ids and their text), never of
hidden state such as a turn counter: after a restore the same context must yield the same turn, and
a context without the revoked input may yield a different one, which is what replay is for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from agent.models.base import GREEDY, Checkpoint, DecodeResult, Sampling, TokenMeter
from agent.models.local import LocalBackend


class PolicyContext(msgspec.Struct, frozen=True):
    """What a scripted policy sees: the session so far, as ids and as text."""

    token_ids: list[int]
    text: str


Policy = Callable[[PolicyContext], str]


class ScriptedBackend:
    """A `ModelBackend` whose turns a policy writes and the local engine teacher-forces."""

    def __init__(self, engine: LocalBackend, policy: Policy) -> None:
        self._engine = engine
        self._policy = policy

    @property
    def engine(self) -> LocalBackend:
        """The engine every token runs through."""
        return self._engine

    @property
    def meter(self) -> TokenMeter:
        """The engine's meter."""
        return self._engine.meter

    @property
    def eos_token_id(self) -> int | None:
        """The engine's EOS id."""
        return self._engine.eos_token_id

    def tokenize(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids through the engine's tokenizer."""
        return self._engine.tokenize(text, specials=specials)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text through the engine's tokenizer."""
        return self._engine.detokenize(ids)

    def token_ids(self) -> list[int]:
        """A copy of the session's token ids."""
        return self._engine.token_ids()

    def __len__(self) -> int:
        return len(self._engine)

    def append(self, ids: Sequence[int]) -> None:
        """Prefill a block through the engine."""
        self._engine.append(ids)

    def decode(
        self, max_new_tokens: int, *, stop_token_ids: Sequence[int] = (), sampling: Sampling = GREEDY
    ) -> DecodeResult:
        """Teacher-force the policy's text, closed by the first stop token (else EOS); `sampling` is unused."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self._engine.token_ids()
        text = self._policy(PolicyContext(token_ids=ids, text=self._engine.detokenize(ids)))
        # specials=True: the script is trusted and may spell turn markers, as a model would emit them.
        turn = self._engine.tokenize(text, specials=True)
        stop = stop_token_ids[0] if stop_token_ids else self.eos_token_id
        if stop is not None and (not turn or turn[-1] != stop):
            turn.append(stop)
        if len(turn) > max_new_tokens:
            return self._engine.force_turn(turn[:max_new_tokens], finish_reason="length")
        matched = turn[-1] if stop is not None else None
        return self._engine.force_turn(
            turn, finish_reason="stop" if matched is not None else "length", matched_stop=matched
        )

    def checkpoint(self) -> Checkpoint:
        """The engine's checkpoint."""
        return self._engine.checkpoint()

    def restore(self, checkpoint: Checkpoint) -> None:
        """Crop the engine's cache back to the checkpoint."""
        self._engine.restore(checkpoint)

    def reset(self) -> None:
        """Forget the engine's session."""
        self._engine.reset()

    def close(self) -> None:
        """Close the engine's session."""
        self._engine.close()
