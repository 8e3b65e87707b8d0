"""The in-container executor: serves tool calls over a unix socket, one at a time.

Runs inside each sandbox as the sandbox user, started once per container, so a call costs a socket
round trip and a fork instead of a `docker exec`. Standard library only: the tool image carries
nothing but Debian's python3. Frames are a 4-byte big-endian length followed by a JSON object.

The daemon is the only client; it serialises calls per session, so the executor never runs two
calls at once and can reap every stray process between calls.

Why one module of this size: it is copied into the tool image as one file and run there by Debian's
python3 with no package around it (`docker/Dockerfile`), so it cannot import siblings; `LocalSandbox`
runs the same file in-process.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import contextvars
import ctypes
import errno
import glob
import json
import os
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Protocol

WORKSPACE = "/workspace"
# The workspace of the call being served: /workspace in a sandbox; a directory of the daemon's when the
# daemon runs this code in-process (sandboxd.sandbox.local, for tests without an engine).
_workspace: contextvars.ContextVar[str] = contextvars.ContextVar("workspace", default=WORKSPACE)
MAX_REQUEST = 64 * 1024 * 1024
# Where a streamed call's output goes as it comes: a partial frame on the daemon's connection (unset when
# the daemon runs this code in-process, which streams nothing).
_emit: contextvars.ContextVar[Any] = contextvars.ContextVar("emit", default=None)
_serving_in_sandbox = False
"""Set by `main`: the process serves a sandbox, so after a call every other process of its user is a leftover."""
_spawn_directly = False
"""Set by `main`: the process is the executor alone, so it may change directory around a posix_spawn."""


class ToolFailure(Exception):
    """A failure reported back to the daemon as {"error": code, "message": ...}."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


def workspace_root() -> str:
    return os.path.realpath(_workspace.get())


def confine(path: str) -> str:
    """Resolve a tool path to a real path inside the workspace, following symlinks."""
    workspace = _workspace.get()
    root = os.path.realpath(workspace)
    if "\x00" in path:
        raise ToolFailure("path_escape", "path contains a NUL byte", path=path, reason="nul byte")
    if os.path.isabs(path):
        # /workspace is the workspace's name in every sandbox, whatever directory serves it.
        inside = path == WORKSPACE or path.startswith(WORKSPACE + "/")
        candidate = workspace + path[len(WORKSPACE):] if inside else path
    else:
        candidate = os.path.join(workspace, path)
    real = os.path.realpath(candidate)
    if real != root and not real.startswith(root + os.sep):
        reason = "a symlink points outside" if os.path.normpath(candidate).startswith(workspace) else "escapes"
        raise ToolFailure("path_escape", f"path {path!r} resolves outside /workspace", path=path, reason=reason)
    return real


def oom_kills() -> int:
    """The cgroup's OOM-kill counter (v2 or v1), or -1 where the kernel does not expose one."""
    for name in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(name) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return -1


def _expose_to_oom_killer(pid: int) -> None:
    # The tool, not the executor, must be the OOM killer's victim; raising another process's score
    # needs no privilege. Done from the parent rather than a preexec_fn, which would force a slow
    # fork() of the whole interpreter instead of vfork.
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as fh:
            fh.write("1000")
    except OSError:
        pass


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits, or None where the kernel (or gVisor) has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class _Spawned:
    """A tool started with posix_spawn: what the executor needs of a `subprocess.Popen`, reaped by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class _Child(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


def _collect(proc: _Child, pipes: dict[int, str], stdin: tuple[int, bytes] | None, cap: int, deadline: float,
             emit: Any = None) -> tuple[bytes, bytes, dict[str, int]]:
    """Feed stdin and drain stdout/stderr (`pipes`: fd -> "out"/"err") up to `cap` bytes each until exit or
    deadline; returns both and their full sizes.

    One poll loop on raw descriptors, no thread: the tool's exit is an event of the same poll (a pidfd), not
    something polled for (Popen.wait with a timeout sleeps in steps of 0.5 to 50 ms, which was most of a
    short call's time), and stdin is written as the pipe takes it (a feeder thread per call cost a thread
    start, and could not start at all at the pids limit).
    With `emit`, every chunk is also handed to it as it comes, as text (stream, text)."""
    bufs = {"out": bytearray(), "err": bytearray()}
    sizes = {"out": 0, "err": 0}
    decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in bufs} if emit else {}
    poller = select.poll()
    for fd in pipes:
        poller.register(fd, select.POLLIN)
    feed, fed = (stdin[0], memoryview(stdin[1])) if stdin else (-1, memoryview(b""))
    if feed >= 0:
        os.set_blocking(feed, False)
        poller.register(feed, select.POLLOUT)
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    exited = pidfd_done = False

    def close_feed() -> None:
        nonlocal feed
        if feed >= 0:
            poller.unregister(feed)
            os.close(feed)
            feed = -1

    delay = 0.0005
    try:
        # Until both pipes close and the tool has exited: a backgrounded grandchild may hold the pipes open
        # after the tool ends (see the grace below). Without a pidfd (gVisor has none) exit is polled for:
        # every 50 ms while a pipe is open; once both closed (the tool is exiting) in steps growing from
        # 0.5 ms, as Popen.wait does.
        while (pipes or not exited) and (remaining := deadline - time.monotonic()) > 0:
            if pidfd is not None:
                wait_s = remaining
            elif pipes:
                wait_s = min(remaining, 0.05)
            else:
                wait_s, delay = min(remaining, delay), min(delay * 2, 0.05)
            for fd, events in poller.poll(wait_s * 1000):
                if fd == pidfd:
                    poller.unregister(fd)
                    pidfd_done = True
                elif fd == feed:
                    try:
                        fed = fed[os.write(feed, fed[:65536]):] if events & select.POLLOUT else fed[:0]
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:  # the tool exited or closed its stdin without reading it all
                        fed = fed[:0]
                    if not fed:
                        close_feed()
                elif (chunk := os.read(fd, 65536)):
                    name = pipes[fd]
                    buf = bufs[name]
                    if (room := cap - len(buf)) > 0:
                        buf.extend(chunk[:room])
                    sizes[name] += len(chunk)
                    if emit is not None:
                        emit(name, decoders[name].decode(chunk))
                else:
                    poller.unregister(fd)
                    del pipes[fd]
            if not exited and (pidfd is None or pidfd_done) and proc.poll() is not None:
                exited = True
                deadline = min(deadline, time.monotonic() + 0.1)
    finally:
        close_feed()
        if pidfd is not None:
            os.close(pidfd)
    return bytes(bufs["out"]), bytes(bufs["err"]), sizes


def _kill_group(proc: _Child) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # A tool can leave its process group (setsid) and outlive the call, holding pids, memory or files
    # open; calls never overlap, so every other process of the sandbox user is a leftover. Only when
    # serving in a sandbox (not when a test imports this module on the host) and never as root, where
    # kill(-1) would reach the whole machine.
    if _serving_in_sandbox and os.getuid() != 0:
        _kill_leftovers()


def _kill_leftovers(wait_s: float = 2.0) -> None:
    """SIGKILL every process we may signal (all of the sandbox user's but this one and init) and wait
    until they are gone: a killed process holds its pid until init reaps it, and the next call must be
    able to fork under the pids limit."""
    deadline = time.monotonic() + wait_s
    while True:
        # Again and again: a fork bomb forks anew as its first processes die, and killing is slow under
        # gVisor, so one round leaves it running with the next call.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not _leftovers() or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def _leftovers() -> list[int]:
    """Pids of the sandbox user's processes other than this one and init, zombies included."""
    me, uid, found = os.getpid(), os.getuid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except OSError:
                pass  # gone between listdir and stat
    return found


def _faketime_library() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def virtual_clock(clock: float) -> dict[str, str]:
    """Environment that starts the tool's wall clock at `clock` (Unix seconds), for exact replay.

    libfaketime is preloaded into the tool only, never into the executor, and monotonic clocks stay
    real so sleeps and timeouts behave. Without the library (a custom image) only SANDBOXD_CLOCK is set.
    """
    env = {"SANDBOXD_CLOCK": repr(clock), "TZ": "UTC"}
    library = _faketime_library()
    if library is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(clock))
        env.update(LD_PRELOAD=library, FAKETIME=f"@{stamp}", FAKETIME_DONT_FAKE_MONOTONIC="1",
                   FAKETIME_DONT_RESET="1")
    return env


def _script_fd(script: str | None) -> int | None:
    """A file holding `script`, open for reading and unlinked (nothing is left behind): a command too long to
    be one argument of exec (Linux caps one at 128 KiB) reaches the shell this way."""
    if script is None:
        return None
    try:
        fd = os.memfd_create("sandboxd-script")
    except (AttributeError, OSError):  # no memfd in this kernel: an unlinked file in the scratch space
        fd, path = tempfile.mkstemp(prefix="sandboxd-script-")
        os.unlink(path)
    data = script.encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _executable(name: str, env: dict[str, str]) -> str:
    """The file `name` runs, looked up on the tool's PATH as Popen (and a shell) would."""
    if "/" in name:
        return name
    for directory in os.get_exec_path(env):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def _start(argv: list[str], env: dict[str, str], cwd: str, stdin: int | None, out: int, err: int,
           script: int | None) -> _Child:
    """Start the tool in a session of its own on these descriptors (stdin None: /dev/null).

    In the sandbox: posix_spawn (a vfork and exec, with none of Popen's Python around it: ~0.1 ms
    a call). It cannot change directory, so the executor does around it: it is alone in its process.
    Run in-process by the daemon (LocalSandbox, many threads), a chdir would move every thread: Popen."""
    if not _spawn_directly:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL if stdin is None else stdin,
                                stdout=out, stderr=err, start_new_session=True,
                                pass_fds=() if script is None else (script,))
    actions: list[tuple[Any, ...]] = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0) if stdin is None else (os.POSIX_SPAWN_DUP2, stdin, 0),
        (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, err, 2)]
    if script is not None:
        actions.append((os.POSIX_SPAWN_DUP2, script, script))  # onto itself: clears its close-on-exec flag
    home = os.getcwd()
    os.chdir(cwd)
    try:
        # setsigdef: what Popen's restore_signals does; Python ignores SIGPIPE and SIGXFSZ, and an ignored
        # signal stays ignored across exec (`yes | head -1` would never end).
        return _Spawned(os.posix_spawn(_executable(argv[0], env), argv, env, file_actions=actions, setsid=True,
                                       setsigdef=(signal.SIGPIPE, signal.SIGXFSZ)))
    finally:
        # Not left in the workspace: a restore swaps the workspace's mount, which a cwd inside would hold.
        os.chdir(home)


def inherit_nothing() -> None:
    """Mark every descriptor but the three close-on-exec: posix_spawn closes nothing (Popen closed all but
    the three), so whatever the container's init handed down to the executor must not reach a tool."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.set_inheritable(int(name), False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def run_process(req: dict[str, Any]) -> dict[str, Any]:
    """Run argv in the workspace with stdin, a timeout and capped output."""
    timeout = float(req["timeout"])
    cap = int(req["output_bytes"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(req.get("env") or {})
    if req.get("clock") is not None:
        env.update(virtual_clock(float(req["clock"])))
    cwd = confine(req.get("cwd") or ".")
    stdin = (req.get("stdin") or "").encode()
    argv, script = req["argv"], _script_fd(req.get("script"))
    if script is not None:  # argv names the script as {script}: a path the child opens through its own fd
        argv = [arg.replace("{script}", f"/proc/self/fd/{script}") for arg in argv]
    oom_before = oom_kills()
    started = time.monotonic()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # Nothing to feed: no pipe, /dev/null.
    in_r, in_w = os.pipe() if stdin else (None, None)
    try:
        proc = _start(argv, env, cwd, in_r, out_w, err_w, script)
    except BaseException:
        for fd in (out_r, err_r, in_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, in_r, script):
            if fd is not None:
                os.close(fd)
    _expose_to_oom_killer(proc.pid)
    emit = _emit.get() if req.get("stream") else None
    try:
        out, err, sizes = _collect(proc, {out_r: "out", err_r: "err"}, None if in_w is None else (in_w, stdin),
                                   cap, started + timeout, emit)
    finally:
        os.close(out_r)
        os.close(err_r)
    timed_out = proc.poll() is None
    # Kill the whole group either way: a call leaves no process behind, not even a backgrounded one.
    _kill_group(proc)
    code = proc.wait()
    oom_after = oom_kills()
    return {
        "exit_code": code,
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "stdout_truncated": sizes["out"] > len(out),
        "stderr_truncated": sizes["err"] > len(err),
        "stdout_size": sizes["out"],
        "stderr_size": sizes["err"],
        "timed_out": timed_out,
        "oom_killed": code == -signal.SIGKILL and oom_after > oom_before >= 0,
        "duration_ms": (time.monotonic() - started) * 1000,
    }


def _read_at(req: dict[str, Any], offset: int, length: int) -> tuple[bytes, os.stat_result]:
    """`length` bytes of a workspace file from `offset`, and its stat."""
    path = confine(req["path"])
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(path)
            fh.seek(offset)
            return fh.read(length), st
    except FileNotFoundError:
        raise ToolFailure("not_found", f"no such file: {req['path']}", path=req["path"]) from None
    except IsADirectoryError:
        raise ToolFailure("invalid_arguments", f"{req['path']} is a directory", path=req["path"]) from None


def _text(data: bytes, cut: bool) -> str | None:
    """`data` as UTF-8 text, or None when it is not text (NUL bytes, invalid UTF-8). A cut may split the
    last character: that one is left out, not taken as a sign of binary data."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut and exc.reason == "unexpected end of data":
            return data[:exc.start].decode("utf-8", "replace")
        return None


def read_file(req: dict[str, Any]) -> dict[str, Any]:
    """Return a file's text, capped (its full size said when cut). A file that is not text is not mangled
    into replacement characters: the call fails and says how to copy it out instead."""
    cap = int(req["max_bytes"])
    data, st = _read_at(req, 0, cap + 1)
    return file_reply(req["path"], data, st, cap)


def file_reply(path: str, data: bytes, st: os.stat_result, cap: int) -> dict[str, Any]:
    """read_file's reply for `data`, the first cap + 1 bytes of the file `path` names (the daemon builds the
    reply of a read it serves from the host with this same function: sandboxd.sandbox.hostread)."""
    cut = len(data) > cap
    text = _text(data[:cap], cut)
    size = max(st.st_size, len(data))
    if text is None:
        return {"exit_code": 1, "stdout": "", "stdout_size": size, "stderr": (
            f"{path} is a binary file ({size} bytes), not shown as text; copy it out with "
            f"`sandboxd cp SESSION:{path} LOCAL_PATH`\n")}
    return {"exit_code": 0, "stdout": text, "stderr": "", "stdout_truncated": cut, "stdout_size": size}


def read_bytes(req: dict[str, Any]) -> dict[str, Any]:
    """A chunk of a file as base64, for copying it out byte for byte."""
    data, st = _read_at(req, int(req.get("offset") or 0), int(req["length"]))
    return {"data": base64.b64encode(data).decode("ascii"), "size": st.st_size, "mode": stat.S_IMODE(st.st_mode)}


def _write(req: dict[str, Any], data: bytes) -> int:
    """Write (or append) bytes to a workspace file, creating parent directories; returns its size after."""
    path = confine(req["path"])
    if os.path.isdir(path):
        raise ToolFailure("invalid_arguments", f"{req['path']} is a directory", path=req["path"])
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    confine(parent)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if req.get("append") else os.O_TRUNC)
    fd = os.open(path, flags, int(req.get("mode") or 0o644))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            return os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise ToolFailure("resource_limit", f"write failed: {exc.strerror}", path=req["path"]) from exc


def write_file(req: dict[str, Any]) -> dict[str, Any]:
    """Write (or append) text to a file, creating parent directories inside the workspace."""
    data = req["content"].encode()
    _write(req, data)
    return {"exit_code": 0, "stdout": f"wrote {len(data)} bytes to {req['path']}", "stderr": ""}


def write_bytes(req: dict[str, Any]) -> dict[str, Any]:
    """Write base64-carried bytes to a file (copying one in byte for byte)."""
    return {"size": _write(req, base64.b64decode(req["data"], validate=True))}


def list_dir(req: dict[str, Any]) -> dict[str, Any]:
    """List a directory as JSON lines of name, type, size and mode, sorted by name."""
    path = confine(req.get("path") or ".")
    if not os.path.isdir(path):
        raise ToolFailure("not_found", f"no such directory: {req.get('path')}", path=req.get("path"))
    root = workspace_root()
    entries = []
    walker = os.walk(path) if req.get("recursive") else [(path, None, None)]
    for base, _, _ in walker:
        for name in sorted(os.listdir(base)):
            full = os.path.join(base, name)
            entries.append((os.path.relpath(full, root), os.lstat(full)))
    return listing_reply(entries)


def listing_reply(entries: list[tuple[str, os.stat_result]]) -> dict[str, Any]:
    """list_dir's reply for these entries (path relative to the workspace, lstat); the daemon builds the
    reply of a listing it serves from the host with this same function: sandboxd.sandbox.hostread."""
    rows = []
    for path, st in entries:
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
        rows.append({"path": path, "type": kind, "size": st.st_size, "mode": oct(stat.S_IMODE(st.st_mode))})
    rows.sort(key=lambda r: str(r["path"]))
    text = "\n".join(json.dumps(r, sort_keys=True) for r in rows)
    return {"exit_code": 0, "stdout": text, "stderr": ""}


def reap(_: dict[str, Any]) -> dict[str, Any]:
    """Kill every process of the sandbox user but this one, so nothing writes during a snapshot."""
    if os.getuid() == 0:
        # As root, kill(-1) would reach every process on the machine; sandboxes never run as root.
        raise ToolFailure("tool_error", "refusing to reap as root")
    _kill_leftovers()
    return {"ok": True}


def clear_scratch(_: dict[str, Any]) -> dict[str, Any]:
    """Empty /tmp and /dev/shm: scratch space is not in a snapshot, so a restore starts it afresh."""
    removed = 0
    for scratch in ("/tmp", "/dev/shm"):
        for name in os.listdir(scratch) if os.path.isdir(scratch) else []:
            path = os.path.join(scratch, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed += 1
            except OSError:
                pass  # not ours to remove (another user's file cannot exist in a sandbox anyway)
    return {"ok": True, "removed": removed}


OPS = {"run": run_process, "read_file": read_file, "write_file": write_file, "list_dir": list_dir,
       "read_bytes": read_bytes, "write_bytes": write_bytes,
       "reap": reap, "clear_scratch": clear_scratch,
       "ping": lambda _: {"ok": True, "pid": os.getpid(), "uid": os.getuid()}}


def recv_frame(conn: socket.socket) -> bytes | None:
    head = _recv_exact(conn, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > MAX_REQUEST:
        raise ValueError(f"request of {size} bytes is too large")
    return _recv_exact(conn, size)


def _recv_exact(conn: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = conn.recv(size - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


def send_frame(conn: socket.socket, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


def handle(frame: bytes) -> dict[str, Any]:
    """One request -> one reply; a tool failure becomes an error reply, never an exit."""
    try:
        req = json.loads(frame)
        op = OPS.get(req.get("op"))
        if op is None:
            return {"error": "invalid_arguments", "message": f"unknown op {req.get('op')!r}"}
        return op(req)
    except ToolFailure as exc:
        return {"error": exc.code, "message": str(exc), "details": exc.details}
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        return {"error": "tool_error", "message": f"{type(exc).__name__}: {exc}"}


def serve(socket_path: str) -> None:
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Created 0600 through the umask rather than a chmod afterwards: under gVisor the socket is a host
    # socket made by its file proxy (--host-uds=create), which refuses a chmod of it.
    previous = os.umask(0o177)
    try:
        server.bind(socket_path)
    finally:
        os.umask(previous)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        with conn:
            # A streamed call's chunks go back on this connection ahead of its reply.
            _emit.set(lambda stream, text, conn=conn: send_frame(conn, {"partial": {"stream": stream, "text": text}}))
            try:
                while (frame := recv_frame(conn)) is not None:
                    send_frame(conn, handle(frame))
            except (OSError, ValueError) as exc:
                print(f"executor: connection dropped: {exc}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    args = parser.parse_args()
    global _serving_in_sandbox, _spawn_directly
    _serving_in_sandbox = True
    _spawn_directly = hasattr(os, "waitstatus_to_exitcode")  # Python 3.9 and later; a custom image may be older
    # Not dumpable: a tool runs as the same user and could otherwise ptrace the executor, and with it
    # forge replies or survive the reaping between calls. A tool's own exec makes it dumpable again.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    inherit_nothing()
    serve(args.socket)


if __name__ == "__main__":
    main()
