"""The in-process engine: cropping the live KV cache is restoring, and it is metered as reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.models.base import ModelBackend, Sampling, TokenMeter
from agent.models.errors import CheckpointInvalid, ContextTooLong, ModelBackendError
from agent.models.local import LocalBackend, build_tiny_model
from agent.models.tokenizer import ByteTokenizer, HFTokenizer

ATOL = 1e-4


def engine(seed: int = 0) -> LocalBackend:
    return LocalBackend.tiny(seed=seed, device="cpu")


def blocks(e: LocalBackend) -> tuple[list[int], list[int], list[int]]:
    system = e.tokenize("<|bos|><|system|>You are a careful agent.<|end|>", specials=True)
    user = e.tokenize("<|user|>Summarise my inbox.<|end|><|assistant|>", specials=True)
    tool = e.tokenize("<|tool|>3 unread: rent, dentist, newsletter<|end|><|assistant|>", specials=True)
    return system, user, tool


def test_is_a_model_backend() -> None:
    assert isinstance(engine(), ModelBackend)


def test_restore_then_refeed_gives_fresh_run_logits_and_reuses_the_prefix() -> None:
    e = engine()
    system, user, tool = blocks(e)
    e.append(system)
    cp = e.checkpoint()
    first = e.append_with_logits(user)
    e.decode(12)
    e.append(tool)

    e.restore(cp)
    assert e.token_ids() == system
    before = e.meter
    again = e.append_with_logits(user)
    delta = e.meter.since(before)

    fresh = engine()
    fresh_all = fresh.append_with_logits(system + user)[len(system) :]
    torch.testing.assert_close(again, fresh_all, atol=ATOL, rtol=0)
    torch.testing.assert_close(again, first, atol=ATOL, rtol=0)
    assert delta == TokenMeter(prefilled=len(user), decoded=0, reused=len(system))


def test_decode_after_restore_equals_decode_in_a_fresh_run() -> None:
    e = engine()
    system, user, tool = blocks(e)
    e.append(system + user)
    cp = e.checkpoint()
    original = e.decode(16)
    e.append(tool)
    e.decode(8)

    e.restore(cp)
    before = e.meter
    replayed = e.decode(16)
    fresh = engine()
    fresh.append(system + user)
    assert replayed.token_ids == original.token_ids == fresh.decode(16).token_ids
    # Cropping loses the logits at the cut: only the last prompt token is recomputed.
    assert e.meter.since(before) == TokenMeter(prefilled=1, decoded=16, reused=cp.offset - 1)
    assert replayed.usage == e.meter.since(before)


def test_crop_past_the_end_or_onto_another_branch_is_an_error() -> None:
    e = engine()
    system, user, tool = blocks(e)
    e.append(system)
    early = e.checkpoint()
    e.append(user)
    late = e.checkpoint()
    e.restore(early)
    with pytest.raises(CheckpointInvalid, match="past the end"):
        e.restore(late)
    e.append(tool[: len(user)])
    with pytest.raises(CheckpointInvalid, match="another branch"):
        e.restore(late)
    e.restore(early)
    assert len(e) == len(system)


def test_restore_to_zero_and_reset_forget_everything() -> None:
    e = engine()
    system, user, _ = blocks(e)
    start = e.checkpoint()
    e.append(system)
    e.restore(start)
    assert e.token_ids() == []
    with pytest.raises(ModelBackendError, match="empty session"):
        e.decode(4)
    e.append(system + user)
    e.reset()
    assert len(e) == 0
    before = e.meter
    e.append(system)
    assert e.meter.since(before) == TokenMeter(prefilled=len(system))


def test_stop_token_ends_the_turn_and_stays_in_it() -> None:
    e = engine()
    system, user, _ = blocks(e)
    e.append(system + user)
    cp = e.checkpoint()
    free = e.decode(10)
    stop = free.token_ids[3]
    e.restore(cp)
    turn = e.decode(10, stop_token_ids=[stop])
    cut = free.token_ids.index(stop) + 1
    assert turn.token_ids == free.token_ids[:cut]
    assert (turn.finish_reason, turn.matched_stop) == ("stop", stop)
    assert free.finish_reason == "length"
    assert e.token_ids() == system + user + turn.token_ids


def test_seeded_sampling_replays_exactly() -> None:
    e = engine()
    system, user, _ = blocks(e)
    e.append(system + user)
    cp = e.checkpoint()
    a = e.decode(12, sampling=Sampling(temperature=1.5, seed=7)).token_ids
    e.restore(cp)
    b = e.decode(12, sampling=Sampling(temperature=1.5, seed=7)).token_ids
    e.restore(cp)
    c = e.decode(12, sampling=Sampling(temperature=1.5, seed=8)).token_ids
    assert a == b
    assert a != c


def test_same_seed_same_model() -> None:
    system = ByteTokenizer().encode("same weights?")
    x = engine(seed=3).append_with_logits(system)
    y = engine(seed=3).append_with_logits(system)
    z = engine(seed=4).append_with_logits(system)
    assert torch.equal(x, y)
    assert not torch.allclose(x, z)


def test_context_limit_is_enforced() -> None:
    tok = ByteTokenizer()
    e = LocalBackend(build_tiny_model(tok.vocab_size, seed=0), tok, device="cpu", max_context=16)
    with pytest.raises(ContextTooLong):
        e.append(list(range(17)))
    e.append(list(range(10)))
    with pytest.raises(ContextTooLong):
        e.decode(7)
    assert len(e) == 10
    with pytest.raises(ValueError, match="out of range"):
        e.append([tok.vocab_size])


def test_a_failed_forward_leaves_the_session_as_it_was() -> None:
    e = engine()
    system, user, _ = blocks(e)
    e.append(system + user)
    reference = engine()
    reference.append(system + user)
    expected = reference.decode(8).token_ids

    real_forward = e._model.forward
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    e._model.forward = flaky
    with pytest.raises(RuntimeError, match="injected"):
        e.decode(8)
    assert e.token_ids() == system + user
    before = e.meter
    assert e.decode(8).token_ids == expected
    # The failure dropped the half-extended cache; the next call rebuilt it from the token ids.
    assert e.meter.since(before).prefilled == len(system + user)


def test_loads_a_local_model_directory_without_network(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    build_tiny_model(tok.vocab_size, seed=5).save_pretrained(tmp_path)
    loaded = LocalBackend.from_pretrained(tmp_path, device="cpu")
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    ids = tok.encode("a saved model")
    torch.testing.assert_close(loaded.append_with_logits(ids), engine(seed=5).append_with_logits(ids))


def test_a_model_directory_with_tokenizer_files_uses_its_own_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2, "hello": 3, "world": 4, "<|end|>": 5}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token="<bos>",
        additional_special_tokens=["<|end|>"],
    ).save_pretrained(tmp_path)
    build_tiny_model(8, seed=1).save_pretrained(tmp_path)

    loaded = LocalBackend.from_pretrained(tmp_path, device="cpu")
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.eos_token_id == 1
    assert loaded.tokenize("hello world <|end|>", specials=True) == [3, 4, 5]
    # Untrusted text cannot spell the special token into existence.
    assert 5 not in loaded.tokenize("hello world <|end|>")
    loaded.append(loaded.tokenize("<bos> hello world", specials=True))
    assert len(loaded.decode(4).token_ids) <= 4
