"""The daemon's core logic through `Service` over `LocalSandbox`: no Docker, no sockets, milliseconds a request.

Calls and their records, snapshots and restore, provenance, a revocation from raise to commit, rollback and
fork, each driven by the requests an agent or an operator sends, answered by the same `Service.handle` the
server calls (the error boundary included). The sandbox is the in-process one (sandboxd/sandbox/local.py):
it isolates nothing, which is not what these tests are about; the Docker sandbox has its integration tests.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd import protocol as p
from sandboxd.auth import LOCAL_PEER, Peer
from sandboxd.config import DaemonConfig
from sandboxd.db import Database
from sandboxd.sandbox.local import LocalSandbox
from sandboxd.service import Service
from snapshots import open_store

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Daemon:
    """A `Service` on a temporary state directory, and the requests a test sends it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        config = DaemonConfig(state_dir=str(root / "state"), snapshot_backend="copy")
        config.state_path.mkdir(parents=True)
        self.db = Database(config.state_path / "state.db")
        self.service = Service(config, self.db, LocalSandbox(root / "scratch"),
                               open_store("copy", config.state_path / "snapshots"))
        self.service.recover()
        self._ids = 0

    def ask(self, request_type: type[Any], peer: Peer = LOCAL_PEER, **fields: Any) -> Any:
        """Send one request; an ErrorResponse fails the test (use `refused` where one is expected)."""
        reply = self.send(request_type, peer, **fields)
        assert not isinstance(reply, p.ErrorResponse), reply
        return reply

    def refused(self, request_type: type[Any], **fields: Any) -> p.ErrorResponse:
        reply = self.send(request_type, LOCAL_PEER, **fields)
        assert isinstance(reply, p.ErrorResponse), reply
        return reply

    def send(self, request_type: type[Any], peer: Peer = LOCAL_PEER, **fields: Any) -> p.Response:
        self._ids += 1
        # Through msgpack and back: what reaches the service is what the wire would deliver.
        wire = p.encode(request_type(request_id=f"r{self._ids}", **fields))
        return self.service.handle(p.decode_request(wire), peer)

    def open(self) -> str:
        return str(self.ask(p.OpenSessionRequest).session.session_id)

    def call(self, sid: str, tool: str, **args: Any) -> p.CallResult:
        return self.ask(p.CallRequest, session_id=sid, tool=tool, args=args).result

    def read(self, sid: str, path: str) -> str | None:
        """A workspace file's text, None when it does not exist."""
        reply = self.send(p.CallRequest, session_id=sid, tool="read_file", args={"path": path})
        if isinstance(reply, p.ErrorResponse):
            assert reply.code == "not_found", reply
            return None
        assert isinstance(reply, p.CallResponse) and reply.result.exit_code == 0, reply
        return reply.result.stdout

    def record(self, sid: str, *artifacts: p.Artifact, branch: str = "") -> None:
        self.ask(p.RecordArtifactsRequest, session_id=sid, artifacts=list(artifacts), branch=branch)

    def checkpoint(self, sid: str, cid: str, step: int, turn: int, manifest: list[str],
                   branch: str = "") -> p.CheckpointRecord:
        record = p.CheckpointRecord(checkpoint_id=cid, step=step, turn=turn, token_offset=10 * len(manifest),
                                    cache_handle="", reason="turn", manifest=manifest)
        return self.ask(p.CheckpointRequest, session_id=sid, checkpoint=record, branch=branch).checkpoint

    def graph(self, sid: str) -> p.GraphResponse:
        return self.ask(p.GraphRequest, session_id=sid)


@contextmanager
def daemon() -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="sandboxd-core-"))
    try:
        yield Daemon(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def art(aid: str, kind: str, step: int, turn: int, content: str = "", parents: list[str] | None = None,
        **meta: Any) -> p.Artifact:
    return p.Artifact(artifact_id=aid, type=kind, parents=parents or [], step=step, turn=turn,  # type: ignore[arg-type]
                      content=content, token_span=(0, 1), meta=meta)


def history(d: Daemon, sid: str, secret: str) -> None:
    """What an agent records for: read notes.txt (the secret in it), write a summary quoting it.

    Steps: the user's task is o_1; the checkpoint cp-1 sits before the read's result o_2 (the secret's
    source, tau = 2); the summary is written after cp-2."""
    d.call(sid, "write_file", path="notes.txt", content=f"meeting notes: {secret} end")
    d.checkpoint(sid, "cp-0", 0, 0, [])
    d.record(sid, art("u1", "user", 1, 1, "Summarise notes.txt"))
    d.checkpoint(sid, "cp-1", 1, 1, ["u1"])
    d.record(sid, art("m1", "model_turn", 1, 1, "read it", ["u1"]), art("t1", "tool_call", 1, 1, "read", ["m1"]))
    read = d.call(sid, "read_file", path="notes.txt")
    d.record(sid, art("o2", "observation", 2, 1, read.stdout, ["t1"], tool="read_file"),
             art("m2", "model_turn", 2, 1, f"summary: {secret}", ["u1", "m1", "t1", "o2"]))
    d.checkpoint(sid, "cp-2", 2, 1, ["u1", "m1", "t1", "o2", "m2"])
    d.record(sid, art("t2", "tool_call", 2, 2, "write", ["m2"]))
    wrote = d.call(sid, "write_file", path="summary.txt", content=f"summary: {secret}")
    d.record(sid, art("o3", "observation", 3, 2, wrote.stdout, ["t2"], tool="write_file"))


SECRETS = st.text(alphabet=st.characters(codec="ascii", categories=("L", "N")), min_size=12, max_size=40).map(
    lambda s: "key-" + s)
FILES = st.dictionaries(st.from_regex(r"[a-z]{1,8}\.txt", fullmatch=True),
                        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=60),
                        min_size=1, max_size=4)


# Calls and their records -----------------------------------------------------------------------

@FAST
@given(files=FILES)
def test_calls_run_in_the_sandbox_and_each_has_one_record(files: dict[str, str]) -> None:
    with daemon() as d:
        sid = d.open()
        ids = [d.call(sid, "write_file", path=name, content=text).call_id for name, text in files.items()]
        for name, text in files.items():
            assert d.read(sid, name) == text
        calls = d.ask(p.ListCallsRequest, session_id=sid).calls
        assert [c.call_id for c in calls if c.tool == "write_file"] == ids
        assert all(c.state == "done" for c in calls)


def test_a_repeated_call_id_answers_from_its_record_without_running_again() -> None:
    with daemon() as d:
        sid = d.open()
        first = d.ask(p.CallRequest, session_id=sid, tool="write_file", args={"path": "a", "content": "1"},
                      call_id="c-once").result
        d.call(sid, "write_file", path="a", content="2")
        again = d.ask(p.CallRequest, session_id=sid, tool="write_file", args={"path": "a", "content": "1"},
                      call_id="c-once").result
        assert again.replayed and again.stdout == first.stdout
        assert d.read(sid, "a") == "2"  # the first call did not run a second time


def test_bad_requests_are_error_replies_and_change_nothing() -> None:
    with daemon() as d:
        sid = d.open()
        d.call(sid, "write_file", path="a", content="kept")
        before = d.ask(p.ListCallsRequest, session_id=sid).calls
        assert d.refused(p.CallRequest, session_id=sid, tool="no_such_tool", args={}).code == "unknown_tool"
        assert d.refused(p.CallRequest, session_id="s-none", tool="read_file", args={"path": "a"}).code \
            == "unknown_session"
        assert d.refused(p.RestoreRequest, session_id=sid, snapshot_id="snap-none").code == "snapshot_not_found"
        stranger = Peer("someone-else")
        assert isinstance(d.send(p.CallRequest, stranger, session_id=sid, tool="read_file", args={"path": "a"}),
                          p.ErrorResponse)
        assert d.ask(p.ListCallsRequest, session_id=sid).calls == before
        assert d.read(sid, "a") == "kept"


# Snapshots and restore -------------------------------------------------------------------------

@FAST
@given(stages=st.lists(FILES, min_size=1, max_size=4), pick=st.integers(min_value=0))
def test_restore_brings_back_exactly_the_files_of_that_snapshot(stages: list[dict[str, str]], pick: int) -> None:
    with daemon() as d:
        sid = d.open()
        taken: list[tuple[str, dict[str, str]]] = []
        state: dict[str, str] = {}
        for files in stages:
            for name, text in files.items():
                d.call(sid, "write_file", path=name, content=text)
            state = {**state, **files}
            taken.append((d.ask(p.SnapshotRequest, session_id=sid).snapshot.snapshot_id, dict(state)))
        d.call(sid, "write_file", path="later.txt", content="after every snapshot")
        snapshot_id, expected = taken[pick % len(taken)]
        d.ask(p.RestoreRequest, session_id=sid, snapshot_id=snapshot_id)
        assert {name: d.read(sid, name) for name in state} == {n: expected.get(n) for n in state}
        assert d.read(sid, "later.txt") is None


# Provenance ------------------------------------------------------------------------------------

@st.composite
def graphs(draw: st.DrawFn) -> list[p.Artifact]:
    """A provenance DAG in recording order: each artifact's parents are among those recorded before it."""
    count = draw(st.integers(min_value=1, max_value=12))
    made: list[p.Artifact] = []
    step = 0
    for i in range(count):
        kind = draw(st.sampled_from(["user", "observation", "model_turn", "tool_call"]))
        step += kind in p.OBSERVATION_TYPES
        parents = draw(st.lists(st.sampled_from([a.artifact_id for a in made]), unique=True, max_size=3)) if made \
            else []
        made.append(art(f"a{i}", kind, step, 1, f"text {i}", parents))
    return made


@FAST
@given(artifacts=graphs())
def test_the_taint_closure_is_everything_reachable_from_the_source(artifacts: list[p.Artifact]) -> None:
    with daemon() as d:
        sid = d.open()
        d.checkpoint(sid, "cp-0", 0, 0, [])
        d.record(sid, *artifacts)
        d.record(sid, *artifacts)  # sent again: identical artifacts are not recorded twice
        assert [a.artifact_id for a in d.graph(sid).artifacts] == [a.artifact_id for a in artifacts]
        children: dict[str, list[str]] = {}
        for a in artifacts:
            for parent in a.parents:
                children.setdefault(parent, []).append(a.artifact_id)
        for source in (a for a in artifacts if a.type in p.OBSERVATION_TYPES):
            reach, todo = {source.artifact_id}, [source.artifact_id]
            while todo:
                for child in children.get(todo.pop(), []):
                    if child not in reach:
                        reach.add(child)
                        todo.append(child)
            found = d.ask(p.ProvenanceRequest, session_id=sid, source=source.artifact_id)
            assert found.tau == source.step and set(found.taint_closure) == reach


def test_an_artifact_sent_again_with_other_contents_is_refused_and_nothing_is_recorded() -> None:
    with daemon() as d:
        sid = d.open()
        d.record(sid, art("u1", "user", 1, 1, "first"))
        reply = d.refused(p.RecordArtifactsRequest, session_id=sid,
                          artifacts=[art("u2", "user", 2, 1, "new"), art("u1", "user", 1, 1, "changed")])
        assert reply.code == "invalid_arguments"
        assert [(a.artifact_id, a.content) for a in d.graph(sid).artifacts] == [("u1", "first")]


# A revocation, raise to commit ---------------------------------------------------------------

@FAST
@given(secret=SECRETS)
def test_a_revocation_replays_without_the_target_and_commits_its_branch(secret: str) -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, secret)
        raised = d.ask(p.RevokeRequest, session_id=sid, source="o2", target=secret)
        assert raised.revocation.tau == 2 and raised.revocation.checkpoint_id == "cp-1"
        assert set(raised.taint_closure) >= {"o2", "m2"} and "u1" not in raised.taint_closure
        rid = raised.revocation.revocation_id
        assert [r.revocation_id for r in d.ask(p.PendingRevocationsRequest, session_id=sid).revocations] == [rid]

        plan = d.ask(p.BeginRevocationRequest, revocation_id=rid)
        assert plan.checkpoint.checkpoint_id == "cp-1" and plan.source_call == "t1"
        assert plan.source_result is not None and secret not in plan.source_result
        assert d.read(sid, "summary.txt") is None  # the sandbox is back at cp-1's snapshot
        # The replay: the same read now returns the notes with the target excised.
        reread = d.ask(p.CallRequest, session_id=sid, tool="read_file", args={"path": "notes.txt"},
                       mode="shadow", branch=plan.branch).result
        assert secret not in reread.stdout and "meeting notes" in reread.stdout
        d.record(sid, art("m1", "model_turn", 1, 1, "read it", ["u1"]), art("t1", "tool_call", 1, 1, "read", ["m1"]),
                 art("o2", "observation", 2, 1, reread.stdout, ["t1"], tool="read_file"),
                 art("m2b", "model_turn", 2, 1, "summary: nothing secret", ["o2"]), branch=plan.branch)
        d.checkpoint(sid, "cp-2b", 2, 1, ["u1", "m1", "t1", "o2", "m2b"], branch=plan.branch)

        report = d.ask(p.CommitRevocationRequest, revocation_id=rid, tokens=p.TokenCounts(),
                       transitions_replayed=1, final_step=2).report
        assert report.leak_scan["hits"] == 0, report.leak_scan
        graph = d.graph(sid)
        assert [a.artifact_id for a in graph.artifacts] == ["u1", "m1", "t1", "o2", "m2b"]
        assert [c.checkpoint_id for c in graph.checkpoints] == ["cp-0", "cp-1", "cp-2b"]
        assert not any(secret in a.content for a in graph.artifacts)
        status = d.ask(p.RevocationStatusRequest, revocation_id=rid).revocation
        assert status.state == "done"
        d.db.purge()
        state_dir = d.root / "state"
        assert not any(secret.encode() in f.read_bytes() for f in state_dir.glob("state.db*"))
        # Forgotten for good: a later read of the file the target is still in gets it excised.
        assert secret not in d.call(sid, "read_file", path="notes.txt").stdout


@pytest.mark.parametrize("source, target", [("o2", "   "), ("o2", "key-notinthesource"), ("m2", None),
                                            ("nope", None)])
def test_a_revocation_that_names_nothing_revocable_is_refused_and_nothing_is_raised(source: str,
                                                                                      target: str | None) -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, "key-somesecretvalue")
        reply = d.refused(p.RevokeRequest, session_id=sid, source=source, target=target)
        assert reply.code in ("invalid_arguments", "not_found")
        assert d.ask(p.ListRevocationsRequest, session_id=sid).revocations == []
        assert d.read(sid, "summary.txt") == "summary: key-somesecretvalue"


def test_a_revocation_that_is_not_replaying_cannot_commit() -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, "key-notreplayingyet")
        rid = d.ask(p.RevokeRequest, session_id=sid, source="o2", target="key-notreplayingyet").revocation.revocation_id
        reply = d.refused(p.CommitRevocationRequest, revocation_id=rid, tokens=p.TokenCounts(),
                          transitions_replayed=0, final_step=0)
        assert reply.code == "invalid_state"
        assert d.ask(p.RevocationStatusRequest, revocation_id=rid).revocation.state == "pending"


# Rollback and fork -----------------------------------------------------------------------------

def test_rollback_truncates_the_history_and_restores_the_files_of_its_point() -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, "key-rolledbackvalue")
        calls_before = len(d.ask(p.ListCallsRequest, session_id=sid).calls)
        report = d.ask(p.RollbackRequest, session_id=sid, checkpoint="cp-1").report
        assert report.to.checkpoint_id == "cp-1"
        assert [a.artifact_id for a in d.graph(sid).artifacts] == ["u1"]
        assert report.artifacts_removed == 6 and report.checkpoints_removed == 1
        # The calls after the point go with it (the first, writing notes.txt, came before cp-1).
        assert report.calls_removed == 2
        assert len(d.ask(p.ListCallsRequest, session_id=sid).calls) == calls_before - 2
        assert d.read(sid, "summary.txt") is None and d.read(sid, "notes.txt") is not None
        assert d.refused(p.RollbackRequest, session_id=sid, checkpoint="cp-2").code == "not_found"


def test_fork_copies_the_session_up_to_its_point_and_leaves_the_parent_alone() -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, "key-forkedvalue")
        parent_graph = d.graph(sid)
        forked = d.ask(p.ForkRequest, session_id=sid, checkpoint="cp-2")
        child = forked.session.session_id
        assert child != sid and forked.report.parent == sid and forked.report.effects == "held"
        assert [a.artifact_id for a in d.graph(child).artifacts] == ["u1", "m1", "t1", "o2", "m2"]
        assert d.read(child, "summary.txt") is None and d.read(child, "notes.txt") is not None
        d.call(child, "write_file", path="only-in-child.txt", content="x")
        assert d.read(sid, "only-in-child.txt") is None
        assert d.read(sid, "summary.txt") == "summary: key-forkedvalue"
        after = d.graph(sid)
        assert (after.artifacts, after.checkpoints) == (parent_graph.artifacts, parent_graph.checkpoints)


@pytest.mark.parametrize("request_type", [p.RollbackRequest, p.ForkRequest])
def test_only_an_operator_may_move_a_session_to_another_branch(request_type: type[Any]) -> None:
    with daemon() as d:
        sid = d.open()
        history(d, sid, "key-operatoronly")
        owner = Peer("local")  # the session's owner key, without the operator's right
        reply = d.send(request_type, owner, session_id=sid, checkpoint="cp-1")
        assert isinstance(reply, p.ErrorResponse) and reply.code == "unauthorized"
        assert len(d.graph(sid).artifacts) == 7


def test_listing_every_session_names_each_by_its_own_state() -> None:
    """`session list --all`: a session being opened, being closed (by its idle timeout, say), failed or lost
    with its node is listed as what it is, not as closed; without --all only the open ones are."""
    states = get_args(p.SessionState)
    with daemon() as d:
        sids = {state: d.open() for state in states}
        for state, sid in sids.items():
            d.db.execute("UPDATE sessions SET state = ? WHERE session_id = ?", [state, sid])
        listed = {s.session_id: s.state for s in d.ask(p.ListSessionsRequest, include_closed=True).sessions}
        assert listed == {sid: state for state, sid in sids.items()}
        assert [s.session_id for s in d.ask(p.ListSessionsRequest).sessions] == [sids["open"]]
