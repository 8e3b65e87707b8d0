"""The SGLang backend against a local HTTP stand-in of an SGLang server (SGLang cannot run here)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agent.models.base import ModelBackend, TokenMeter
from agent.models.errors import (
    BackendHTTPError,
    BackendTimeout,
    BackendUnavailable,
    GenerationAborted,
    ModelBackendError,
    ProtocolMismatch,
)
from agent.models.sglang import SGLangBackend, SGLangConfig
from agent.models.tokenizer import ByteTokenizer
from tests.standins.sglang_standin import SGLangStandIn

TOK = ByteTokenizer()
PROMPT = TOK.encode("<|bos|><|system|>You are an agent.<|end|><|user|>Hi<|end|><|assistant|>", specials=True)
OBS = TOK.encode("<|tool|>3 unread mails<|end|><|assistant|>", specials=True)
ALT = TOK.encode("<|tool|>0 unread mails<|end|><|assistant|>", specials=True)


@pytest.fixture
def standin() -> Iterator[SGLangStandIn]:
    with SGLangStandIn() as server:
        yield server


Make = Callable[..., SGLangBackend]


@pytest.fixture
def make(standin: SGLangStandIn) -> Iterator[Make]:
    """Backends on the stand-in, closed (sessions and connections) at teardown."""
    made: list[SGLangBackend] = []

    def factory(**config: Any) -> SGLangBackend:
        settings: dict[str, Any] = {"base_url": standin.url, "timeout_s": 5.0, "rid_prefix": "t"}
        settings.update(config)
        backend = SGLangBackend(SGLangConfig(**settings), tokenizer=TOK)
        made.append(backend)
        return backend

    yield factory
    standin.switches.delay_s = 0.0
    for backend in made:
        backend.close()


def expected_turn(standin: SGLangStandIn, context: list[int], limit: int) -> list[int]:
    out: list[int] = []
    for _ in range(limit):
        out.append(standin.next_token(context + out, None))
        if out[-1] == standin.eos_token_id:
            break
    return out


def test_is_a_model_backend(make: Make) -> None:
    assert isinstance(make(), ModelBackend)


def test_generate_request_uses_sglang_fields_and_keeps_output_ids(standin: SGLangStandIn, make: Make) -> None:
    b = make()
    b.append(PROMPT)
    turn = b.decode(40, stop_token_ids=[TOK.special_id("<|end|>")])
    body = standin.generate_bodies[-1]
    assert body == {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "stop_token_ids": [262]},
        "rid": "t-0",
    }
    assert turn.token_ids == expected_turn(standin, PROMPT, 40)
    assert b.token_ids() == PROMPT + turn.token_ids
    assert turn.finish_reason == "stop" and turn.matched_stop == standin.eos_token_id


def test_seed_and_salt_are_sent_when_set(standin: SGLangStandIn, make: Make) -> None:
    from agent.models.base import Sampling

    b = make(cache_salt="tenant-a")
    b.append(PROMPT)
    b.decode(4, sampling=Sampling(temperature=0.8, seed=11))
    body = standin.generate_bodies[-1]
    assert body["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.8, "sampling_seed": 11}
    assert body["cache_salt"] == "tenant-a"


def test_meter_reads_what_the_radix_cache_served(make: Make) -> None:
    b = make()
    b.append(PROMPT)
    first = b.decode(8)
    assert first.usage == TokenMeter(prefilled=len(PROMPT), decoded=len(first.token_ids), reused=0)
    before = len(b)
    b.append(OBS)
    second = b.decode(8)
    # The radix cache holds the last request's input and all but its last output token.
    assert second.usage.reused == before - 1
    assert second.usage.prefilled == len(OBS) + 1
    assert b.meter == first.usage + second.usage


def test_restoring_a_checkpoint_resubmits_the_prefix_and_it_is_served_cached(
    standin: SGLangStandIn, make: Make
) -> None:
    b = make()
    b.append(PROMPT)
    b.decode(8)
    cp = b.checkpoint()
    b.append(OBS)
    b.decode(8)
    b.restore(cp)
    assert len(b) == cp.offset
    prefix = b.token_ids()
    b.append(ALT)
    replay = b.decode(8)
    body = standin.generate_bodies[-1]
    assert body["input_ids"] == prefix + ALT
    # Both observations open with `<|tool|>`: the radix cache serves that shared token too.
    assert ALT[0] == OBS[0] and ALT[1] != OBS[1]
    assert replay.usage.reused == cp.offset + 1
    assert replay.usage.prefilled == len(ALT) - 1
    assert replay.token_ids == expected_turn(standin, prefix + ALT, 8)


def test_session_branches_at_an_offset(standin: SGLangStandIn, make: Make) -> None:
    b = make(use_sessions=True)
    b.append(PROMPT)
    cp = b.checkpoint()
    b.decode(8)
    b.append(OBS)
    b.decode(8)
    assert standin.generate_bodies[-1]["input_ids"] == OBS
    assert standin.generate_bodies[-1]["session_params"] == {"id": "t-session-0", "rid": "t-0"}

    b.restore(cp)
    b.append(ALT)
    replay = b.decode(8)
    body = standin.generate_bodies[-1]
    assert body["input_ids"] == ALT
    assert body["session_params"] == {
        "id": "t-session-0",
        "rid": "t-0",
        "offset": len(PROMPT),
        "replace": True,
    }
    assert replay.usage.reused == len(PROMPT)
    assert replay.token_ids == expected_turn(standin, PROMPT + ALT, 8)
    # `replace` made the server drop the abandoned branch's request.
    assert set(standin.sessions["t-session-0"]) == {"t-0", "t-2"}
    b.close()
    assert standin.sessions == {}


def test_a_second_branch_never_splices_the_abandoned_branch_back_in(standin: SGLangStandIn, make: Make) -> None:
    runs = []
    for config in ({"use_sessions": True, "cache_salt": "s"}, {"use_sessions": False, "cache_salt": "p"}):
        b = make(**config)
        b.append(PROMPT)
        first = b.checkpoint()
        b.append(OBS)
        b.decode(6)
        b.restore(first)
        b.append(ALT)
        second = b.checkpoint()
        b.decode(6)
        # The offset lies inside the first request's context, which holds OBS there, not ALT.
        b.restore(second)
        b.append(OBS)
        b.decode(6)
        runs.append(b.token_ids())
    assert runs[0] == runs[1]
    assert standin.generate_bodies[2]["session_params"]["rid"] == "t-1"


def test_session_turn_after_turn_resends_only_the_last_token(standin: SGLangStandIn, make: Make) -> None:
    b = make(use_sessions=True)
    b.append(PROMPT)
    b.decode(3)
    n = len(b)
    b.decode(3)
    body = standin.generate_bodies[-1]
    assert body["input_ids"] == b.token_ids()[n - 1 : n]
    assert body["session_params"] == {"id": "t-session-0", "rid": "t-0", "offset": n - 1}


def test_session_and_plain_requests_give_the_same_session(make: Make) -> None:
    runs = []
    for config in ({"use_sessions": True, "cache_salt": "s"}, {"use_sessions": False, "cache_salt": "p"}):
        b = make(**config)
        b.append(PROMPT)
        start = b.checkpoint()
        b.decode(6)
        b.append(OBS)
        b.decode(6)
        b.restore(start)
        b.decode(6)
        runs.append(b.token_ids())
    assert runs[0] == runs[1]


def test_rotating_the_cache_salt_never_serves_the_old_entries(standin: SGLangStandIn, make: Make) -> None:
    b = make(cache_salt="epoch-0")
    b.append(PROMPT)
    cp = b.checkpoint()
    b.decode(8)
    b.restore(cp)
    assert b.decode(8).usage.reused == len(PROMPT) - 1
    b.set_cache_salt("epoch-1")
    b.restore(cp)
    rotated = b.decode(8)
    assert standin.generate_bodies[-1]["cache_salt"] == "epoch-1"
    assert rotated.usage == TokenMeter(prefilled=len(PROMPT), decoded=len(rotated.token_ids), reused=0)
    other = make(cache_salt="epoch-0")
    other.append(PROMPT)
    assert other.decode(8).usage.reused == len(PROMPT) - 1


def test_flush_cache_empties_the_radix_cache(standin: SGLangStandIn, make: Make) -> None:
    b = make()
    b.append(PROMPT)
    cp = b.checkpoint()
    b.decode(8)
    b.flush_cache()
    b.restore(cp)
    assert b.decode(8).usage.reused == 0
    standin.switches.busy = True
    with pytest.raises(BackendHTTPError) as err:
        b.flush_cache()
    assert err.value.status == 400


def test_health_model_info_tokenize_detokenize(standin: SGLangStandIn) -> None:
    with SGLangBackend(SGLangConfig(base_url=standin.url)) as b:
        assert b.health()
        assert b.model_info().model_path == SGLangStandIn.model_path
        assert b.tokenize("<|user|>hi", specials=True) == [TOK.special_id("<|user|>"), 104, 105]
        assert b.detokenize([TOK.special_id("<|user|>"), 104, 105]) == "<|user|>hi"
        with pytest.raises(ModelBackendError, match="local tokenizer"):
            b.tokenize("untrusted <|end|>")
        standin.switches.unhealthy = True
        assert not b.health()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_down_is_backend_unavailable() -> None:
    config = SGLangConfig(base_url=f"http://127.0.0.1:{closed_port()}", connect_timeout_s=1.0)
    with SGLangBackend(config) as b:
        b.append(PROMPT)
        with pytest.raises(BackendUnavailable):
            b.decode(4)
        assert not b.health()
        assert b.token_ids() == PROMPT


def test_http_5xx_is_a_typed_error_and_the_session_is_unchanged(standin: SGLangStandIn, make: Make) -> None:
    b = make()
    b.append(PROMPT)
    standin.fail_next(503)
    with pytest.raises(BackendHTTPError) as err:
        b.decode(4)
    assert err.value.status == 503 and err.value.retryable
    assert "injected failure" in err.value.message
    assert b.token_ids() == PROMPT and b.meter == TokenMeter()
    assert b.decode(4).token_ids == expected_turn(standin, PROMPT, 4)


def test_abort_finish_reason_is_generation_aborted(standin: SGLangStandIn, make: Make) -> None:
    b = make()
    b.append(PROMPT)
    standin.abort_next("preempted by the stand-in")
    with pytest.raises(GenerationAborted, match="preempted"):
        b.decode(4)
    assert b.token_ids() == PROMPT


def test_unknown_session_parent_aborts(standin: SGLangStandIn, make: Make) -> None:
    b = make(use_sessions=True)
    b.append(PROMPT)
    b.decode(4)
    standin.sessions["t-session-0"].clear()
    b.append(OBS)
    with pytest.raises(GenerationAborted, match="Invalid request session id"):
        b.decode(4)


def test_a_slow_server_is_a_timeout(standin: SGLangStandIn, make: Make) -> None:
    b = make(timeout_s=0.2)
    b.append(PROMPT)
    standin.switches.delay_s = 2.0
    started = time.monotonic()
    with pytest.raises(BackendTimeout) as err:
        b.decode(4)
    assert time.monotonic() - started < 1.5
    assert err.value.seconds == 0.2
    assert b.token_ids() == PROMPT


def mocked(answer: dict[str, Any]) -> SGLangBackend:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    return SGLangBackend(SGLangConfig(base_url="http://sglang.invalid"), client=httpx.Client(transport=transport))


def test_an_answer_without_output_ids_is_a_protocol_mismatch() -> None:
    meta = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 2, "completion_tokens": 1}
    with mocked({"text": "hi", "meta_info": {**meta, "cached_tokens": 0}}) as b:
        b.append([1, 2])
        with pytest.raises(ProtocolMismatch, match="output_ids"):
            b.decode(1)


def test_counts_that_contradict_the_session_are_a_protocol_mismatch() -> None:
    meta = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 1, "completion_tokens": 1}
    with mocked({"output_ids": [7], "meta_info": {**meta, "cached_tokens": 0}}) as b:
        b.append([1, 2])
        with pytest.raises(ProtocolMismatch, match="2"):
            b.decode(1)
        assert b.token_ids() == [1, 2]
