"""The MCP layer's own rules, without a daemon: which call a retry repeats, annotations, the recorded positions."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd import protocol as p
from sandboxd.firewall.adapters import HTTP_GET, HTTP_REQUEST, SEND_EMAIL, WEBHOOK
from sandboxd.mcp.provenance import CallRecorder
from sandboxd.mcp.retries import KeyConflict, RetryWindow, call_signature, idempotency_key
from sandboxd.mcp.tools import tool_annotations
from sandboxd.tools.builtin import BUILTIN_TOOLS

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=4)
effects = st.sampled_from(["read", "write", "external"])


def shuffled(args: dict[str, Any]) -> dict[str, Any]:
    """The same object, keys in reverse order: a respelling every client may produce."""
    return dict(reversed(list(args.items())))


@given(tool=st.sampled_from(["shell", "send_email"]), effect=effects, args=arguments)
def test_a_call_in_flight_is_what_any_identical_call_repeats(tool: str, effect: str, args: dict[str, Any]) -> None:
    window = RetryWindow(60.0)
    first, new = window.claim(tool, effect, args, None, now=0.0)
    again, again_new = window.claim(tool, effect, json.loads(json.dumps(shuffled(args))), None, now=500.0)
    assert new and not again_new and again is first


@given(effect=effects, args=arguments, other=arguments)
def test_other_arguments_or_tools_are_other_calls(effect: str, args: dict[str, Any], other: dict[str, Any]) -> None:
    window = RetryWindow(60.0)
    first, _ = window.claim("t", effect, args, None, now=0.0)
    if call_signature("t", effect, other) != call_signature("t", effect, args):
        assert window.claim("t", effect, other, None, now=0.0)[0] is not first
    assert window.claim("u", effect, args, None, now=0.0)[0] is not first


@settings(max_examples=50)
@given(args=arguments, gap=st.floats(0, 200), window_s=st.floats(0, 120))
def test_a_finished_call_is_repeated_only_within_the_window(args: dict[str, Any], gap: float, window_s: float) -> None:
    for effect in ("write", "external"):
        window = RetryWindow(window_s)
        first, _ = window.claim("t", effect, args, None, now=0.0)
        window.finish(first, now=1.0)
        now = 1.0 + gap
        entry, new = window.claim("t", effect, args, None, now=now)
        within = now - 1.0 <= window_s
        assert (entry is first) == within and new == (not within)


def test_finished_reads_are_read_again_and_a_write_ends_a_writes_window() -> None:
    window = RetryWindow(60.0)
    read, _ = window.claim("read_file", "read", {"path": "a"}, None, now=0.0)
    window.finish(read, now=0.1)
    assert window.claim("read_file", "read", {"path": "a"}, None, now=0.2)[1]
    write, _ = window.claim("shell", "write", {"command": "echo >> a"}, None, now=1.0)
    window.finish(write, now=1.1)  # the client gave up before the answer: its retry is this call
    assert window.claim("shell", "write", {"command": "echo >> a"}, None, now=2.0)[0] is write
    window.claim("write_file", "write", {"path": "b", "content": ""}, None, now=3.0)
    assert window.claim("shell", "write", {"command": "echo >> a"}, None, now=4.0)[1]
    # An answer the client got makes the same command again a deliberate second run.
    tests, _ = window.claim("shell", "write", {"command": "make test"}, None, now=5.0)
    window.finish(tests, now=6.0)
    tests.delivered = True
    assert window.claim("shell", "write", {"command": "make test"}, None, now=6.5)[1]
    # An external call's window is time alone: an answer handed over, a write in between, do not make a
    # second email.
    mail, _ = window.claim("send_email", "external", {"to": ["a@b.c"]}, None, now=7.0)
    window.finish(mail, now=7.1)
    mail.delivered = True
    window.claim("write_file", "write", {"path": "c", "content": ""}, None, now=8.0)
    assert window.claim("send_email", "external", {"to": ["a@b.c"]}, None, now=9.0)[0] is mail


def test_external_calls_match_on_the_firewalls_canonical_form_sandbox_calls_on_exact_json() -> None:
    assert call_signature("send_email", "external", {"body": "a  b", "n": 1.0}) == \
        call_signature("send_email", "external", {"n": 1, "body": "a b"})
    assert call_signature("write_file", "write", {"content": "a  b"}) != \
        call_signature("write_file", "write", {"content": "a b"})


@given(args=arguments, key=st.text(min_size=1, max_size=20))
def test_an_idempotency_key_decides_alone(args: dict[str, Any], key: str) -> None:
    window = RetryWindow(0.0)
    first, _ = window.claim("t", "external", args, key, now=0.0)
    window.finish(first, now=0.0)
    assert window.claim("t", "external", args, key, now=0.0)[0] is first
    assert window.claim("t", "external", args, key + "'", now=0.0)[0].agent_call_id != first.agent_call_id
    assert window.claim("t", "external", args, None, now=0.0)[0] is not first
    with pytest.raises(KeyConflict):
        window.claim("t", "external", {**args, "extra-key": 1}, key, now=0.0)
    # A key names one call for good: after its entry expired, the same key derives the same agent call id.
    assert window.claim("t", "external", args, key, now=1000.0)[0].agent_call_id == first.agent_call_id


def test_idempotency_keys_are_strings() -> None:
    assert idempotency_key(None) is None and idempotency_key({}) is None
    assert idempotency_key({"sandboxd/idempotencyKey": "k"}) == "k"
    for bad in (7, "", "x" * 257, ["k"]):
        with pytest.raises(ValueError):
            idempotency_key({"sandboxd/idempotencyKey": bad})


def test_annotations_follow_the_effect_class() -> None:
    tools = {m.name: tool_annotations(m) for m in [*BUILTIN_TOOLS, SEND_EMAIL, HTTP_REQUEST, HTTP_GET, WEBHOOK]}
    for name in ("read_file", "list_dir"):
        assert tools[name].read_only_hint is True and tools[name].open_world_hint is False
    assert tools["http_get"].read_only_hint is True and tools["http_get"].open_world_hint is True
    for name in ("shell", "python", "write_file"):
        assert tools[name].read_only_hint is False and tools[name].open_world_hint is False
    for name in ("send_email", "http_request", "webhook"):
        hints = tools[name]
        assert hints.open_world_hint is True and hints.idempotent_hint is False and hints.read_only_hint is False
    assert tools["send_email"].destructive_hint is False and tools["http_request"].destructive_hint is True
    unknown = p.ToolManifest(name="x", description="", parameters={"type": "object"}, effect="external")
    assert tool_annotations(unknown).destructive_hint is True


def test_a_call_depends_on_the_call_before_and_the_results_handed_over_since() -> None:
    recorder = CallRecorder()
    one = recorder.tool_call("shell", {}, "a1", "s", None)
    two = recorder.tool_call("shell", {}, "a2", "s", None)  # issued before one's result came back
    obs_one = recorder.observation(one.artifact_id, "r1", {})
    obs_two = recorder.observation(two.artifact_id, "r2", {})
    three = recorder.tool_call("shell", {}, "a3", "s", None)
    assert one.parents == [] and two.parents == [one.artifact_id]
    assert three.parents == [two.artifact_id, obs_one.artifact_id, obs_two.artifact_id]
    assert (obs_one.step, obs_two.step, three.step, three.turn) == (1, 2, 2, 3)
    checkpoint = recorder.checkpoint("turn", three.turn)
    assert checkpoint.manifest == recorder.recorded and checkpoint.step == 2

    before = CallRecorder()
    before.rebuild([one, two, obs_one, obs_two])
    assert (before.turn, before.step, before.last_call, before.since_last_call) == \
        (2, 2, two.artifact_id, [obs_one.artifact_id, obs_two.artifact_id])
    splice = p.CheckpointRecord(checkpoint_id="c", step=1, turn=2, token_offset=0, cache_handle="", reason="turn",
                                manifest=[one.artifact_id, two.artifact_id, obs_one.artifact_id])
    discarded = recorder.splice(splice)
    assert discarded == [obs_two.artifact_id, three.artifact_id]
    assert (recorder.turn, recorder.step, recorder.last_call) == (2, 1, two.artifact_id)
    assert recorder.tool_call("shell", {}, "a4", "s", None).artifact_id == three.artifact_id  # positional ids
