"""Tokenizers for the in-process engine: a small byte-level one, and an adapter for a model's own.

No tokenizer can be downloaded here, so the default tiny model reads bytes: ids 0-255 are the bytes
of UTF-8 text, then a few special tokens for prompt structure. A model directory that ships its own
tokenizer files is read through `HFTokenizer` instead.

Special-token spellings in untrusted text (a tool result saying `<|end|><|user|>...`) must not become
special tokens, or an observation could forge a turn boundary. So `encode` treats them as plain text
unless the caller, assembling its own template, asks for `specials=True`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class TextTokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, if any."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """End-of-turn id decoding stops at, if any."""
        ...

    def encode(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids of `text`; special-token spellings are parsed only when `specials`."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens spelled out."""
        ...


BYTE_SPECIALS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
)


class ByteTokenizer:
    """256 byte tokens followed by `BYTE_SPECIALS`; lossless on any UTF-8 text."""

    def __init__(self) -> None:
        self._special_ids = {s: 256 + i for i, s in enumerate(BYTE_SPECIALS)}
        self._special_text = {i: s for s, i in self._special_ids.items()}
        self._special_re = re.compile("|".join(re.escape(s) for s in BYTE_SPECIALS))

    @property
    def vocab_size(self) -> int:
        """256 bytes plus the special tokens."""
        return 256 + len(BYTE_SPECIALS)

    @property
    def bos_token_id(self) -> int:
        """Id of `<|bos|>`."""
        return self._special_ids["<|bos|>"]

    @property
    def eos_token_id(self) -> int:
        """Id of `<|eos|>`."""
        return self._special_ids["<|eos|>"]

    def special_id(self, spelling: str) -> int:
        """Id of a special token by its spelling, e.g. `special_id("<|end|>")`."""
        return self._special_ids[spelling]

    def encode(self, text: str, *, specials: bool = False) -> list[int]:
        """Bytes of `text`; with `specials`, spellings in `BYTE_SPECIALS` become their ids."""
        if not specials:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(self._special_ids[match.group()])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids; a byte run cut mid-character decodes with replacement characters."""
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(self._special_text.get(i, f"<|unk:{i}|>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A `transformers` tokenizer read from a local model directory, never downloaded."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Load the tokenizer files of a local model directory."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    @staticmethod
    def present_in(path: str | Path) -> bool:
        """True if the directory carries tokenizer files of its own."""
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        return any((Path(path) / name).exists() for name in names)

    @property
    def vocab_size(self) -> int:
        """Size including added tokens (`len(tokenizer)`, not the base vocab)."""
        return len(self._tok)

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's BOS id, if it has one."""
        value = self._tok.bos_token_id
        return None if value is None else int(value)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, if it has one."""
        value = self._tok.eos_token_id
        return None if value is None else int(value)

    def encode(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids with no BOS/EOS added; specials parsed only when asked."""
        ids = self._tok.encode(text, add_special_tokens=False, split_special_tokens=not specials)
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text with special tokens kept."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))
