"""A model-driven session refuses compaction with its reason, before any session opens; the demo's closing lines
are commands the CLI accepts, naming the session it left open."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.demo import inspect_hint
from agent.harness import run_model_session
from agent.runtime import COMPACTION_REFUSED, AgentSession
from agent.scenario import ScriptedPolicy
from agent.scenarios import WORKSPACE, finance
from sandboxd.cli import parser


class Unreachable:
    """A client double that fails the test if anything reaches it: a refusal must come first."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the client was used ({name}) before the refusal")


@settings(deadline=None, max_examples=25)
@given(every=st.integers(min_value=1, max_value=50))
def test_a_model_session_refuses_compaction(every: int) -> None:
    with pytest.raises(ValueError, match="compaction is not available when the model decides"):
        AgentSession(Unreachable(), "s-1", object(), compact_every=every)  # type: ignore[arg-type]
    scenario = finance("http://vendor.test/vendors", compact_every=every)
    with pytest.raises(ValueError) as raised:
        run_model_session(Unreachable(), scenario, WORKSPACE)  # type: ignore[arg-type]
    assert str(raised.value) == COMPACTION_REFUSED


@settings(deadline=None, max_examples=25)
@given(every=st.integers(min_value=0, max_value=50))
def test_the_scripted_policy_still_compacts(every: int) -> None:
    scenario = finance("http://vendor.test/vendors", compact_every=every)
    agent = AgentSession(Unreachable(), "s-1", object(), ScriptedPolicy(scenario))  # type: ignore[arg-type]
    assert agent.compact_every == every
    model = AgentSession(Unreachable(), "s-1", object(), compact_every=0)  # type: ignore[arg-type]
    assert model.compact_every == 0 and model.policy is None
    assert msgspec.structs.replace(scenario, compact_every=0).compact_every == 0


@settings(deadline=None, max_examples=25)
@given(session=st.from_regex(r"s-[0-9a-f]{8,16}", fullmatch=True))
def test_the_demo_ends_with_commands_the_cli_accepts(session: str) -> None:
    state, config = Path("/tmp/out/demo-state"), Path("out/demo-sandboxd.toml")
    hint = inspect_hint(state, config, session)
    commands = [shlex.split(line.strip().rstrip("&")) for line in hint.splitlines() if "-m sandboxd.cli" in line]
    assert {c[3] for c in commands} >= {"console", "serve", "graph", "calls", "revocations"}
    for command in commands:
        args = parser().parse_args(command[3:])  # python -m sandboxd.cli ...
        if command[3] in ("console", "serve"):
            assert Path(args.state_dir) == state
        else:
            assert session in command and args.endpoint == f"ipc://{state / 'sandboxd.sock'}"
