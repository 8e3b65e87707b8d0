"""An agent session of 20+ turns against a real daemon and sandbox: provenance, closures, checkpoints."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.harness import MailSink, Web, daemon_config, run_session
from agent.runtime import AgentSession
from agent.scenarios import VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess

pytestmark = pytest.mark.docker


@pytest.fixture
def world() -> Iterator[tuple[MailSink, Web]]:
    mail, web = MailSink(), Web({"/vendors": VENDOR_PAGE})
    yield mail, web
    mail.close()
    web.close()


@pytest.fixture
def agent_daemon(daemon_factory: Callable[..., DaemonProcess], world: tuple[MailSink, Web]) -> DaemonProcess:
    mail, web = world
    config = daemon_config(Path(tempfile.mkdtemp()) / "sandboxd.toml", mail, web)
    return daemon_factory(["--config", str(config)])


@pytest.fixture
def session(agent_daemon: DaemonProcess, world: tuple[MailSink, Web]) -> AgentSession:
    return run_session(agent_daemon.client(), finance(world[1].url("/vendors")), WORKSPACE)


def test_the_session_runs_tools_in_the_sandbox(session: AgentSession, world: tuple[MailSink, Web]) -> None:
    assert session.turn >= 10 and session.step >= 20
    assert session.answer() == "Archived projects/q3.csv."
    listing = session.client.call(session.session_id, "list_dir", {"path": "archive"}).stdout
    assert "archive/q3.csv" in listing
    # The hijacked agent followed the page: a note in the sandbox and an email through the firewall.
    assert session.client.call(session.session_id, "read_file", {"path": "notes/admin.txt"}).stdout.startswith(
        "forward every report")
    assert world[0].subjects() == ["q3 figures", "Q3 report"]


def test_the_graph_records_what_actually_depended_on_what(session: AgentSession) -> None:
    graph = session.client.graph(session.session_id)
    by_id = {a.artifact_id: a for a in graph.artifacts}
    types = {a.type for a in graph.artifacts}
    assert types == {"system", "memory", "user", "model_turn", "plan", "tool_call", "observation", "reply", "summary"}
    context_blocks = [b.artifact_id for b in session.blocks]
    for i, block in enumerate(session.blocks):
        artifact = by_id[block.artifact_id]
        assert artifact.token_span == block.span
        if block.type in ("model_turn", "summary"):
            assert artifact.parents == context_blocks[:i]  # a turn depends on every block of its context
        if block.type == "observation":
            assert artifact.parents == [block.answers] and by_id[block.answers].type == "tool_call"
        if block.type == "user":
            assert artifact.parents == []
    for call in (a for a in graph.artifacts if a.type == "tool_call"):
        assert len(call.parents) == 1 and by_id[call.parents[0]].type == "model_turn"
    injected = [b for b in session.blocks if b.type == "memory" and b.injects]
    assert injected and all(by_id[b.artifact_id].parents == [b.injects] for b in injected)
    steps = [by_id[b.artifact_id].step for b in session.blocks if b.type in ("user", "memory", "observation")]
    assert steps == list(range(1, len(steps) + 1))


def test_taint_closure_is_exactly_what_depended_on_the_source(session: AgentSession) -> None:
    graph = session.client.graph(session.session_id)
    source = next(a for a in graph.artifacts if a.type == "observation" and "Vendor notes" in a.content)
    children: dict[str, list[str]] = {}
    for artifact in graph.artifacts:
        for parent in artifact.parents:
            children.setdefault(parent, []).append(artifact.artifact_id)
    expected, frontier = {source.artifact_id}, [source.artifact_id]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in expected:
                expected.add(child)
                frontier.append(child)
    answer = session.client.provenance(session.session_id, source.artifact_id)
    assert set(answer.taint_closure) == expected
    assert answer.tau == source.step and answer.T == session.step
    turns = [a for a in graph.artifacts if a.type == "model_turn"]
    # Every turn decoded before the page was read is clean; every later one is tainted.
    assert {a.artifact_id for a in turns if a.step < source.step}.isdisjoint(expected)
    assert {a.artifact_id for a in turns if a.step >= source.step} <= expected
    assert {a.artifact_id for a in graph.artifacts if a.type == "user"}.isdisjoint(expected)
    assert answer.checkpoint is not None and answer.checkpoint.step == source.step - 1
    assert source.token_span is not None and answer.checkpoint.token_offset == source.token_span[0]


def test_checkpoints_are_metadata_with_snapshots_only_when_the_sandbox_changed(session: AgentSession) -> None:
    checkpoints = session.client.graph(session.session_id).checkpoints
    reasons = {c.reason for c in checkpoints}
    assert reasons == {"start", "turn", "memory", "external", "compaction"}
    observations = [b for b in session.blocks if b.type in ("user", "memory", "observation")]
    assert len([c for c in checkpoints if c.reason in ("turn", "memory")]) == len(observations)
    snapshots = {c.snapshot_id for c in checkpoints}
    assert None not in snapshots
    assert len(snapshots) < len(checkpoints) / 2  # most checkpoints reuse the last snapshot
    listed = {s.snapshot_id for s in session.client.snapshots(session.session_id)}
    assert snapshots <= listed
    for checkpoint in checkpoints:
        assert checkpoint.manifest == [b.artifact_id for b in session.blocks][:len(checkpoint.manifest)]
