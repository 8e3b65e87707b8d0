"""The backend interface's value types, checkpoint handles and the byte tokenizer."""

from __future__ import annotations

import msgspec
import pytest

from agent.models.base import (
    Checkpoint,
    Sampling,
    TokenMeter,
    check_restorable,
    checkpoint_at_end,
    prefix_handle,
)
from agent.models.errors import CheckpointInvalid
from agent.models.tokenizer import BYTE_SPECIALS, ByteTokenizer


def test_meter_arithmetic_and_recomputed() -> None:
    a = TokenMeter(prefilled=10, decoded=5, reused=100)
    b = TokenMeter(prefilled=3, decoded=2, reused=40)
    assert a + b == TokenMeter(13, 7, 140)
    assert (a + b).since(a) == b
    assert a.recomputed == 15
    with pytest.raises(AttributeError):
        a.prefilled = 0  # type: ignore[misc]


def test_meter_and_checkpoint_round_trip_as_msgpack() -> None:
    cp = Checkpoint(offset=7, cache_handle="local:7:abc")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cp), type=Checkpoint) == cp
    meter = TokenMeter(1, 2, 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meter), type=TokenMeter) == meter


def test_sampling_needs_a_seed_to_sample() -> None:
    assert Sampling().greedy
    assert not Sampling(temperature=0.7, seed=3).greedy
    with pytest.raises(ValueError, match="seed"):
        Sampling(temperature=0.7)
    with pytest.raises(ValueError):
        Sampling(temperature=-1.0, seed=1)


def test_checkpoint_restorable_only_on_its_own_branch() -> None:
    ids = [1, 2, 3, 4, 5]
    cp = checkpoint_at_end("local", ids[:3])
    check_restorable("local", ids, cp)
    with pytest.raises(CheckpointInvalid, match="another branch"):
        check_restorable("local", [1, 2, 9, 4, 5], cp)
    with pytest.raises(CheckpointInvalid, match="past the end"):
        check_restorable("local", ids[:2], cp)
    with pytest.raises(CheckpointInvalid, match="another branch"):
        check_restorable("sglang", ids, cp)


def test_prefix_handle_depends_on_the_prefix_only() -> None:
    assert prefix_handle("k", [1, 2, 3], 2) == prefix_handle("k", [1, 2, 7], 2)
    assert prefix_handle("k", [1, 2, 3], 3) != prefix_handle("k", [1, 2, 7], 3)


def test_byte_tokenizer_is_lossless_and_keeps_specials_out_of_plain_text() -> None:
    tok = ByteTokenizer()
    text = "héllo <|end|><|user|> wörld ✓"
    plain = tok.encode(text)
    assert all(i < 256 for i in plain)
    assert tok.decode(plain) == text
    parsed = tok.encode(text, specials=True)
    assert tok.special_id("<|end|>") in parsed and tok.special_id("<|user|>") in parsed
    assert tok.decode(parsed) == text
    assert tok.vocab_size == 256 + len(BYTE_SPECIALS)
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"
