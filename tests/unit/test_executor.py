"""The in-container executor's logic, run on the host against a temporary workspace."""

from __future__ import annotations

import contextvars
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.sandbox import executor


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    ws = tmp_path / "ws"
    ws.mkdir()
    token = executor._workspace.set(str(ws))
    yield ws
    executor._workspace.reset(token)


def run(command: str, timeout: float = 5.0, cap: int = 1024) -> dict[str, object]:
    return executor.run_process({"argv": ["/bin/sh", "-c", command], "timeout": timeout, "output_bytes": cap})


def test_confine_follows_symlinks(workspace: Path) -> None:
    (workspace / "d").mkdir()
    (workspace / "out").symlink_to("/etc")
    (workspace / "in").symlink_to(workspace / "d")
    assert executor.confine("in") == str(workspace / "d")
    assert executor.confine(str(workspace / "d")) == str(workspace / "d")
    for bad in ("out/passwd", "../x", "/etc/passwd", "d/../../x"):
        with pytest.raises(executor.ToolFailure) as err:
            executor.confine(bad)
        assert err.value.code == "path_escape"


def test_run_captures_exit_code_and_streams(workspace: Path) -> None:
    reply = run("echo out; echo err >&2; pwd; exit 4")
    assert reply["exit_code"] == 4
    assert reply["stdout"] == f"out\n{workspace}\n"
    assert reply["stderr"] == "err\n"
    assert reply["timed_out"] is False


def test_output_is_capped_per_stream(workspace: Path) -> None:
    reply = run("head -c 5000 /dev/zero | tr '\\0' a; head -c 10 /dev/zero | tr '\\0' b >&2", cap=1024)
    assert reply["stdout"] == "a" * 1024 and reply["stdout_truncated"] is True
    assert reply["stderr"] == "b" * 10 and reply["stderr_truncated"] is False


def test_timeout_kills_the_process_group(workspace: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    started = time.monotonic()
    reply = run(f"sleep 60 & echo $! > {pidfile}; echo begun; wait", timeout=0.5)
    assert reply["timed_out"] is True
    assert reply["stdout"] == "begun\n"
    assert time.monotonic() - started < 5
    child = int(pidfile.read_text())
    time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_a_backgrounded_grandchild_does_not_hold_the_call(workspace: Path) -> None:
    started = time.monotonic()
    reply = run("(sleep 30 &) ; echo done", timeout=20)
    assert reply["stdout"] == "done\n" and reply["timed_out"] is False
    assert time.monotonic() - started < 3


def test_file_operations(workspace: Path) -> None:
    executor.write_file({"path": "a/b.txt", "content": "hi\n"})
    executor.write_file({"path": "a/b.txt", "content": "more\n", "append": True})
    assert executor.read_file({"path": "a/b.txt", "max_bytes": 100})["stdout"] == "hi\nmore\n"
    capped = executor.read_file({"path": "a/b.txt", "max_bytes": 2})
    assert capped["stdout"] == "hi" and capped["stdout_truncated"] is True
    rows = [json.loads(r) for r in executor.list_dir({"path": ".", "recursive": True})["stdout"].splitlines()]
    assert [(r["path"], r["type"], r["size"]) for r in rows] == [("a", "dir", rows[0]["size"]), ("a/b.txt", "file", 8)]
    with pytest.raises(executor.ToolFailure) as err:
        executor.read_file({"path": "nope", "max_bytes": 10})
    assert err.value.code == "not_found"
    (workspace / "link").symlink_to("/etc/hostname")
    with pytest.raises(executor.ToolFailure) as err:
        executor.write_file({"path": "link", "content": "x"})
    assert err.value.code == "path_escape"


def test_reap_refuses_to_run_as_root() -> None:
    if os.getuid() != 0:
        pytest.skip("only meaningful as root")
    reply = executor.handle(json.dumps({"op": "reap"}).encode())
    assert reply["error"] == "tool_error"


def test_bad_requests_become_error_replies(workspace: Path) -> None:
    assert executor.handle(b"not json")["error"] == "tool_error"
    assert executor.handle(json.dumps({"op": "format_disk"}).encode())["error"] == "invalid_arguments"
    assert executor.handle(json.dumps({"op": "read_file"}).encode())["error"] == "tool_error"


def test_socket_server_round_trip(workspace: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "exec.sock")
    # The server thread serves the fixture's workspace: it runs in a copy of this thread's context.
    threading.Thread(target=contextvars.copy_context().run, args=(executor.serve, path), daemon=True).start()
    deadline = time.monotonic() + 5
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    from sandboxd.sandbox.channel import ExecutorChannel

    chan = ExecutorChannel(Path(path))
    chan.wait_ready(timeout=5)
    reply = chan.request({"op": "run", "argv": ["/bin/echo", "via socket"], "timeout": 5, "output_bytes": 100},
                         timeout=5)
    assert reply["stdout"] == "via socket\n"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    chan.close()
