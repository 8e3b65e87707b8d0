"""Layered overlay snapshots: a snapshot freezes only what changed since the previous one.

Each workspace is an overlayfs mount whose lower layers are frozen snapshot layers and whose upper
directory collects the changes since the last snapshot or restore. Taking a snapshot unmounts,
renames the upper directory into a new read-only layer and mounts again with a fresh upper: no file
data is copied, so its cost does not grow with the workspace. Restoring mounts the snapshot's layer
stack with an empty upper. Layers are immutable and shared between snapshots; a layer is removed
when no snapshot and no live stack refers to it.

The mount root is a shared mount, so a remount of `ws/` propagates into the container that binds the
root with `rslave` propagation; the container is never restarted.

Rejected: `docker commit` per snapshot (copies the whole diff every time, ~0.4 s for 50 MB) and
hard-link trees (a tool writing a file in place would corrupt the snapshot sharing its inode).

Crash safety: a take writes the snapshot record before renaming the upper, and the live stack after;
`recover` settles each crash point (see there). Against a crash of the daemon that is all it takes:
renames are atomic and what was written is in the kernel. So nothing on the path of a take or a
restore waits for the disk: the records are written without an fsync, and the overlay is mounted
`volatile`, because unmounting a plain overlay syncs its upper filesystem (through the loop device,
to the host's disk), which was most of the time of both. A `Flusher` syncs the session's filesystem
at most a second later, which is all a crash of the host can take (the quota image, having no journal,
is checked with e2fsck before it is mounted again after one anyway). Needs root and a filesystem that can hold overlay
upper directories (ext4, xfs, tmpfs).

Why one module of this size: taking, restoring, trimming and recovering layers are steps of one crash-safe
protocol over the same mount and the same records; `recover` must know every step's crash point.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import subprocess
import time
import uuid
from pathlib import Path

from snapshots.base import (
    Flusher,
    RestoreResult,
    SnapshotError,
    SnapshotRecord,
    SnapshotStore,
    TakeResult,
    UnknownSnapshot,
    check_name,
    syncfs,
    write_json_atomic,
)

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MS_RDONLY = 1
# _IOWR('X', 121, struct fstrim_range {u64 start, len, minlen}) from linux/fs.h
_FITRIM = 0xC0185879
# Overlay option strings must fit in one page; stay clear of it.
_MAX_OPTIONS = 3800
# A restore's intent: the stack and the moved-away upper to put back if it is cut off.
_RESTORING = "restoring.json"


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _libc.mount(
        source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise SnapshotError(f"mount {fstype or 'bind'} on {target} failed: {os.strerror(err)}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: not a mount point, already gone
            raise SnapshotError(f"umount {target} failed: {os.strerror(err)}")


def _fstrim(path: Path) -> None:
    """Discard every free block of the filesystem holding `path` (what `fstrim` does), in this process:
    `trim` runs on every revocation's commit, and two child processes (`sync -f`, `fstrim`) were most of
    its cost. A filesystem that cannot trim (EOPNOTSUPP) has nothing to punch out."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _FITRIM, bytearray(struct.pack("QQQ", 0, 2**64 - 1, 0)))
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY):
            raise
    finally:
        os.close(fd)


def _mountpoints() -> dict[str, str]:
    """Mount points of this namespace mapped to their optional fields (propagation tags)."""
    points: dict[str, str] = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            sep = fields.index("-")
            points[fields[4].replace("\\040", " ")] = " ".join(fields[6:sep])
    return points


class OverlaySnapshotStore(SnapshotStore):
    """Snapshots as stacks of immutable overlay layers under `root`."""

    propagation = "rslave"

    def __init__(self, root: Path, max_layers: int = 64, quota_mb: int = 0) -> None:
        self.root = root
        self.max_layers = max_layers
        self.quota_mb = quota_mb
        self.mounts = root / "mounts"
        self.layers = root / "layers"
        self.mounts.mkdir(parents=True, exist_ok=True)
        self.layers.mkdir(parents=True, exist_ok=True)
        self._ensure_shared()
        self.flusher = Flusher.shared()

    # Paths -------------------------------------------------------------------------------------

    def mount_root(self, workspace: str) -> Path:
        return self.mounts / check_name("workspace", workspace)

    def _ws(self, workspace: str) -> Path:
        return self.mount_root(workspace) / "ws"

    def _dir(self, workspace: str) -> Path:
        return self.layers / check_name("workspace", workspace)

    def _records(self, workspace: str) -> Path:
        return self._dir(workspace) / "snapshots"

    # Interface ---------------------------------------------------------------------------------

    def create(self, workspace: str, owner: tuple[int, int]) -> Path:
        d = self._dir(workspace)
        if d.exists():
            raise SnapshotError(f"workspace {workspace!r} already exists")
        d.mkdir(parents=True)
        if self.quota_mb:
            self._make_quota_fs(workspace)
        for sub in ("base", "upper", "work", "snapshots"):
            (d / sub).mkdir(parents=True)
        for sub in ("base", "upper"):
            os.chown(d / sub, *owner)
            os.chmod(d / sub, 0o755)
        write_json_atomic(d / "stack.json", ["base"], sync=False)
        self._ws(workspace).mkdir(parents=True)
        self._mount_stack(workspace, ["base"])
        self.flusher.soon(d)
        return self.mount_root(workspace)

    def take(self, workspace: str, snapshot_id: str) -> TakeResult:
        started = time.monotonic()
        check_name("snapshot", snapshot_id)
        d = self._dir(workspace)
        stack = self._stack(workspace)
        record = SnapshotRecord(
            snapshot_id=snapshot_id, workspace=workspace, created_at=time.time(),
            layers=(snapshot_id, *stack),
        )
        if (self._records(workspace) / f"{snapshot_id}.json").exists():
            raise SnapshotError(f"snapshot {snapshot_id!r} already exists")
        write_json_atomic(self._records(workspace) / f"{snapshot_id}.json", _record_json(record), sync=False)
        _umount(str(self._ws(workspace)))
        os.rename(d / "upper", d / snapshot_id)
        flattened = False
        if self._too_deep(workspace, list(record.layers)):
            record = self._flatten(workspace, record)
            flattened = True
        write_json_atomic(d / "stack.json", list(record.layers), sync=False)
        self._fresh_upper(workspace, record.layers[0])
        self._mount_stack(workspace, list(record.layers))
        if flattened:
            self._collect_layers(workspace)
        self.flusher.soon(d)
        return TakeResult(record=record, elapsed_ms=(time.monotonic() - started) * 1000, flattened=flattened)

    def restore(self, workspace: str, snapshot_id: str) -> RestoreResult:
        started = time.monotonic()
        record = self._record(workspace, snapshot_id)
        d = self._dir(workspace)
        _umount(str(self._ws(workspace)))
        trash = d / f"trash-{uuid.uuid4().hex[:8]}"
        # Until the intent is gone, `recover` undoes the restore: a crash between dropping the upper and
        # writing the new stack would otherwise remount the old stack without its upper, a mix of neither.
        write_json_atomic(d / _RESTORING, {"stack": self._stack(workspace), "trash": trash.name}, sync=False)
        os.rename(d / "upper", trash)
        write_json_atomic(d / "stack.json", list(record.layers), sync=False)
        self._fresh_upper(workspace, record.layers[0])
        self._mount_stack(workspace, list(record.layers))
        (d / _RESTORING).unlink()
        _erase_tree(trash)
        self.flusher.soon(d)
        return RestoreResult(workspace=workspace, snapshot_id=snapshot_id,
                             elapsed_ms=(time.monotonic() - started) * 1000)

    def delete(self, workspace: str, snapshot_id: str) -> None:
        self._record(workspace, snapshot_id)
        (self._records(workspace) / f"{snapshot_id}.json").unlink()
        self._collect_layers(workspace)

    def list(self, workspace: str) -> builtins.list[SnapshotRecord]:
        records = [self._load(p) for p in self._records(workspace).glob("*.json")]
        return sorted((r for r in records if (self._dir(workspace) / r.layers[0]).exists()),
                      key=lambda r: (r.created_at, r.snapshot_id))

    def destroy(self, workspace: str) -> None:
        _umount(str(self._ws(workspace)))
        shutil.rmtree(self.mount_root(workspace), ignore_errors=True)
        if str(self._dir(workspace)) in _mountpoints():
            _umount(str(self._dir(workspace)))  # the loop device detaches itself (autoclear) once unused
        shutil.rmtree(self._dir(workspace), ignore_errors=True)
        self._image(workspace).unlink(missing_ok=True)

    def workspaces(self) -> builtins.list[str]:
        return sorted(p.name for p in self.layers.iterdir() if p.is_dir())

    def release(self) -> None:
        if not self.workspaces():
            _umount(str(self.mounts))

    def detach(self) -> None:
        """Every mount under the store's root, deepest first: workspaces, quota images, the shared bind."""
        for point in sorted((p for p in _mountpoints() if p == str(self.root) or p.startswith(f"{self.root}/")),
                            key=len, reverse=True):
            _umount(point)

    def sweep(self, keep: set[str]) -> None:
        """Mounts and mount points of workspaces that are gone (a predecessor killed inside `destroy`)."""
        held = set(self.workspaces()) | keep
        for base in (self.mounts, self.layers):
            for point in sorted((p for p in _mountpoints() if p.startswith(f"{base}/")), key=len, reverse=True):
                name = Path(point).relative_to(base).parts[0].lstrip(".").removesuffix(".img")
                if name not in held:
                    _umount(point)
        for entry in self.mounts.iterdir():
            if entry.is_dir() and entry.name not in held and str(entry) not in _mountpoints():
                shutil.rmtree(entry, ignore_errors=True)

    def clone(self, source: str, target: str, snapshots: dict[str, str]) -> None:
        """Copy each snapshot's layers (once each; layers are immutable) and write its record under its new id."""
        src, dst = self._dir(source), self._dir(target)
        for old, new in snapshots.items():
            check_name("snapshot", new)
            record = self._record(source, old)
            for layer in record.layers:
                if (dst / layer).exists():
                    continue  # an empty base, or a layer an earlier snapshot shares
                partial = dst / f"clone-{layer}"
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
                subprocess.run(["cp", "-a", f"{src / layer}/.", str(partial)], check=True)
                st = os.stat(src / layer)
                os.chown(partial, st.st_uid, st.st_gid)
                os.chmod(partial, st.st_mode & 0o7777)
                os.rename(partial, dst / layer)
            write_json_atomic(self._records(target) / f"{new}.json", _record_json(SnapshotRecord(
                snapshot_id=new, workspace=target, created_at=record.created_at, layers=record.layers)))

    def recover(self, workspace: str) -> None:
        """Settle an interrupted take or restore, then make sure the workspace is mounted."""
        d = self._dir(workspace)
        if self._image(workspace).exists() and str(d) not in _mountpoints():
            # After a reboot the session's filesystem is a file again, and without a journal an unclean
            # one needs a check first (-p: repair what is safe to repair without asking).
            subprocess.run(["e2fsck", "-p", str(self._image(workspace))], check=False, capture_output=True)
            self._mount_quota_fs(workspace)
        _umount(str(self._ws(workspace)))
        self._undo_restore(workspace)
        for path in self._records(workspace).glob("*.json"):
            record = self._load(path)
            if not (d / record.layers[0]).exists():
                # Crash between writing the record and renaming the upper: the take never happened.
                if (d / "upper").exists():
                    path.unlink()
                else:
                    raise SnapshotError(f"workspace {workspace!r}: upper and layer {record.layers[0]} both gone")
        if not (d / "upper").exists():
            # Crash after the upper became a layer: the newest record built on the live stack wins.
            stack = self._stack(workspace)
            newest = [r for r in self.list(workspace) if list(r.layers[1:]) == stack]
            if newest:
                write_json_atomic(d / "stack.json", list(newest[-1].layers))
            self._fresh_upper(workspace, self._stack(workspace)[0])
        view = d / "flatten-view"
        if view.exists():  # a crash mid-flatten left its read-only view mounted
            _umount(str(view))
            view.rmdir()
        for trash in d.glob("trash-*"):
            _erase_tree(trash)
        # A volatile overlay leaves work/work/incompat/volatile behind, and refuses to mount on it again:
        # the work directory is the overlay's scratch, empty whenever nothing is mounted on it.
        shutil.rmtree(d / "work", ignore_errors=True)
        (d / "work").mkdir()
        self._ws(workspace).mkdir(parents=True, exist_ok=True)
        self._mount_stack(workspace, self._stack(workspace))
        self._collect_layers(workspace)

    # Internals ---------------------------------------------------------------------------------

    def _image(self, workspace: str) -> Path:
        return self.layers / f".{check_name('workspace', workspace)}.img"

    def _make_quota_fs(self, workspace: str) -> None:
        """A sparse ext4 image of quota_mb holding the session's upper and layers: the disk quota.

        Everything a session writes, its snapshots included, lives in it, so a tool that fills the
        workspace gets ENOSPC instead of filling the host. Sparse and lazily initialised: ~60 ms.

        No journal: a journal keeps copies of metadata blocks (directory entries, so file names) that
        neither deleting the files nor trimming free space reaches, and a revoked name must not outlive
        its file. The image is a file on the host whose kernel does not crash when the daemon does; after
        a host crash, `recover` runs e2fsck before mounting it again.
        """
        image = self._image(workspace)
        with open(image, "wb") as fh:
            fh.truncate(self.quota_mb * 1024 * 1024)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1",
                        str(image)], check=True, capture_output=True)
        self._mount_quota_fs(workspace)

    def paths(self, workspace: str) -> builtins.list[Path]:
        return [self.mount_root(workspace), self._dir(workspace), self._image(workspace)]

    def file_trees(self, workspace: str) -> builtins.list[Path]:
        try:
            layers = [entry for entry in self._dir(workspace).iterdir()
                      if entry.is_dir() and entry.name not in ("work", "snapshots", "lost+found")]
        except FileNotFoundError:
            layers = []
        return [self._ws(workspace), *layers]

    def disk_bytes(self, workspace: str) -> int:
        """The blocks of the session's image, which holds its upper directory and every layer (one stat, however
        many files); without an image, what the layers directory holds."""
        try:
            return self._image(workspace).stat().st_blocks * 512
        except FileNotFoundError:
            return super().disk_bytes(workspace)

    def trim(self, workspace: str) -> None:
        """Punch every free block out of the session's image (after deletes that must be physical)."""
        if str(self._dir(workspace)) in _mountpoints():
            # Blocks freed but not yet written back are not trimmable until they are.
            syncfs(self._dir(workspace))
            _fstrim(self._dir(workspace))

    def _mount_quota_fs(self, workspace: str) -> None:
        # discard: a deleted file's blocks are punched out of the image at once, so what a session
        # removed (a revoked note among it) does not linger in free space.
        done = subprocess.run(["mount", "-o", "loop,nosuid,nodev,discard", str(self._image(workspace)),
                               str(self._dir(workspace))], capture_output=True, text=True)
        if done.returncode != 0:
            raise SnapshotError(f"could not mount the quota filesystem of {workspace!r}: {done.stderr.strip()}")

    def _undo_restore(self, workspace: str) -> None:
        """A restore cut off before it finished: put the old stack and its upper back."""
        d = self._dir(workspace)
        if not (d / _RESTORING).exists():
            return
        with open(d / _RESTORING) as fh:
            intent = json.load(fh)
        trash = d / intent["trash"]
        if trash.exists():  # the old upper was moved away; any upper now is the new, empty one
            shutil.rmtree(d / "upper", ignore_errors=True)
            os.rename(trash, d / "upper")
            shutil.rmtree(d / "work", ignore_errors=True)
            (d / "work").mkdir()
        write_json_atomic(d / "stack.json", intent["stack"])
        (d / _RESTORING).unlink()

    def _ensure_shared(self) -> None:
        point = str(self.mounts)
        tags = _mountpoints().get(point)
        if tags is None:
            _mount(point, point, None, _MS_BIND, None)
            tags = ""
        if "shared:" not in tags:
            _mount("none", point, None, _MS_SHARED | _MS_REC, None)

    def _stack(self, workspace: str) -> builtins.list[str]:
        with open(self._dir(workspace) / "stack.json") as fh:
            return list(json.load(fh))

    def _record(self, workspace: str, snapshot_id: str) -> SnapshotRecord:
        check_name("snapshot", snapshot_id)
        path = self._records(workspace) / f"{snapshot_id}.json"
        if not path.exists():
            raise UnknownSnapshot(workspace, snapshot_id)
        return self._load(path)

    @staticmethod
    def _load(path: Path) -> SnapshotRecord:
        with open(path) as fh:
            raw = json.load(fh)
        return SnapshotRecord(snapshot_id=raw["snapshot_id"], workspace=raw["workspace"],
                              created_at=raw["created_at"], layers=tuple(raw["layers"]))

    def _options(self, workspace: str, stack: builtins.list[str]) -> str:
        d = self._dir(workspace)
        lower = ":".join(str(d / layer) for layer in stack)
        return f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'},volatile"

    def _too_deep(self, workspace: str, stack: builtins.list[str]) -> bool:
        return len(stack) > self.max_layers or len(self._options(workspace, stack)) > _MAX_OPTIONS

    def _mount_stack(self, workspace: str, stack: builtins.list[str]) -> None:
        _mount("overlay", str(self._ws(workspace)), "overlay", 0, self._options(workspace, stack))

    def _fresh_upper(self, workspace: str, top: str) -> None:
        """An empty upper (and work) dir whose root carries the owner and mode of the stack's top."""
        d = self._dir(workspace)
        shutil.rmtree(d / "work", ignore_errors=True)
        (d / "work").mkdir()
        (d / "upper").mkdir()
        st = os.stat(d / top)
        os.chown(d / "upper", st.st_uid, st.st_gid)
        os.chmod(d / "upper", st.st_mode & 0o7777)

    def _flatten(self, workspace: str, record: SnapshotRecord) -> SnapshotRecord:
        """Copy the merged view of a too-deep stack into one layer; happens once per max_layers takes."""
        d = self._dir(workspace)
        flat = f"{record.snapshot_id}.flat"
        view = d / "flatten-view"
        view.mkdir(exist_ok=True)
        lower = ":".join(str(d / layer) for layer in record.layers)
        _mount("overlay", str(view), "overlay", _MS_RDONLY, f"lowerdir={lower}")
        try:
            (d / flat).mkdir()
            subprocess.run(["cp", "-a", f"{view}/.", str(d / flat)], check=True)
            st = os.stat(view)
            os.chown(d / flat, st.st_uid, st.st_gid)
            os.chmod(d / flat, st.st_mode & 0o7777)
        finally:
            _umount(str(view))
            view.rmdir()
        flattened = SnapshotRecord(snapshot_id=record.snapshot_id, workspace=workspace,
                                   created_at=record.created_at, layers=(flat,))
        write_json_atomic(self._records(workspace) / f"{record.snapshot_id}.json", _record_json(flattened))
        return flattened

    def _collect_layers(self, workspace: str) -> None:
        """Remove layers that neither a snapshot nor the live stack refers to."""
        d = self._dir(workspace)
        live = set(self._stack(workspace))
        for record in self.list(workspace):
            live.update(record.layers)
        fixed = {"upper", "work", "snapshots", "stack.json", "stack.json.tmp", _RESTORING}
        for entry in d.iterdir():
            if entry.name not in fixed and entry.name not in live and not entry.name.startswith("trash-"):
                _erase_tree(entry) if entry.is_dir() else entry.unlink()


def _erase_tree(path: Path) -> None:
    """Remove a dropped upper or layer so that its files' blocks are free at once: truncate, then unlink.

    Unlinking frees nothing while something still holds a file open, and under gVisor its file proxy
    keeps descriptors of files it served (its dentry cache) after the overlay they came through was
    replaced: a revoked value would live on in the quota image. Truncation frees the blocks whoever
    holds them, and the image's `discard` mount punches them out. A layer's files are its own (overlay
    copies a file up before linking it), so no other layer loses data.
    """
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:  # a symlink, socket or FIFO: no blocks of its own to free
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
    shutil.rmtree(path)


def _record_json(record: SnapshotRecord) -> dict[str, object]:
    return {"snapshot_id": record.snapshot_id, "workspace": record.workspace,
            "created_at": record.created_at, "layers": list(record.layers)}
