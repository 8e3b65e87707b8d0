"""The snapshot store interface: one workspace per session, snapshots of its whole file tree.

A store owns a directory tree on the host. For each workspace it exposes a *mount root*: a host
directory that the sandbox bind-mounts at `/sandbox`, whose `ws/` child is the workspace the tools
see (the image links `/workspace` to `/sandbox/ws`). Binding the parent rather than `ws/` itself lets
a backend swap what `ws/` is (a new overlay mount, a fresh directory) without touching the container.
"""

from __future__ import annotations

import abc
import builtins
import ctypes
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SnapshotError(Exception):
    """A snapshot operation failed; the message says which and why."""


class UnknownSnapshot(SnapshotError):
    def __init__(self, workspace: str, snapshot_id: str) -> None:
        super().__init__(f"workspace {workspace!r} has no snapshot {snapshot_id!r}")
        self.workspace = workspace
        self.snapshot_id = snapshot_id


class SnapshotRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One snapshot as the store knows it."""

    snapshot_id: str
    workspace: str
    created_at: float
    layers: tuple[str, ...] = ()


class TakeResult(msgspec.Struct, frozen=True, kw_only=True):
    record: SnapshotRecord
    elapsed_ms: float
    flattened: bool = False


class RestoreResult(msgspec.Struct, frozen=True, kw_only=True):
    workspace: str
    snapshot_id: str
    elapsed_ms: float


def check_name(kind: str, name: str) -> str:
    """Workspace and snapshot ids become path components: refuse anything that is not a plain name."""
    if not _NAME.match(name):
        raise SnapshotError(f"invalid {kind} name {name!r}")
    return name


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, sync: bool = True) -> None:
    """Write a file so that a crash leaves either the old file or the new one, never half of it.

    `sync=False`: atomic against a crash of the process (the rename is), not of the host: for a caller
    that syncs the whole filesystem itself soon after (see `overlay.Flusher`)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        if sync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if not sync:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, value: Any, *, sync: bool = True) -> None:
    write_atomic(path, lambda fh: fh.write(json.dumps(value).encode()), sync=sync)


class SnapshotStore(abc.ABC):
    """Take, restore, list and delete snapshots of per-session workspaces."""

    #: bind propagation the sandbox must use for the mount root, so backend remounts reach it
    propagation: str = "rprivate"

    @abc.abstractmethod
    def create(self, workspace: str, owner: tuple[int, int]) -> Path:
        """Make an empty workspace owned by uid:gid and return its mount root."""

    @abc.abstractmethod
    def mount_root(self, workspace: str) -> Path:
        """The host directory to bind at /sandbox."""

    @abc.abstractmethod
    def take(self, workspace: str, snapshot_id: str) -> TakeResult:
        """Freeze the workspace's current tree under `snapshot_id`."""

    @abc.abstractmethod
    def restore(self, workspace: str, snapshot_id: str) -> RestoreResult:
        """Make the workspace's tree exactly what it was when `snapshot_id` was taken."""

    @abc.abstractmethod
    def delete(self, workspace: str, snapshot_id: str) -> None:
        """Forget one snapshot and free whatever only it was holding."""

    @abc.abstractmethod
    def list(self, workspace: str) -> builtins.list[SnapshotRecord]:
        """Snapshots of a workspace, oldest first."""

    @abc.abstractmethod
    def destroy(self, workspace: str) -> None:
        """Remove the workspace and every snapshot of it; nothing is left on disk."""

    @abc.abstractmethod
    def recover(self, workspace: str) -> None:
        """Bring a workspace back to a usable state after a crash or a reboot."""

    @abc.abstractmethod
    def workspaces(self) -> builtins.list[str]:
        """Every workspace this store holds on disk."""

    @abc.abstractmethod
    def paths(self, workspace: str) -> builtins.list[Path]:
        """Every host path holding this workspace's bytes (for a leak scan)."""

    @abc.abstractmethod
    def file_trees(self, workspace: str) -> builtins.list[Path]:
        """The directories under `paths` whose entries are the sandbox's own files: the live workspace and
        each snapshot's (or layer's) copy of it. Every other name under `paths` is one the store gives."""

    def disk_bytes(self, workspace: str) -> int:
        """Bytes the workspace and its snapshots take on the host's disk: the blocks allocated to the files
        under `paths` (each inode once; the mount root is a view of the same bytes, so it is not walked)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        pending = [path for path in self.paths(workspace) if path != self.mount_root(workspace)]
        while pending:
            path = pending.pop()
            try:
                info = path.lstat()
            except OSError:  # gone meanwhile, or never there
                continue
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                try:
                    pending.extend(path.iterdir())
                except OSError:
                    continue
        return total

    def trim(self, workspace: str) -> None:  # noqa: B027 - optional hook
        """Make freed space physically empty, where the backend keeps a block image; a no-op by default."""

    def release(self) -> None:  # noqa: B027 - optional hook, most backends set nothing up
        """Undo host-level set-up (mounts) once no workspace is left; a no-op by default."""

    def detach(self) -> None:  # noqa: B027 - optional hook, most backends mount nothing
        """Take down every mount the store made, workspaces' included (a daemon stopping); `recover` of each
        workspace mounts it again. A no-op by default."""

    def sweep(self, keep: set[str]) -> None:  # noqa: B027 - optional hook
        """Remove what a killed predecessor left on the host (mounts, mount points) for workspaces not in
        `keep`, beyond what `destroy` of the workspaces it lists reaches. A no-op by default."""

    def clone(self, source: str, target: str, snapshots: dict[str, str]) -> None:
        """Copy snapshots of workspace `source` into workspace `target`, each under its new id (old -> new)."""
        raise SnapshotError(f"{type(self).__name__} cannot copy snapshots between workspaces")


_libc = ctypes.CDLL(None, use_errno=True)


class Flusher:
    """Syncs the filesystems of paths handed to `soon`, at most `interval_s` later, on a thread of its own.

    A store that writes without an fsync per file (`write_atomic(sync=False)`, an overlay mounted
    `volatile`) is already safe against a crash of the daemon: what it wrote is in the kernel. This
    bounds what a crash of the host can take to the last `interval_s`, and many operations share one
    `syncfs`, off the path of the request. A second, not less: a `syncfs` in flight stalls the metadata
    writes of the next take or restore on the same filesystem, and snapshots come in bursts."""

    _shared: Flusher | None = None
    _shared_guard = threading.Lock()

    @classmethod
    def shared(cls) -> Flusher:
        """The process's one flusher (its thread lives as long as the process)."""
        with cls._shared_guard:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._dirty: set[Path] = set()
        self._guard = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="snapshots-flush", daemon=True).start()

    def soon(self, path: Path) -> None:
        with self._guard:
            self._dirty.add(path)
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._guard:
                dirty, self._dirty = self._dirty, set()
            for path in dirty:
                syncfs(path)
            time.sleep(self.interval_s)


def syncfs(path: Path) -> None:
    """Flush the filesystem holding `path` (gone already: nothing to flush)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _libc.syncfs(fd)
    finally:
        os.close(fd)
