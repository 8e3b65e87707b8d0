"""`read_file` and `list_dir` answered from the host, through the workspace's host directory, without a round trip into
the container; or not at all (None), and the executor answers as before.

Only where the answer is provably the executor's own: the same bytes of the same file, read with the
sandbox user's permissions, built into a reply by the executor's own function (`executor.file_reply`).
So the file is opened with openat2 on the workspace's host directory with

- RESOLVE_BENEATH: any `..` or symlink leading out of the workspace, and any absolute symlink (which the
  container resolves in its own root), fails with EXDEV, and the executor answers (a path escape, or a
  symlink such as `/workspace/x` that is fine in the container);
- RESOLVE_NO_MAGICLINKS and RESOLVE_NO_XDEV: no /proc links, no other mount below the workspace;
- the sandbox user's uid, gid and groups as this thread's file-system credentials (setfsuid, setfsgid
  and a raw setgroups all act on the calling thread alone; an fsuid other than 0 also drops the
  capabilities that bypass permission checks), so a file or directory the tool made unreadable fails
  here as it does there;
- O_NONBLOCK, and anything but a regular file handed back: a FIFO would block the daemon's worker.

Any failure at all (a missing file included: the container's realpath and the kernel's walk differ on
`missing/..`) means "ask the executor", which gives the error it always gave, worded as always. The
container is never entered, so none of its own limits bear on a read of a regular file that exists.

Only under runc, where /sandbox in the container is a bind mount of the host directory: gVisor serves
the bind through its gofer and may cache what the sandbox wrote, so under runsc every read goes to the
executor; likewise when the daemon is not root (it cannot take the sandbox user's credentials) or the
engine remaps user namespaces (the sandbox's uid is not the host's).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sandboxd.sandbox import executor

_SYS_OPENAT2, _SYS_SETGROUPS, _SYS_SETFSUID, _SYS_SETFSGID = 437, 116, 122, 123  # x86_64
_RESOLVE = 0x01 | 0x02 | 0x08  # RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class HostReader:
    """Reads workspace files as the sandbox user would, from the host; `read_file` returns None to decline."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self.usable = os.uname().machine == "x86_64" and os.geteuid() == 0 and self._probe()

    def _probe(self) -> bool:
        """Whether this kernel has openat2 (5.6 and later)."""
        how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
        fd = self._syscall(_SYS_OPENAT2, -100, b".", ctypes.byref(how), ctypes.sizeof(how))  # -100: AT_FDCWD
        if fd < 0:
            return False
        os.close(fd)
        return True

    def _syscall(self, number: int, *args: Any) -> int:
        # Every integer as a long: syscall(2) is variadic, and the kernel reads whole registers.
        return int(self._libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a
                                                               for a in args)))

    def read_file(self, workspace: Path, req: dict[str, Any], at_most: int | None = None) -> dict[str, Any] | None:
        """The executor's reply to this read_file request, or None when only the executor can give it (or, with
        `at_most`, when the file is larger than that many bytes)."""
        path = _relative(req["path"])
        if not self.usable or path in (None, "."):
            return None
        with self._workspace(workspace) as root, self._as_sandbox_user() as switched:
            fd = self._open(root, path, _FLAGS) if switched and root >= 0 and self._regular(root, path) else -1
        if fd < 0:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (at_most is not None and st.st_size > at_most):
                return None
            cap = int(req["max_bytes"])
            # With `at_most`, no more than that is read even of a file that grew since its fstat.
            limit = cap if at_most is None else min(cap, at_most)
            data = _read_up_to(fd, limit + 1)
            if len(data) > limit and limit < cap:
                return None
            return executor.file_reply(req["path"], data, st, cap)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _regular(self, root: int, path: str) -> bool:
        """Whether the path is a regular file, looked at without opening it: opening a device node on the
        host would be outside the container's device rules (the sandbox cannot make one, but an imported
        workspace could carry one), and a FIFO's open could block."""
        fd = self._open(root, path, os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def list_dir(self, workspace: Path, req: dict[str, Any], at_most: int | None = None) -> dict[str, Any] | None:
        """The executor's reply to a (non-recursive) list_dir request, or None when only the executor can give
        it (or, with `at_most`, when the directory holds more entries than that). The entries are read and
        lstat'ed as the sandbox user too: a directory it may read but not search lists its names there, and
        fails on their lstat."""
        path = _relative(req.get("path") or ".")
        if not self.usable or path is None or req.get("recursive"):
            return None  # os.walk's way with unreadable subdirectories is the executor's to keep
        with self._workspace(workspace) as root:
            with self._as_sandbox_user() as switched:
                fd = self._open(root, path, _FLAGS | os.O_DIRECTORY) if switched and root >= 0 else -1
                try:
                    names = _names(fd, at_most) if fd >= 0 else None
                    stats = [(name, os.stat(name, dir_fd=fd, follow_symlinks=False)) for name in names or ()]
                except OSError:
                    names = None
            if names is None:
                if fd >= 0:
                    os.close(fd)
                return None
            if path == ".":  # the workspace itself, whose entries are named as they are: no walk to ask about
                os.close(fd)
                return executor.listing_reply(stats)
            try:
                # Where the walk ended, as the container's realpath would name it relative to /workspace.
                top, base = os.readlink(f"/proc/self/fd/{root}"), os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        if base != top and not base.startswith(top + "/"):
            return None
        return executor.listing_reply([(os.path.relpath(os.path.join(base, name), top), st) for name, st in stats])

    @contextmanager
    def _workspace(self, workspace: Path) -> Iterator[int]:
        """The workspace's host directory, never through a symlink (-1 where it cannot be opened)."""
        try:
            root = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            root = -1
        try:
            yield root
        finally:
            if root >= 0:
                os.close(root)

    def _open(self, root: int, path: str, flags: int) -> int:
        how = _OpenHow(flags, 0, _RESOLVE)
        return self._syscall(_SYS_OPENAT2, root, path.encode(), ctypes.byref(how), ctypes.sizeof(how))

    @contextmanager
    def _as_sandbox_user(self) -> Iterator[bool]:
        """This thread's file-system identity is the sandbox user's within the block (False: it could not be)."""
        saved = os.getgroups()
        sys = self._syscall
        # Order matters: the groups need CAP_SETGID, which a non-zero fsuid does not drop but is restored last.
        if sys(_SYS_SETGROUPS, 1, (ctypes.c_uint32 * 1)(self.gid)) != 0:
            yield False
            return
        try:
            sys(_SYS_SETFSGID, self.gid)
            sys(_SYS_SETFSUID, self.uid)
            try:
                # setfsuid and setfsgid fail silently (a daemon without CAP_SETUID or CAP_SETGID keeps its
                # own identity): read back what took, or this thread would read as root what the
                # sandbox user may not.
                yield sys(_SYS_SETFSUID, -1) == self.uid and sys(_SYS_SETFSGID, -1) == self.gid
            finally:
                sys(_SYS_SETFSUID, 0)
                sys(_SYS_SETFSGID, 0)
        finally:
            back = (ctypes.c_uint32 * max(len(saved), 1))(*saved)
            if sys(_SYS_SETGROUPS, len(saved), back) != 0:
                raise AssertionError(f"this thread's groups were not restored: {os.strerror(ctypes.get_errno())}")
        # -1 changes nothing and returns the current value. A worker left with the sandbox user's identity
        # would read and write the daemon's state as that user: a broken invariant, so the daemon stops
        # loudly (sandboxd.server).
        if sys(_SYS_SETFSUID, -1) != 0 or sys(_SYS_SETFSGID, -1) != 0:
            raise AssertionError("this thread's file-system identity was not restored")


def _relative(path: str) -> str | None:
    """A tool's path relative to the workspace ("." for itself), or None for one the executor refuses."""
    if path == executor.WORKSPACE or path.startswith(executor.WORKSPACE + "/"):
        path = path[len(executor.WORKSPACE):]
    elif path.startswith("/"):
        return None  # refused by the executor as an escape
    if "\x00" in path:
        return None
    return path.lstrip("/") or "."


def _read_up_to(fd: int, size: int) -> bytes:
    """Up to `size` bytes from the start, as a buffered file's read(size) gives them."""
    chunks, left = [], size
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _names(fd: int, at_most: int | None) -> list[str] | None:
    """The directory's names, or None when it holds more than `at_most`: found out after reading at most one
    more, since a directory of a million entries takes the whole listing's time to read, not just its lstats."""
    if at_most is None:
        return os.listdir(fd)
    with os.scandir(fd) as entries:
        names = [entry.name for entry in itertools.islice(entries, at_most + 1)]
    return None if len(names) > at_most else names
