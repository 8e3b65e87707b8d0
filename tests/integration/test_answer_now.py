"""Small reads answered on a real daemon's socket thread (`Handler.answer_now`), under runc: which ones are, that
calls of one session keep their order and another session's read is not held up, and that what was answered
so survives `kill -9`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxd.client import RemoteError
from sandboxd.launcher import DaemonProcess
from tests.integration.test_metrics import metered, scrape, value

__all__ = ["metered"]  # the fixture, used by name

NOW = "sandboxd_calls_answered_now_total"


def test_small_reads_are_answered_at_once_and_the_rest_by_workers(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    client = daemon.client()
    sid = client.open_session().session_id
    client.call(sid, "write_file", {"path": "a.txt", "content": "alpha\n"})
    client.call(sid, "shell", {"command": "head -c 300000 /dev/zero | tr '\\0' x > big.txt; ln -s /etc/passwd out"})
    before = value(scrape(port), NOW)
    for _ in range(5):
        assert client.call(sid, "read_file", {"path": "a.txt"}).stdout == "alpha\n"
    for _ in range(3):
        assert "a.txt" in client.call(sid, "list_dir", {"path": "."}).stdout
    assert value(scrape(port), NOW) - before == 8
    # Each of these goes to a worker: too large, missing, only the executor can resolve it, not a read.
    assert client.call(sid, "read_file", {"path": "big.txt"}).stdout_size == 300000
    for path in ("missing.txt", "out"):
        with pytest.raises(RemoteError):
            client.call(sid, "read_file", {"path": path})
    assert client.call(sid, "shell", {"command": "echo hi"}).stdout == "hi\n"
    assert client.call(sid, "list_dir", {"path": ".", "recursive": True}).exit_code == 0
    assert value(scrape(port), NOW) - before == 8
    statuses = [(c.tool, c.state) for c in client.calls(sid)][-13:]
    assert statuses == [("read_file", "done")] * 5 + [("list_dir", "done")] * 3 + [
        ("read_file", "done"), ("read_file", "error"), ("read_file", "error"), ("shell", "done"),
        ("list_dir", "done")]


def test_a_read_keeps_its_place_behind_its_sessions_call_and_another_sessions_read_does_not_wait(
        daemon: DaemonProcess) -> None:
    first, second = daemon.client(), daemon.client()
    busy, idle = first.open_session().session_id, first.open_session().session_id
    second.call(idle, "write_file", {"path": "x.txt", "content": "x\n"})
    finished: dict[str, float] = {}

    def slow() -> None:
        first.call(busy, "shell", {"command": "sleep 2; echo late > f.txt"})
        finished["shell"] = time.monotonic()

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)  # the shell is running: its session's lock is held
    assert second.call(idle, "read_file", {"path": "x.txt"}).stdout == "x\n"
    finished["other session's read"] = time.monotonic()
    # Sent while the shell runs, answered after it: the file it writes at its end is there.
    assert second.call(busy, "read_file", {"path": "f.txt"}).stdout == "late\n"
    finished["same session's read"] = time.monotonic()
    thread.join(30)
    # The shell's end and the same session's read are told apart by what the read saw (the file the shell
    # wrote last), not by the clock: their replies come back a moment apart, to two threads in any order.
    assert finished["other session's read"] < finished["shell"]


def test_a_read_answered_at_once_survives_kill_9(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    client = daemon.client()
    sid = client.open_session().session_id
    client.call(sid, "write_file", {"path": "a.txt", "content": "alpha\n"})
    client.call(sid, "read_file", {"path": "a.txt"})  # the workspace and the executor's channel are known now
    before = value(scrape(port), NOW)
    first = client.call(sid, "read_file", {"path": "a.txt"}, call_id="read-now")
    assert value(scrape(port), NOW) - before == 1
    daemon.restart()  # SIGKILL, then a new process on the same state
    client = daemon.client()
    again = client.call(sid, "read_file", {"path": "a.txt"}, call_id="read-now")
    assert (again.replayed, again.stdout, again.call_id) == (True, first.stdout, "read-now")
    assert [(c.call_id, c.state) for c in client.calls(sid) if c.call_id == "read-now"] == [("read-now", "done")]


def test_a_read_never_overtakes_a_call_of_its_session_still_waiting_for_a_worker(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """One worker, busy with a shell of one session: a write to another session waits in the queue, and a
    read of that file sent after it is answered after it, though its session's lock is free all along."""
    config = tmp_path / "sandboxd.toml"
    config.write_text("workers = 1\n")
    daemon = daemon_factory(["--config", str(config)])
    clients = [daemon.client() for _ in range(3)]
    busy, other = clients[0].open_session().session_id, clients[0].open_session().session_id
    clients[1].call(other, "write_file", {"path": "f.txt", "content": "old\n"})
    assert clients[1].call(other, "read_file", {"path": "f.txt"}).stdout == "old\n"
    threads = [threading.Thread(target=clients[0].call, args=(busy, "shell", {"command": "sleep 1.5"})),
               threading.Thread(target=clients[1].call, args=(other, "write_file",
                                                              {"path": "f.txt", "content": "new\n"}))]
    for thread in threads:
        thread.start()
        time.sleep(0.4)  # the shell has the worker; then the write is queued behind it
    assert clients[2].call(other, "read_file", {"path": "f.txt"}).stdout == "new\n"
    for thread in threads:
        thread.join(30)
