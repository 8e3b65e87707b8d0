"""Rollback and fork of a whole session, on the real engine and real SMTP/HTTP sinks.

What the sinks received is the truth here, not what the daemon says it sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec
import pytest

import docker
from agent.context import SeededContext
from agent.models.local import LocalBackend
from agent.runtime import AgentSession, Exogenous, exogenous_inputs
from agent.scenario import Scenario, ScriptedPolicy, Task, ToolStep
from sandboxd import protocol as p
from sandboxd.client import Client, RemoteError
from sandboxd.launcher import DaemonProcess
from sandboxd.sandbox.containers import LABEL_SESSION
from tests.integration.operator_world import EMAIL, Sinks, by_tool, drive, notes, operated, sinks
from tests.integration.test_crash_phases import Wire, containers_of

pytestmark = pytest.mark.docker
__all__ = ["operated", "sinks"]

SCENARIO = Scenario(name="notes", system="You keep notes in /workspace.", compact_every=0, tasks=[
    Task(text="Write the first notes.", steps=[ToolStep(name="write_file", arguments={"path": "notes.txt",
                                                                                      "content": "v1\n"})],
         answer="Written."),
    Task(text="Revise the notes and tell everyone.", steps=[
        ToolStep(name="write_file", arguments={"path": "notes.txt", "content": "v2\n"}),
        ToolStep(name="webhook", arguments={"body": {"event": "revised"}}),
        ToolStep(name="send_email", arguments=EMAIL)], answer="Done."),
])


def test_rollback_drops_held_orphans_fired_compensates_once_and_the_agent_resumes(
        operated: DaemonProcess, sinks: Sinks) -> None:
    client = operated.client()
    sid = client.open_session().session_id
    agent = AgentSession(client, sid, LocalBackend.tiny(seed=0, max_positions=8192), ScriptedPolicy(SCENARIO),
                         SeededContext(seed=0))
    agent.start(exogenous_inputs(SCENARIO))
    agent.run()
    assert notes(client, sid) == "v2\n"
    assert len(sinks.posts("/hook")) == 1 and sinks.smtp.count == 0
    [email] = client.outbox(sid)
    graph_before = client.graph(sid)

    # Turn 3 is the first of the second task: it and everything after it go.
    report = client.rollback(sid, turn=3, compensate=True)

    assert notes(client, sid) == "v1\n"
    assert report["dropped"] == [email.call_id] and client.outbox(sid) == []
    [orphan] = report["orphaned"]
    [hook] = by_tool(client, sid, "webhook")
    assert orphan["call_id"] == hook.call_id and hook.state == "orphaned"
    assert orphan["compensation"] and orphan["compensation_state"] == "done"
    [undo] = sinks.posts("/undo")
    assert json.loads(undo["body"]) == {"undo": hook.call_id, "body": {"event": "revised"}}  # type: ignore[arg-type]
    # Compensating again is answered from the ledger: the far side hears of it once.
    again = client.compensate(hook.call_id)
    assert again["compensation"]["deduplicated"] and len(sinks.posts("/undo")) == 1
    assert [c.state for c in by_tool(client, sid, "send_email")] == ["dropped"]
    assert sinks.smtp.count == 0

    # Provenance and checkpoints after the point are gone; the point is the session's latest checkpoint.
    graph = client.graph(sid)
    point = report["to"]
    assert max(c.created_at for c in graph.checkpoints) == point["created_at"]
    assert len(graph.artifacts) == len(graph_before.artifacts) - report["artifacts_removed"]
    assert all(a.turn < 3 for a in graph.artifacts) and report["artifacts_removed"] > 0

    # The agent resumes from the point and does the second task again: the notes change again, the undone
    # webhook is made again (its compensation undid it), the email is held again; nothing fired twice.
    agent.reattach([Exogenous(type="user", text=SCENARIO.tasks[1].text)])
    agent.run()
    assert notes(client, sid) == "v2\n"
    assert len(sinks.posts("/hook")) == 2 and len(sinks.posts("/undo")) == 1 and sinks.smtp.count == 0
    assert [h.tool for h in client.outbox(sid)] == ["send_email"]
    assert operated.client().health().open_sessions == 1


def test_rollback_to_a_snapshot_and_by_checkpoint_without_compensating(
        operated: DaemonProcess, sinks: Sinks) -> None:
    client = operated.client()
    sid = client.open_session().session_id
    points = drive(client, sid)
    report = client.rollback(sid, checkpoint=points["A"].checkpoint_id)
    assert notes(client, sid) == "v1\n"
    [orphan] = report["orphaned"]
    # Not asked to compensate: the report says how, and nothing was sent to the undo URL.
    assert orphan["compensation_state"] is None and orphan["compensation"] and sinks.posts("/undo") == []
    # The first webhook fired before the point: it stays done, and is not listed.
    assert sorted(c.state for c in by_tool(client, sid, "webhook")) == ["done", "orphaned"]
    done = client.compensate(orphan["call_id"])
    assert done["compensation"]["state"] == "done" and len(sinks.posts("/undo")) == 1

    # A snapshot is a point as well: the start's snapshot brings back the empty workspace.
    start = points["start"].snapshot_id
    assert start is not None
    report = client.rollback(sid, snapshot=start)
    assert report["files_restored"] == start
    listing = client.call(sid, "list_dir", {"recursive": True}).stdout
    assert "notes.txt" not in listing
    [first] = [o for o in report["orphaned"]]
    assert first["tool"] == "webhook" and sinks.smtp.count == 0


@pytest.mark.parametrize("phase", ["begun", "committing", "committed:provenance", "committed:sandbox"])
def test_kill_9_during_a_rollback_leaves_the_session_before_or_after_it(
        phase: str, sinks: Sinks, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(["--config", str(sinks.config([phase]))])
    client = daemon.client()
    sid = client.open_session().session_id
    points = drive(client, sid)
    wire = Wire(daemon)
    wire.send(p.RollbackRequest(request_id="r", session_id=sid, checkpoint=points["A"].checkpoint_id))
    assert wire.reply() is None  # the daemon died mid-request: no reply of any kind
    wire.close()
    assert daemon.proc is not None and daemon.proc.wait(timeout=30) == -9
    daemon.extra_args = ["--config", str(sinks.config())]  # the next daemon does not crash again
    daemon.start()
    client = daemon.client()

    checkpoints = [c.checkpoint_id for c in client.graph(sid).checkpoints]
    webhooks = sorted(c.state for c in by_tool(client, sid, "webhook"))
    emails = [c.state for c in by_tool(client, sid, "send_email")]
    if phase == "begun":  # not yet committing: abandoned at start-up, the session as it was
        assert notes(client, sid) == "v2\n" and "cp-2-turn" in checkpoints
        assert webhooks == ["done", "done"] and emails == ["staged"] and len(client.outbox(sid)) == 1
        report = client.rollback(sid, checkpoint=points["A"].checkpoint_id)  # and it can be done again
        assert len(report["orphaned"]) == 1
    else:  # committing: finished at start-up, the session after it
        assert notes(client, sid) == "v1\n" and checkpoints[-1] == "cp-1-turn"
        assert webhooks == ["done", "orphaned"] and emails == ["dropped"] and client.outbox(sid) == []
    assert len(sinks.posts("/hook")) == 2 and sinks.smtp.count == 0 and sinks.posts("/undo") == []


@pytest.mark.parametrize("phase", ["fork:opening", "fork:open"])
def test_kill_9_during_a_fork_leaves_no_half_fork(phase: str, sinks: Sinks, engine: docker.DockerClient,
                                                  daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(["--config", str(sinks.config([phase]))])
    client = daemon.client()
    parent = client.open_session().session_id
    points = drive(client, parent)
    before = state_of(client, parent)
    wire = Wire(daemon)
    wire.send(p.ForkRequest(request_id="f", session_id=parent, checkpoint=points["A"].checkpoint_id))
    assert wire.reply() is None  # the daemon died mid-fork
    wire.close()
    assert daemon.proc is not None and daemon.proc.wait(timeout=30) == -9
    daemon.extra_args = ["--config", str(sinks.config())]
    daemon.start()
    client = daemon.client()

    assert state_of(client, parent) == before  # the parent is never touched, whenever the fork died
    [child] = [s for s in client.sessions(include_closed=True) if s.session_id != parent]
    sandboxes = {c.labels.get(LABEL_SESSION) for c in containers_of(engine, daemon)}
    if phase == "fork:opening":  # files and sandbox made, nothing recorded: torn down at start-up
        assert child.state == "failed" and child.session_id not in sandboxes and parent in sandboxes
        store = daemon.state_dir / "snapshots"
        assert not any(child.session_id in path.name for top in store.iterdir() if top.is_dir()
                       for path in (top, *top.iterdir()))
        assert [c.session_id for c in client.sessions()] == [parent]
        again = client.fork(parent, points["A"].checkpoint_id)  # and it can be done again
        child = next(s for s in client.sessions() if s.session_id == again["session_id"])
    assert child.state == "open"  # the fork is whole: files, provenance, ledger of the point
    assert notes(client, child.session_id) == "v1\n"
    assert [c.checkpoint_id for c in client.graph(child.session_id).checkpoints] == ["cp-start", "cp-1-turn"]
    retried = client.call(child.session_id, "webhook", {"body": {"event": "first"}}, call_id="live/call-1-1", turn=1)
    assert retried.deduplicated and len(sinks.posts("/hook")) == 2 and sinks.smtp.count == 0
    assert client.health().open_sessions == 2


def test_a_fork_has_the_parents_past_and_effects_of_its_own(operated: DaemonProcess, sinks: Sinks) -> None:
    client = operated.client()
    parent = client.open_session().session_id
    points = drive(client, parent)
    fork = client.fork(parent, points["A"].checkpoint_id)
    child = fork["session_id"]
    assert child != parent and fork["effects"] == "held" and fork["inherited_calls"] == 1

    # Files, provenance and checkpoints of the point; the parent is untouched.
    assert notes(client, child) == "v1\n" and notes(client, parent) == "v2\n"
    assert [c.checkpoint_id for c in client.graph(child).checkpoints] == ["cp-start", "cp-1-turn"]
    mine = {a.artifact_id for a in client.graph(child).artifacts}
    assert mine < {a.artifact_id for a in client.graph(parent).artifacts}

    # A retry of a call made before the point is answered from the ledger, never fired again.
    retried = client.call(child, "webhook", {"body": {"event": "first"}}, call_id="live/call-1-1", turn=1)
    assert retried.deduplicated and len(sinks.posts("/hook")) == 2

    # The fork's new effects are its own and held: the parent's held email is not the fork's to decide.
    made = client.call(child, "webhook", {"body": {"event": "revised"}}, call_id="live/call-2-1", turn=2)
    assert made.held and len(sinks.posts("/hook")) == 2
    [held] = client.outbox(child)
    [theirs] = client.outbox(parent)
    assert held.call_id == made.call_id != theirs.call_id and theirs.tool == "send_email"
    released = client.release(held.call_id)
    assert released.state == "done" and len(sinks.posts("/hook")) == 3
    # The fork writes its own files; a rollback of the parent does not reach the fork.
    client.call(child, "write_file", {"path": "notes.txt", "content": "fork\n"})
    client.rollback(parent, checkpoint=points["start"].checkpoint_id)
    # (The inherited call is the parent's own ledger row: orphaned by the parent's rollback, as it should be.)
    assert notes(client, child) == "fork\n"
    assert [c.state for c in by_tool(client, child, "webhook") if c.call_id == made.call_id] == ["done"]
    assert client.outbox(child) == [] and sinks.smtp.count == 0
    # The fork can fork and roll back in turn: its checkpoints have their own snapshots.
    again = client.rollback(child, checkpoint="cp-1-turn")
    assert notes(client, child) == "v1\n" and again["orphaned"][0]["call_id"] == made.call_id


def test_bad_rollbacks_and_forks_are_refused_and_change_nothing(operated: DaemonProcess, sinks: Sinks) -> None:
    client = operated.client()
    sid = client.open_session().session_id
    drive(client, sid)
    before = state_of(client, sid)
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: client.rollback(sid), "invalid_arguments", "exactly one point"),
        (lambda: client.rollback(sid, checkpoint="cp-9", turn=1), "invalid_arguments", "exactly one point"),
        (lambda: client.rollback(sid, checkpoint="cp-nope"), "not_found", "no live checkpoint"),
        (lambda: client.rollback(sid, turn=40), "invalid_arguments", "has not happened"),
        (lambda: client.rollback(sid, snapshot="snap-000000000000"), "snapshot_not_found", ""),
        (lambda: client.rollback("s-doesnotexist", turn=1), "unknown_session", ""),
        (lambda: client.fork(sid, "cp-nope"), "not_found", "no live checkpoint"),
        (lambda: client.fork("s-doesnotexist", "cp-start"), "unknown_session", ""),
        (lambda: client.compensate("fx-nope"), "not_found", "no external call"),
        (lambda: client.compensate(by_tool(client, sid, "webhook")[0].call_id), "invalid_state", "orphaned"),
        (lambda: client.compensate(by_tool(client, sid, "send_email")[0].call_id), "invalid_arguments",
         "declares no compensating action"),
    ]
    for attempt, code, words in cases:
        with pytest.raises(RemoteError) as err:
            attempt()
        assert err.value.wire_code == code and words in err.value.message, err.value
    assert client.health().open_sessions == 1 and state_of(client, sid) == before


def test_an_unknown_outcome_after_the_point_blocks_a_rollback_unless_forced(
        sinks: Sinks, daemon_factory: Callable[..., DaemonProcess]) -> None:
    sinks.http.delay = 3.0  # the far side answers after the adapter gave up: the outcome is unknown
    daemon = daemon_factory(["--config", str(sinks.config(webhook_path="/slow/hook", timeout=1.0))])
    client = daemon.client()
    sid = client.open_session().session_id
    points = drive(client, sid, slow=True)
    [unknown] = [c.call_id for c in by_tool(client, sid, "webhook") if c.state == "unknown"]
    before = state_of(client, sid)
    with pytest.raises(RemoteError) as err:
        client.rollback(sid, checkpoint=points["A"].checkpoint_id)
    assert err.value.wire_code == "invalid_state" and unknown in err.value.message and "--force" in err.value.message
    assert state_of(client, sid) == before
    report = client.rollback(sid, checkpoint=points["A"].checkpoint_id, force=True)
    assert report["unresolved"] == [unknown] and notes(client, sid) == "v1\n"


def state_of(client: Client, sid: str) -> object:
    """What a refused operation must leave as it was: provenance, effects, outbox, files."""
    effects = [(c.call_id, c.state) for c in client.calls(sid) if c.effect == "external"]
    graph = client.graph(sid)
    return (msgspec.to_builtins(graph.artifacts), msgspec.to_builtins(graph.checkpoints), effects,
            [h.call_id for h in client.outbox(sid)],
            client.call(sid, "list_dir", {"recursive": True}).stdout, notes(client, sid))
