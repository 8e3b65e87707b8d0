"""The in-process engine: a `transformers` causal LM with a live KV cache (`DynamicCache`).

Restoring a checkpoint crops the live cache to the checkpoint's offset; the prefix is never
recomputed. The session keeps one invariant: the cache holds a prefix of the session's token ids
(normally all of them), and every call first feeds whatever is missing. Cropping loses the
next-token distribution at the cut, so a decode straight after a restore recomputes the last token
(1 token, metered as prefilled), as SGLang does for every request. A forward pass that fails drops
the cache (its layers may be half-extended); the next call rebuilds it from the token ids.

By default the engine runs a tiny Llama built from a config with a fixed seed and the byte
tokenizer: nothing is downloaded. Any local model directory works through `from_pretrained`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from agent.models.base import (
    GREEDY,
    Checkpoint,
    DecodeResult,
    FinishReason,
    Sampling,
    TokenMeter,
    check_restorable,
    check_token_ids,
    checkpoint_at_end,
)
from agent.models.errors import ContextTooLong, ModelBackendError
from agent.models.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer


def build_tiny_model(vocab_size: int, *, seed: int, max_positions: int = 2048) -> LlamaForCausalLM:
    """A 2-layer, 64-wide Llama with weights drawn from `seed`; the same seed gives the same model."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    # fork_rng: seeding the global generator would change every later random draw in the process.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def default_device() -> str:
    """`cuda` where a GPU is present, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class LocalBackend:
    """A model session over a live KV cache; see the module docstring for the restore contract."""

    KIND = "local"

    def __init__(
        self,
        model: Any,
        tokenizer: TextTokenizer,
        *,
        device: str | None = None,
        max_context: int | None = None,
    ) -> None:
        self._device = torch.device(device or default_device())
        self._model = model.to(self._device).eval()
        # transformers 5.x renamed `past_key_values` to `cache` (argument and output) and warns on
        # the old name; 4.x only knows the old one.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._tok = tokenizer
        self._vocab = int(model.config.vocab_size)
        limit = max_context or getattr(model.config, "max_position_embeddings", None)
        self._limit: int | None = None if limit is None else int(limit)
        self._ids: list[int] = []
        self._cache: Any = None
        self._next_logits: torch.Tensor | None = None
        self._meter = TokenMeter()

    @classmethod
    def tiny(cls, *, seed: int = 0, device: str | None = None, max_positions: int = 2048) -> LocalBackend:
        """The default engine: the seeded tiny Llama and the byte tokenizer."""
        tokenizer = ByteTokenizer()
        model = build_tiny_model(tokenizer.vocab_size, seed=seed, max_positions=max_positions)
        return cls(model, tokenizer, device=device)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: str | None = None, dtype: torch.dtype = torch.float32
    ) -> LocalBackend:
        """Load a local model directory (`local_files_only`); its own tokenizer if it has one."""
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        model = model.to(dtype=dtype)
        tokenizer: TextTokenizer = (
            HFTokenizer.from_pretrained(path) if HFTokenizer.present_in(path) else ByteTokenizer()
        )
        if tokenizer.vocab_size > int(model.config.vocab_size):
            raise ModelBackendError(
                f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}"
            )
        return cls(model, tokenizer, device=device)

    @property
    def meter(self) -> TokenMeter:
        """Everything metered since creation."""
        return self._meter

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id."""
        return self._tok.eos_token_id

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer this engine reads and writes text with."""
        return self._tok

    def tokenize(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids of `text` through the engine's tokenizer."""
        return self._tok.encode(text, specials=specials)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids through the engine's tokenizer."""
        return self._tok.decode(ids)

    def token_ids(self) -> list[int]:
        """A copy of the session's token ids."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def append(self, ids: Sequence[int]) -> None:
        """Prefill a block into the live cache."""
        self.append_with_logits(ids)

    def append_with_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Prefill a block and return its logits, shape `(len(ids), vocab)`, on the CPU."""
        block = self._checked(ids, extra=0)
        if not block:
            return torch.empty(0, self._vocab)
        refed = self._sync(need_logits=False)
        logits = self._forward(block)
        self._ids.extend(block)
        self._meter += TokenMeter(prefilled=refed + len(block), reused=len(self._ids) - len(block) - refed)
        return logits.float().cpu()

    def decode(
        self, max_new_tokens: int, *, stop_token_ids: Sequence[int] = (), sampling: Sampling = GREEDY
    ) -> DecodeResult:
        """Generate a turn token by token over the live cache; the turn joins the session."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._checked((), extra=max_new_tokens)
        stops = set(stop_token_ids)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        start = len(self._ids)
        try:
            refed = self._sync(need_logits=True)
            out, finish, matched = self._generate(max_new_tokens, stops, sampling)
        except BaseException:
            # A half-generated turn must not stay in the session: the scaffold retries from here.
            del self._ids[start:]
            self._crop(min(start, self._cache_len()))
            self._next_logits = None
            raise
        usage = TokenMeter(prefilled=refed, decoded=len(out), reused=start - refed)
        self._meter += usage
        return DecodeResult(token_ids=out, finish_reason=finish, usage=usage, matched_stop=matched)

    def force_turn(
        self, ids: Sequence[int], *, finish_reason: FinishReason = "stop", matched_stop: int | None = None
    ) -> DecodeResult:
        """Teacher-force a chosen model turn through the cache, metered as decoded tokens."""
        turn = self._checked(ids, extra=0)
        usage = TokenMeter()
        if turn:
            refed = self._sync(need_logits=False)
            usage = TokenMeter(prefilled=refed, decoded=len(turn), reused=len(self._ids) - refed)
            self._forward(turn)
            self._ids.extend(turn)
        self._meter += usage
        return DecodeResult(token_ids=turn, finish_reason=finish_reason, usage=usage, matched_stop=matched_stop)

    def checkpoint(self) -> Checkpoint:
        """A splice point at the current end of the session."""
        return checkpoint_at_end(self.KIND, self._ids)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Crop the live cache and the token ids back to the checkpoint's offset."""
        check_restorable(self.KIND, self._ids, checkpoint)
        if checkpoint.offset == len(self._ids):
            return
        self._crop(checkpoint.offset)
        del self._ids[checkpoint.offset :]
        self._next_logits = None

    def reset(self) -> None:
        """Drop the whole session and its cache."""
        self._ids = []
        self._cache = None
        self._next_logits = None

    def close(self) -> None:
        """Release the live cache."""
        self.reset()

    def _checked(self, ids: Sequence[int], *, extra: int) -> list[int]:
        block = check_token_ids(ids, self._vocab)
        total = len(self._ids) + len(block) + extra
        if self._limit is not None and total > self._limit:
            raise ContextTooLong(total, self._limit)
        return block

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` over the cache; returns their logits and keeps the last row for decoding."""
        inputs = torch.tensor([ids], dtype=torch.long, device=self._device)
        # no_grad rather than inference_mode: the cache's tensors are cropped outside this block,
        # and inference tensors refuse some of the ops cropping does.
        before = self._cache_len()
        try:
            with torch.no_grad():
                out = self._model(input_ids=inputs, use_cache=True, **{self._cache_kw: self._cache})
        except BaseException:
            self._cache = None
            self._next_logits = None
            raise
        self._cache = out[self._cache_kw]
        logits: torch.Tensor = out.logits[0]
        self._next_logits = logits[-1]
        if self._cache_len() != before + len(ids):
            raise RuntimeError("the model did not extend the live KV cache by the tokens fed")
        return logits

    def _sync(self, *, need_logits: bool) -> int:
        """Feed the tokens the cache lacks (and the last one, if its logits are needed); returns how many."""
        if need_logits and not self._ids:
            raise ModelBackendError("cannot decode from an empty session: append a prompt first")
        if need_logits and self._next_logits is None and self._cache_len() == len(self._ids):
            self._crop(len(self._ids) - 1)
        missing = self._ids[self._cache_len() :]
        if missing:
            self._forward(missing)
        return len(missing)

    def _generate(
        self, max_new_tokens: int, stops: set[int], sampling: Sampling
    ) -> tuple[list[int], FinishReason, int | None]:
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self._device).manual_seed(int(sampling.seed or 0))
        out: list[int] = []
        for _ in range(max_new_tokens):
            assert self._next_logits is not None
            token = _pick(self._next_logits, sampling, generator)
            self._forward([token])
            self._ids.append(token)
            out.append(token)
            if token in stops:
                return out, "stop", token
        return out, "length", None

    def _cache_len(self) -> int:
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    def _crop(self, keep: int) -> None:
        drop = self._cache_len() - keep
        if drop <= 0:
            return
        if keep == 0:
            self._cache = None
        else:
            # A negative argument removes that many tokens in transformers 4.x and 5.x alike; a
            # positive one means "keep n" in 4.x but is refused by 5.x, so never pass one.
            self._cache.crop(-drop)
        if self._cache_len() != keep:
            raise RuntimeError(f"cropping the KV cache to {keep} left {self._cache_len()} tokens")


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Arg-max, or a seeded draw from the tempered distribution."""
    if sampling.greedy or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
