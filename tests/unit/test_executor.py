"""The in-container executor's logic, run on the host against a temporary workspace."""

from __future__ import annotations

import base64
import contextvars
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000), st.integers(min_value=1, max_value=2048))
def test_read_file_never_mangles_and_always_tells_the_size(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                                          cap: int) -> None:
    ws = tmp_path_factory.mktemp("ws")
    (ws / "f").write_bytes(data)
    token = executor._workspace.set(str(ws))
    try:
        reply = executor.read_file({"path": "f", "max_bytes": cap})
        chunk = executor.read_bytes({"path": "f", "offset": 0, "length": len(data) + 1})
    finally:
        executor._workspace.reset(token)
    assert reply["stdout_size"] == len(data) and chunk["size"] == len(data)
    assert base64.b64decode(chunk["data"]) == data
    if reply["exit_code"] == 0:  # text: exactly a prefix of the file, cut only at the cap
        shown = str(reply["stdout"]).encode()
        assert data.startswith(shown) and "\ufffd" not in str(reply["stdout"])
        assert reply["stdout_truncated"] == (len(data) > cap) and len(data) - len(shown) <= max(len(data) - cap, 0) + 3
    else:  # not text: said so, nothing shown
        assert reply["stdout"] == "" and "binary file" in str(reply["stderr"])
        assert b"\x00" in data[:cap] or not _utf8_prefix(data[:cap], cut=len(data) > cap)


def _utf8_prefix(data: bytes, cut: bool) -> bool:
    """Whether `data` is UTF-8, apart from one character left incomplete at its end when the read was cut."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as exc:
        return cut and exc.reason == "unexpected end of data"


def test_write_bytes_round_trips_and_stays_confined(workspace: Path) -> None:
    data = bytes(range(256))
    assert executor.write_bytes({"path": "d/x.bin", "data": base64.b64encode(data).decode()})["size"] == 256
    assert executor.write_bytes({"path": "d/x.bin", "data": base64.b64encode(b"!").decode(), "append": True}) \
        == {"size": 257}
    assert (workspace / "d" / "x.bin").read_bytes() == data + b"!"
    reply = executor.handle(json.dumps({"op": "write_bytes", "path": "../x", "data": ""}).encode())
    assert reply["error"] == "path_escape"


def test_run_streams_chunks_and_counts_full_sizes(workspace: Path) -> None:
    got: list[tuple[str, str]] = []
    token = executor._emit.set(lambda stream, text: got.append((stream, text)))
    try:
        reply = executor.run_process({"argv": ["/bin/sh", "-c", "head -c 3000 /dev/zero | tr '\\0' a; echo e >&2"],
                                      "timeout": 5, "output_bytes": 100, "stream": True})
    finally:
        executor._emit.reset(token)
    assert reply["stdout_size"] == 3000 and reply["stdout_truncated"] and len(str(reply["stdout"])) == 100
    assert "".join(t for s, t in got if s == "out") == "a" * 3000 and "".join(t for s, t in got if s == "err") == "e\n"


@settings(max_examples=12, deadline=None)
@given(size=st.sampled_from([1, 64 * 1024, 64 * 1024 + 1, 128 * 1024 - 1, 128 * 1024, 128 * 1024 + 1])
       | st.integers(1, 3 * 1024 * 1024),
       stdin=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=50))
def test_a_shell_command_of_any_size_runs_as_one_command(
        tmp_path_factory: pytest.TempPathFactory, size: int, stdin: str) -> None:
    """Linux caps one exec argument at 128 KiB: a longer command goes to the shell as a script file, with the
    same meaning (the same shell, $0, stdin, exit code) and nothing left behind."""
    from sandboxd.tools.builtin import executor_request

    ws = tmp_path_factory.mktemp("ws")
    token = executor._workspace.set(str(ws))
    try:
        # A command of `size` bytes: a comment pads it; what it runs reads stdin and names its shell.
        body = 'printf "%s|%s|" "$0" "$(cat)"; exit 3\n'
        pad = max(0, size - len(body) - 2)
        command = "#" + "x" * pad + "\n" + body
        req = {**executor_request("shell", {"command": command, "stdin": stdin}), "timeout": 20,
               "output_bytes": 4096}
        assert ("script" in req) == (len(command.encode()) > 64 * 1024)
        reply = executor.run_process(req)
    finally:
        executor._workspace.reset(token)
    assert reply["stdout"] == f"/bin/sh|{stdin.rstrip(chr(10))}|" and reply["exit_code"] == 3, reply["stderr"]
    assert list(ws.iterdir()) == []


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
@settings(max_examples=8, deadline=None)
@given(code=st.integers(min_value=0, max_value=255), out=st.text(alphabet="abc xyz", max_size=40),
       shape=st.sampled_from(["plain", "closes-pipes-first", "grandchild-holds-pipes", "stdin"]))
def test_a_call_ends_with_its_tool_whichever_way_the_exit_is_seen(tmp_path_factory: pytest.TempPathFactory,
                                                                   pidfd: bool, code: int, out: str,
                                                                   shape: str) -> None:
    """The tool's exit is a pidfd event where the kernel has pidfds, else polled for: either way a call ends
    when its tool does (not at its timeout), with every byte it wrote and its exit code."""
    ws = tmp_path_factory.mktemp("ws")
    token = executor._workspace.set(str(ws))
    saved = executor._pidfd
    if not pidfd:
        executor._pidfd = lambda _pid: None  # type: ignore[assignment]
    try:
        command = {"plain": f"printf '{out}'; exit {code}",
                   "closes-pipes-first": f"printf '{out}'; exec >&- 2>&-; sleep 0.2; exit {code}",
                   "grandchild-holds-pipes": f"printf '{out}'; (sleep 30 &); exit {code}",
                   "stdin": f"cat; exit {code}"}[shape]
        started = time.monotonic()
        reply = executor.run_process({"argv": ["/bin/sh", "-c", command], "timeout": 20, "output_bytes": 1024,
                                      "stdin": out if shape == "stdin" else ""})
        assert time.monotonic() - started < 10
        assert (reply["exit_code"], reply["stdout"], reply["timed_out"]) == (code, out, False)
    finally:
        executor._pidfd = saved  # type: ignore[assignment]
        executor._workspace.reset(token)


@settings(max_examples=20, deadline=None)
@given(code=st.integers(min_value=0, max_value=255), out=st.text(alphabet="abc xyz\n", max_size=40),
       stdin=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=200),
       shape=st.sampled_from(["plain", "stdin", "cwd", "fds", "sigpipe", "signalled", "env"]))
def test_posix_spawn_starts_a_tool_as_popen_did(tmp_path_factory: pytest.TempPathFactory, code: int, out: str,
                                                 stdin: str, shape: str) -> None:
    """The executor spawns tools with posix_spawn (`_spawn_directly`), the daemon's in-process sandbox with
    Popen: the same command gets the same reply from both, down to its directory, its descriptors (only the
    three), its signal dispositions (SIGPIPE kills again) and its environment."""
    ws = tmp_path_factory.mktemp("ws")
    command = {"plain": f"printf '%s' '{out}'; printf e >&2; exit {code}",
               "stdin": f"cat; exit {code}",
               "cwd": "pwd; cd /; pwd",
               "fds": "ls /proc/self/fd | sort -n | tr '\\n' ' '",
               "sigpipe": "yes | head -c 3; echo \" ${PIPESTATUS:-$?}\"; (yes; echo $? >&2) | true",
               "signalled": "kill -TERM $$",
               "env": "env | sort"}[shape]
    replies = []
    executor.inherit_nothing()  # as the executor does when it starts
    token = executor._workspace.set(str(ws))
    try:
        for direct in (False, True):
            executor._spawn_directly = direct
            home = os.getcwd()
            reply = executor.run_process({"argv": ["/bin/sh", "-c", command], "timeout": 20, "output_bytes": 4096,
                                          "stdin": stdin if shape == "stdin" else ""})
            assert os.getcwd() == home  # the spawn changes directory around itself, and back
            replies.append({k: v for k, v in reply.items() if k != "duration_ms"})
    finally:
        executor._spawn_directly = False
        executor._workspace.reset(token)
    assert replies[0] == replies[1]
    if shape == "stdin":
        assert replies[1]["stdout"] == stdin and replies[1]["exit_code"] == code
    if shape == "fds":
        assert replies[1]["stdout"].split() == ["0", "1", "2", "3"]  # 3: the directory ls reads
    if shape == "sigpipe":
        assert replies[1]["stderr"] == "141\n"  # yes died of SIGPIPE (128 + 13), not of an ignored write error
    if shape == "signalled":
        assert replies[1]["exit_code"] == -15
