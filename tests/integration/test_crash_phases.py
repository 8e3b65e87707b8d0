"""`kill -9` of the daemon in each phase of its work, then a restart on the same state.

What must hold afterwards: a call cut off mid-run is `call_interrupted` on retry and its session keeps
working; every acknowledged snapshot restores to its exact tree and no half-taken one is listed; a
restore cut off leaves the workspace either as it was or as the snapshot, never a mix; and no
container or overlay mount outlives the sessions that owned it. Kill moments are drawn from a seeded
`random.Random`, so a failing run can be repeated.

Why one module of this size: one crash point per test over the same daemon fixtures; the points are
read together to see that every phase of an operation is covered.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import docker
from sandboxd import protocol as p
from sandboxd.client import Client, RemoteError
from sandboxd.sandbox.containers import LABEL_INSTANCE
from tests.integration.conftest import DaemonProcess, both_runtimes, tree_listing_code

pytestmark = pytest.mark.docker

SEED = 7321
Tree = list[list[Any]]


class Wire:
    """A raw DEALER to one daemon incarnation: send a request, then wait for its reply or the daemon's death."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(daemon.endpoint)

    def send(self, message: Any) -> None:
        self.sock.send(p.encode(message))

    def reply(self, timeout_s: float = 60.0) -> Any | None:
        """The reply, or None if the daemon died first."""
        assert self.daemon.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(20):
                return p.decode_response(self.sock.recv())
            if self.daemon.proc.poll() is not None:
                return p.decode_response(self.sock.recv()) if self.sock.poll(0) else None
        raise AssertionError(f"daemon alive but silent for {timeout_s} s")

    def ask(self, message: Any) -> Any | None:
        self.send(message)
        reply = self.reply()
        assert not isinstance(reply, p.ErrorResponse), (message, reply)
        return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def rid() -> str:
    return uuid.uuid4().hex


def tree_request(sid: str) -> p.CallRequest:
    return p.CallRequest(request_id=rid(), session_id=sid, tool="python", args={"code": tree_listing_code()})


def tree(client: Client, sid: str) -> Tree:
    return json.loads(client.call(sid, "python", {"code": tree_listing_code()}).stdout)  # type: ignore[no-any-return]


def kill_after(daemon: DaemonProcess, delay: float) -> threading.Thread:
    """SIGKILL the daemon `delay` seconds from now, from another thread."""
    assert daemon.proc is not None
    pid = daemon.proc.pid

    def fire() -> None:
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    thread = threading.Thread(target=fire)
    thread.start()
    return thread


def restart_after_kill(daemon: DaemonProcess, killer: threading.Thread | None = None) -> Client:
    if killer is not None:
        killer.join()
    daemon.kill()  # reaps the killed process (or kills it now) and closes its clients
    daemon.start()
    return daemon.client()


def containers_of(engine: docker.DockerClient, daemon: DaemonProcess) -> list[Any]:
    return list(engine.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={daemon.instance}"}))


def overlay_mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        rows = [line.split() for line in fh]
    return [r[4] for r in rows if r[4].startswith(str(root)) and r[r.index("-") + 1] == "overlay"]


@pytest.fixture
def leftover_guard(engine: docker.DockerClient) -> Iterator[list[DaemonProcess]]:
    """Set up before `daemon_factory`, so this teardown runs after it: nothing of these daemons remains."""
    daemons: list[DaemonProcess] = []
    yield daemons
    for daemon in daemons:
        assert containers_of(engine, daemon) == []
        assert overlay_mounts_under(daemon.state_dir) == []


@pytest.fixture
def crashable(leftover_guard: list[DaemonProcess],
              daemon_factory: Callable[..., DaemonProcess]) -> Iterator[DaemonProcess]:
    daemon = daemon_factory()
    leftover_guard.append(daemon)
    yield daemon
    # Closing every session after the crashes must leave no overlay mount behind, before any forced clean-up.
    client = daemon.client()
    for session in client.sessions():
        client.close_session(session.session_id)
    assert overlay_mounts_under(daemon.state_dir) == []


# (a) a long call -------------------------------------------------------------------------------


@both_runtimes
def test_kill_during_a_long_call(crashable: DaemonProcess, engine: docker.DockerClient) -> None:
    daemon = crashable
    client = daemon.client()
    sid = client.open_session().session_id
    other = client.open_session().session_id
    client.call(sid, "write_file", {"path": "before.txt", "content": "kept"})
    wire = Wire(daemon)
    args = {"command": "echo started > started.txt; sleep 300", "timeout_s": 600}
    wire.send(p.CallRequest(request_id=rid(), session_id=sid, tool="shell", args=args, call_id="long-1"))
    started = daemon.state_dir / "snapshots" / "mounts" / sid / "ws" / "started.txt"
    deadline = time.monotonic() + 30
    while not started.exists():  # the workspace is mounted on the host too: the call is running
        assert time.monotonic() < deadline, "the long call never started"
        time.sleep(0.02)
    daemon.kill()
    wire.close()
    assert wire.daemon.proc is not None and wire.daemon.proc.returncode == -signal.SIGKILL

    daemon.start()
    client = daemon.client()
    with pytest.raises(RemoteError) as err:
        client.call(sid, "shell", args, call_id="long-1")
    assert err.value.wire_code == "call_interrupted"
    # The session works, promptly: the cut-off call's process does not hold its executor.
    began = time.monotonic()
    result = client.call(sid, "shell", {"command": "cat before.txt started.txt", "timeout_s": 20})
    assert (result.exit_code, result.stdout) == (0, "keptstarted\n")
    assert time.monotonic() - began < 15
    assert client.call(sid, "shell", {"command": "echo again"}, call_id="long-2").stdout == "again\n"
    procs = client.call(sid, "shell", {"command": "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"}).stdout
    assert "sleep 300" not in procs
    assert client.call(other, "shell", {"command": "echo fine"}).stdout == "fine\n"
    # No orphaned container: exactly one per open session.
    open_sessions = {s.session_id for s in client.sessions()}
    assert open_sessions == {sid, other}
    labelled = containers_of(engine, daemon)
    assert sorted(c.labels["sandboxd.session"] for c in labelled) == sorted(open_sessions)
    assert all(c.status == "running" for c in labelled)


@pytest.mark.parametrize("seed", [SEED, SEED + 1])
def test_every_answered_call_survives_a_kill_right_after_its_answer(crashable: DaemonProcess, seed: int) -> None:
    """A call's records are committed to the WAL without waiting for an fsync (group commit, sandboxd.db):
    a `kill -9` the moment after an answer, long before any fsync could follow, loses none of them."""
    rng = random.Random(seed)
    daemon = crashable
    sid = daemon.client().open_session().session_id
    wire = Wire(daemon)
    answered: dict[str, str] = {}
    tools = [("shell", lambda i: {"command": f"echo {i}"}),
             ("write_file", lambda i: {"path": f"f{i % 3}.txt", "content": f"{i}\n"}),
             ("read_file", lambda i: {"path": "before.txt"})]
    wire.ask(p.CallRequest(request_id=rid(), session_id=sid, tool="write_file",
                           args={"path": "before.txt", "content": "kept"}))
    calls = []
    for i in range(rng.randint(3, 12)):
        tool, args = rng.choice(tools)
        calls.append((f"c{seed}-{i}", tool, args(i)))
    for call_id, tool, args in calls:
        reply = wire.ask(p.CallRequest(request_id=rid(), session_id=sid, tool=tool, args=args, call_id=call_id))
        answered[call_id] = reply.result.stdout
    daemon.kill()  # straight after the last answer: no flusher has run for it yet
    wire.close()

    client = restart_after_kill(daemon)
    for call_id, tool, args in calls:
        again = client.call(sid, tool, args, call_id=call_id)
        assert again.replayed, f"{call_id} ran a second time: its record was lost"
        assert again.stdout == answered[call_id]
    assert {c.call_id for c in client.calls(sid)} >= set(answered)


# (b) snapshots -------------------------------------------------------------------------------------


def test_kill_while_taking_snapshots(crashable: DaemonProcess) -> None:
    daemon = crashable
    rng = random.Random(SEED)
    client = daemon.client()
    sid = client.open_session().session_id
    acked: dict[str, Tree] = {}
    kills = cut_snapshots = taken_unacknowledged = 0
    rounds = 10
    for round_no in range(rounds):
        wire = Wire(daemon)
        # Odd rounds kill at a random moment of the loop; even ones aim just after a snapshot request left.
        aim = rng.randint(0, 4) if round_no % 2 == 0 else None
        killer = kill_after(daemon, rng.uniform(0.05, 0.6)) if aim is None else None
        in_flight: Tree | None = None
        step = 0
        while True:
            content = f"{round_no}-{step}-" + "x" * rng.randint(0, 5000)
            wire.send(p.CallRequest(request_id=rid(), session_id=sid, tool="write_file",
                                    args={"path": f"r{round_no}/f{step % 3}.txt", "content": content}))
            if wire.reply() is None:
                break
            wire.send(tree_request(sid))
            listing = wire.reply()
            if listing is None:
                break
            current = json.loads(listing.result.stdout)
            wire.send(p.SnapshotRequest(request_id=rid(), session_id=sid, label=f"{round_no}-{step}"))
            if step == aim:
                # Within a snapshot's few milliseconds (faster snapshots need a tighter aim to be cut off).
                killer = kill_after(daemon, rng.uniform(0.0, 0.002))
            taken = wire.reply()
            if taken is None:
                in_flight = current
                break
            acked[taken.snapshot.snapshot_id] = current
            step += 1
        wire.close()
        client = restart_after_kill(daemon, killer)
        kills += 1
        listed = [s.snapshot_id for s in client.snapshots(sid)]
        assert set(acked) <= set(listed), "an acknowledged snapshot was lost"
        unacked = set(listed) - set(acked)
        # Only the one in flight may have been taken without its reply getting out; never a half one.
        assert len(unacked) <= (1 if in_flight is not None else 0), (unacked, in_flight is not None)
        for snapshot_id in unacked:
            assert in_flight is not None
            acked[snapshot_id] = in_flight
        cut_snapshots += in_flight is not None
        taken_unacknowledged += len(unacked)
    print(f"{len(acked)} snapshots; {cut_snapshots} of {kills} kills cut a snapshot off, "
          f"{taken_unacknowledged} of those had been taken before the kill")
    assert kills == rounds and len(acked) >= rounds and cut_snapshots >= 3
    for snapshot_id, expected in sorted(acked.items(), key=lambda kv: rng.random()):
        client.restore(sid, snapshot_id)
        assert tree(client, sid) == expected, snapshot_id
    # And the session goes on taking and restoring snapshots.
    client.call(sid, "write_file", {"path": "after.txt", "content": "after"})
    final = client.snapshot(sid)
    expected_final = tree(client, sid)
    client.call(sid, "shell", {"command": "rm -rf ./*"})
    client.restore(sid, final.snapshot_id)
    assert tree(client, sid) == expected_final


# (c) a restore ---------------------------------------------------------------------------------


def test_kill_during_a_restore(crashable: DaemonProcess) -> None:
    daemon = crashable
    rng = random.Random(SEED + 1)
    client = daemon.client()
    sid = client.open_session().session_id
    snaps: dict[str, Tree] = {}
    for name in ("one", "two"):
        client.call(sid, "shell", {"command": f"mkdir -p {name} && for i in $(seq 50); do echo {name}$i > "
                                              f"{name}/f$i; done; echo {name} > which.txt"})
        snaps[client.snapshot(sid, label=name).snapshot_id] = tree(client, sid)
    outcomes = {"before": 0, "snapshot": 0}
    for round_no in range(12):
        # Changes since the last snapshot or restore live only in the upper layer: the part a restore drops.
        client.call(sid, "shell", {"command": f"echo pre{round_no} > which.txt; mkdir -p pre && "
                                              f"for i in $(seq 200); do echo $i > pre/p$i; done"})
        before = tree(client, sid)
        target = sorted(snaps)[round_no % 2]
        wire = Wire(daemon)
        wire.send(p.RestoreRequest(request_id=rid(), session_id=sid, snapshot_id=target))
        killer = kill_after(daemon, rng.uniform(0.0, 0.02))
        reply = wire.reply()
        wire.close()
        client = restart_after_kill(daemon, killer)
        after = tree(client, sid)
        if isinstance(reply, p.RestoreResponse):
            assert after == snaps[target], "an acknowledged restore did not survive the restart"
        assert after in (before, snaps[target]), f"round {round_no}: the workspace is a mix"
        outcomes["before" if after == before else "snapshot"] += 1
        # Snapshots and restores keep working after the crash.
        probe = client.snapshot(sid, label=f"probe-{round_no}")
        client.call(sid, "write_file", {"path": "which.txt", "content": "scratch"})
        client.restore(sid, probe.snapshot_id)
        assert tree(client, sid) == after
        client.delete_snapshot(sid, probe.snapshot_id)
    print(f"restore cut off: workspace as before {outcomes['before']}x, as the snapshot {outcomes['snapshot']}x")
    for snapshot_id, expected in snaps.items():
        client.restore(sid, snapshot_id)
        assert tree(client, sid) == expected


# (d) nothing left behind ------------------------------------------------------------------------


@both_runtimes
def test_nothing_outlives_the_sessions(leftover_guard: list[DaemonProcess],
                                       daemon_factory: Callable[..., DaemonProcess],
                                       engine: docker.DockerClient) -> None:
    daemon = daemon_factory()
    leftover_guard.append(daemon)
    client = daemon.client()
    sessions = [client.open_session().session_id for _ in range(3)]
    for sid in sessions:
        client.call(sid, "write_file", {"path": "f", "content": sid})
        client.snapshot(sid)
    assert len(containers_of(engine, daemon)) == 3
    # A crash with everything live, then a close of every session on the restarted daemon.
    wire = Wire(daemon)
    wire.send(p.SnapshotRequest(request_id=rid(), session_id=sessions[0]))
    client = restart_after_kill(daemon, kill_after(daemon, 0.01))
    wire.close()
    for sid in sessions:
        client.close_session(sid)
    assert containers_of(engine, daemon) == []
    # A polite stop (SIGTERM), not the fixture's forced clean-up, must leave no overlay mount behind.
    daemon.kill(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.returncode == 0
    assert overlay_mounts_under(daemon.state_dir) == []
    workspaces = daemon.state_dir / "snapshots" / "layers"
    assert not workspaces.exists() or list(workspaces.iterdir()) == []


# (c') every crash point of a restore, deterministically ----------------------------------------


class Crash(Exception):
    """Stands for kill -9 at one point of the store's work."""


def host_tree(root: Path) -> list[tuple[str, str, str]]:
    rows = []
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            full = Path(base) / name
            rows.append((str(full.relative_to(root)), oct(full.lstat().st_mode),
                         full.read_text() if full.is_file() else ""))
    return sorted(rows)


class CrashAt:
    """Counts the wrapped steps of one store operation and raises `Crash` at step `point`."""

    def __init__(self, point: int) -> None:
        self.point = point
        self.steps = 0

    def tick(self, where: str) -> None:
        self.steps += 1
        if self.steps == self.point:
            raise Crash(where)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.tick(f"before {fn.__name__}")
            result = fn(*args, **kwargs)
            self.tick(f"after {fn.__name__}")
            return result
        return wrapped


class OsWithRename:
    """The `os` module, but with `rename` replaced (patched into the store's module only)."""

    def __init__(self, rename: Callable[..., Any]) -> None:
        self.rename = rename

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def test_every_crash_point_of_an_overlay_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill between any two steps of a restore recovers to the tree before it or the snapshot's."""
    from snapshots import overlay

    outcomes: list[str] = []
    point = 1
    while True:
        store = overlay.OverlaySnapshotStore(tmp_path / f"p{point}")
        ws = store.create("w", (1000, 1000)) / "ws"
        crash = CrashAt(point)
        try:
            (ws / "a").write_text("A")
            snapshot = host_tree(ws)
            store.take("w", "s1")
            (ws / "b").write_text("B")
            store.take("w", "s2")  # the live stack is now s2's, not the restore target's
            (ws / "a").write_text("changed since s2")
            (ws / "c").mkdir()
            before = host_tree(ws)
            with monkeypatch.context() as patch:
                patch.setattr(overlay, "write_json_atomic", crash.wrap(overlay.write_json_atomic))
                patch.setattr(overlay, "os", OsWithRename(crash.wrap(os.rename)))
                patch.setattr(store, "_fresh_upper", crash.wrap(store._fresh_upper))
                patch.setattr(store, "_mount_stack", crash.wrap(store._mount_stack))
                try:
                    store.restore("w", "s1")
                    finished = True
                except Crash:
                    finished = False
            if not finished:
                store.recover("w")  # what the restarted daemon does first
            after = host_tree(ws)
            assert after in (before, snapshot), f"crash at step {point} of the restore: {after}"
            outcomes.append("before" if after == before else "snapshot")
            # The workspace goes on: later restores work whatever the crash left.
            store.restore("w", "s2")
            assert [(r[0], r[2]) for r in host_tree(ws)] == [("a", "A"), ("b", "B")]
        finally:
            store.destroy("w")
            store.release()
        if finished:
            break
        point += 1
    assert point > 8, point  # a crash before and after each of the wrapped steps was tried
    assert "before" in outcomes and outcomes[-1] == "snapshot", outcomes
