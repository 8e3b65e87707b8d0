"""Calls answered at once on the socket thread (`Service.answer_now`): the same replies and the same records as
a worker's, and nothing done at all when one would have to wait.

Two daemons get the same generated calls: one answers each where it can at once (as the server does), the
other always through `handle`. Their replies and their sessions' records must match, call for call.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandboxd import protocol as p
from sandboxd.atonce import NOW_BYTES, NOW_ENTRIES
from sandboxd.auth import LOCAL_PEER, Peer
from tests.unit.test_core_service import FAST, Daemon, daemon

NAMES = st.sampled_from(["a.txt", "b.txt", "d/c.txt", "missing.txt", "d", ".", "../out", "/etc/passwd", "big.bin",
                         "many"])
CALLS = st.lists(st.one_of(
    st.tuples(st.just("read_file"), st.fixed_dictionaries({"path": NAMES})),
    st.tuples(st.just("list_dir"), st.fixed_dictionaries({}, optional={"path": NAMES, "recursive": st.booleans()})),
    st.tuples(st.just("write_file"), st.fixed_dictionaries({"path": NAMES, "content": st.text(max_size=20)})),
    st.tuples(st.just("read_file"), st.sampled_from([{}, {"path": ""}, {"path": "a.txt", "extra": 1}, {"path": 3}])),
), min_size=1, max_size=12)


def _prepare(d: Daemon) -> str:
    sid = d.open()
    d.call(sid, "write_file", path="a.txt", content="alpha\n")
    d.call(sid, "write_file", path="d/c.txt", content="gamma\n")
    d.call(sid, "write_file", path="big.bin", content="x" * (NOW_BYTES + 1))
    d.call(sid, "shell", command=f"mkdir many && cd many && for i in $(seq 0 {NOW_ENTRIES}); do : > f$i; done")
    return sid


def _send(d: Daemon, peer: Peer, request: p.Request, now: bool) -> tuple[p.Response, bool]:
    """The reply, and whether it was answered at once."""
    wire = p.decode_request(p.encode(request))
    if now and (reply := d.service.answer_now(wire, peer)) is not None:
        return reply, True
    return d.service.handle(wire, peer), False


def _comparable(reply: p.Response) -> Any:
    """A reply without what differs between any two runs of one call: its id and its duration."""
    if isinstance(reply, p.CallResponse):
        return {**msgspec.to_builtins(reply.result), "call_id": None, "duration_ms": None}
    assert isinstance(reply, p.ErrorResponse), reply
    return reply.code, reply.message


def _records(d: Daemon, sid: str) -> list[tuple[Any, ...]]:
    rows = d.db.rows("SELECT seq, tool, args, effect, status, result, finished_at, created_at FROM calls "
                     "WHERE session_id = ? ORDER BY seq", [sid])
    out = []
    for row in rows:
        result = json.loads(row["result"]) if row["result"] else None
        for part in (result, (result or {}).get("details")):
            if isinstance(part, dict):
                part.pop("call_id", None)
                part.pop("duration_ms", None)
        ended = row["finished_at"] is not None and row["finished_at"] >= row["created_at"]
        out.append((row["seq"], row["tool"], row["args"], row["effect"], row["status"], json.dumps(result), ended))
    return out


@FAST
@given(calls=CALLS)
def test_a_call_answered_at_once_is_the_call_a_worker_answers_and_recorded_alike(calls: list[tuple[str, Any]]
                                                                                ) -> None:
    with daemon() as now, daemon() as worker:
        sids = _prepare(now), _prepare(worker)
        answered = []
        # The last is a small read every sequence ends with, so each one takes the path at least once.
        for tool, args in [*calls, ("read_file", {"path": "a.txt"})]:
            (at_once, was_now), (by_worker, _) = (
                _send(d, LOCAL_PEER, p.CallRequest(request_id="r", session_id=sid, tool=tool, args=args), now=first)
                for d, sid, first in ((now, sids[0], True), (worker, sids[1], False)))
            assert _comparable(at_once) == _comparable(by_worker), (tool, args)
            answered.append(was_now)
        assert answered[-1]
        assert _records(now, sids[0]) == _records(worker, sids[1])


def test_small_reads_are_answered_at_once_and_the_rest_left_to_a_worker() -> None:
    with daemon() as d:
        sid = _prepare(d)
        before = len(_records(d, sid))

        def now(tool: str, **args: Any) -> p.Response | None:
            return d.service.answer_now(p.CallRequest(request_id="r", session_id=sid, tool=tool, args=args), LOCAL_PEER)

        answered = now("read_file", path="a.txt")
        assert isinstance(answered, p.CallResponse) and answered.result.stdout == "alpha\n"
        listed = now("list_dir")
        assert isinstance(listed, p.CallResponse) and "a.txt" in listed.result.stdout
        assert [r[4] for r in _records(d, sid)[before:]] == ["done", "done"]  # each recorded once, as done
        declined = [now("read_file", path="big.bin"), now("list_dir", path="many"), now("read_file", path="nope"),
                    now("read_file", path="../out"), now("read_file"), now("shell", command="echo hi"),
                    now("write_file", path="a.txt", content="x"), now("list_dir", recursive=True),
                    d.service.answer_now(p.CallRequest(request_id="r", session_id=sid, tool="read_file",
                                                       args={"path": "a.txt"}, stream=True), LOCAL_PEER),
                    d.service.answer_now(p.CallRequest(request_id="r", session_id="s-none", tool="read_file",
                                                       args={"path": "a.txt"}), LOCAL_PEER),
                    d.service.answer_now(p.HealthRequest(request_id="h"), LOCAL_PEER)]
        assert declined == [None] * len(declined)
        assert len(_records(d, sid)) == before + 2  # a declined call did nothing


@pytest.mark.parametrize("holder", ["session", "writer"])
def test_a_call_that_would_wait_for_a_lock_is_declined_with_nothing_done(holder: str) -> None:
    with daemon() as d:
        sid = _prepare(d)
        before = _records(d, sid)
        lock = d.service.sessions.lock(sid) if holder == "session" else d.db.lock
        taken, release = threading.Event(), threading.Event()

        def hold() -> None:
            with lock:
                taken.set()
                release.wait(10)

        thread = threading.Thread(target=hold)
        thread.start()
        try:
            assert taken.wait(10)
            request = p.CallRequest(request_id="r", session_id=sid, tool="read_file", args={"path": "a.txt"})
            assert d.service.answer_now(request, LOCAL_PEER) is None
            assert _records(d, sid) == before
        finally:
            release.set()
            thread.join(10)
        assert d.service.answer_now(request, LOCAL_PEER) is not None  # free again: answered


def test_a_closed_session_or_another_owners_is_not_answered_at_once_nor_read() -> None:
    with daemon() as d:
        sid = _prepare(d)
        request = p.CallRequest(request_id="r", session_id=sid, tool="read_file", args={"path": "a.txt"})
        stranger = Peer("x" * 40, operator=False)
        reads: list[str] = []
        read_now = d.service.sessions.sandbox.read_now
        d.service.sessions.sandbox.read_now = lambda *a: reads.append(a[0]) or read_now(*a)  # type: ignore[method-assign]
        before = _records(d, sid)
        assert d.service.answer_now(request, stranger) is None
        refused = d.service.handle(request, stranger)
        assert isinstance(refused, p.ErrorResponse) and refused.code == "unauthorized", refused
        assert (reads, _records(d, sid)) == ([], before)
        assert d.service.answer_now(request, Peer("y" * 40, operator=True)) is not None  # an operator's is
        assert reads == [sid]
        d.ask(p.CloseSessionRequest, session_id=sid)
        assert d.service.answer_now(request, LOCAL_PEER) is None


def test_a_failure_before_the_answer_leaves_the_call_to_a_worker_with_nothing_done() -> None:
    with daemon() as d:
        sid = _prepare(d)
        before = _records(d, sid)
        request = p.CallRequest(request_id="r", session_id=sid, tool="read_file", args={"path": "a.txt"})

        def broken(*args: Any) -> None:
            raise OSError(24, "Too many open files")

        real = d.service.sessions.sandbox.read_now
        d.service.sessions.sandbox.read_now = broken  # type: ignore[method-assign]
        assert d.service.answer_now(request, LOCAL_PEER) is None
        assert _records(d, sid) == before
        assert not d.service.sessions.lock(sid).locked() and d.db.lock.acquire(blocking=False)
        d.db.lock.release()
        d.service.sessions.sandbox.read_now = real  # type: ignore[method-assign]
        served = d.service.handle(request, LOCAL_PEER)
        assert isinstance(served, p.CallResponse) and served.result.stdout == "alpha\n"


def test_the_time_of_a_call_answered_at_once_includes_its_read() -> None:
    with daemon() as d:
        sid = _prepare(d)
        real = d.service.sessions.sandbox.read_now

        def slow(*args: Any) -> Any:
            time.sleep(0.05)
            return real(*args)

        d.service.sessions.sandbox.read_now = slow  # type: ignore[method-assign]
        reply = d.service.answer_now(
            p.CallRequest(request_id="r", session_id=sid, tool="read_file", args={"path": "a.txt"}), LOCAL_PEER)
        assert isinstance(reply, p.CallResponse) and reply.result.duration_ms >= 50
        recorded = d.db.rows("SELECT result FROM calls WHERE session_id = ? AND call_id = ?",
                             [sid, reply.result.call_id])
        assert json.loads(recorded[0]["result"])["duration_ms"] >= 50


def test_what_a_request_waiting_for_a_worker_holds_back() -> None:
    """A request of a session holds back that session's reads; one that names a session only through a
    revocation or a call (a commit restores the workspace) holds back every session's; the rest none."""
    from sandboxd.server import _ANY_SESSION, _queue_key

    assert _queue_key(p.CallRequest(request_id="r", session_id="s-1", tool="shell", args={})) == "s-1"
    commit = p.CommitRevocationRequest(request_id="r", revocation_id="v", tokens=p.TokenCounts(),
                                       transitions_replayed=0, final_step=0)
    for request in (commit,
                    p.BeginRevocationRequest(request_id="r", revocation_id="v"),
                    p.CancelRevocationRequest(request_id="r", revocation_id="v"),
                    p.ReleaseCallRequest(request_id="r", call_id="c"), p.DropCallRequest(request_id="r", call_id="c")):
        assert _queue_key(request) == _ANY_SESSION, request
    for request in (p.HealthRequest(request_id="r"), p.OpenSessionRequest(request_id="r"),
                    p.ListSessionsRequest(request_id="r")):
        assert _queue_key(request) is None, request
