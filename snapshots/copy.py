"""Copy snapshots: the portable backend, for hosts where overlay mounts are not available.

A snapshot is a full `cp -a` of the workspace (modes, owners, symlinks and timestamps kept); a
restore empties the workspace directory in place and copies the snapshot back. Cost grows with the
workspace, so the overlay backend is the default wherever it works.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from snapshots.base import (
    RestoreResult,
    SnapshotError,
    SnapshotRecord,
    SnapshotStore,
    TakeResult,
    UnknownSnapshot,
    check_name,
    write_json_atomic,
)


class CopySnapshotStore(SnapshotStore):
    """Snapshots as whole copies of the workspace under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts = root / "mounts"
        self.copies = root / "copies"
        self.mounts.mkdir(parents=True, exist_ok=True)
        self.copies.mkdir(parents=True, exist_ok=True)

    def mount_root(self, workspace: str) -> Path:
        return self.mounts / check_name("workspace", workspace)

    def _ws(self, workspace: str) -> Path:
        return self.mount_root(workspace) / "ws"

    def _dir(self, workspace: str) -> Path:
        return self.copies / check_name("workspace", workspace)

    def create(self, workspace: str, owner: tuple[int, int]) -> Path:
        if self._dir(workspace).exists():
            raise SnapshotError(f"workspace {workspace!r} already exists")
        self._dir(workspace).mkdir(parents=True)
        ws = self._ws(workspace)
        ws.mkdir(parents=True)
        os.chown(ws, *owner)
        os.chmod(ws, 0o755)
        return self.mount_root(workspace)

    def take(self, workspace: str, snapshot_id: str) -> TakeResult:
        started = time.monotonic()
        check_name("snapshot", snapshot_id)
        target = self._dir(workspace) / snapshot_id
        if target.exists():
            raise SnapshotError(f"snapshot {snapshot_id!r} already exists")
        partial = target.with_name(snapshot_id + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _copy_tree(self._ws(workspace), partial)
        record = SnapshotRecord(snapshot_id=snapshot_id, workspace=workspace, created_at=time.time(),
                                layers=(snapshot_id,))
        write_json_atomic(partial.with_name(snapshot_id + ".json"),
                          {"snapshot_id": snapshot_id, "created_at": record.created_at})
        os.rename(partial, target)
        return TakeResult(record=record, elapsed_ms=(time.monotonic() - started) * 1000)

    def restore(self, workspace: str, snapshot_id: str) -> RestoreResult:
        started = time.monotonic()
        source = self._existing(workspace, snapshot_id)
        ws = self._ws(workspace)
        for entry in ws.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        _copy_tree(source, ws)
        return RestoreResult(workspace=workspace, snapshot_id=snapshot_id,
                             elapsed_ms=(time.monotonic() - started) * 1000)

    def delete(self, workspace: str, snapshot_id: str) -> None:
        source = self._existing(workspace, snapshot_id)
        shutil.rmtree(source)
        source.with_name(snapshot_id + ".json").unlink(missing_ok=True)

    def list(self, workspace: str) -> builtins.list[SnapshotRecord]:
        records = []
        for meta in self._dir(workspace).glob("*.json"):
            with open(meta) as fh:
                raw = json.load(fh)
            if (self._dir(workspace) / raw["snapshot_id"]).is_dir():
                records.append(SnapshotRecord(snapshot_id=raw["snapshot_id"], workspace=workspace,
                                              created_at=raw["created_at"], layers=(raw["snapshot_id"],)))
        return sorted(records, key=lambda r: (r.created_at, r.snapshot_id))

    def destroy(self, workspace: str) -> None:
        shutil.rmtree(self.mount_root(workspace), ignore_errors=True)
        shutil.rmtree(self._dir(workspace), ignore_errors=True)

    def recover(self, workspace: str) -> None:
        for partial in self._dir(workspace).glob("*.partial"):
            shutil.rmtree(partial)
        for meta in self._dir(workspace).glob("*.json"):
            if not meta.with_suffix("").is_dir():
                meta.unlink()
        self._ws(workspace).mkdir(parents=True, exist_ok=True)

    def paths(self, workspace: str) -> builtins.list[Path]:
        return [self.mount_root(workspace), self._dir(workspace)]

    def file_trees(self, workspace: str) -> builtins.list[Path]:
        try:
            copies = [entry for entry in self._dir(workspace).iterdir() if entry.is_dir()]
        except FileNotFoundError:
            copies = []
        return [self._ws(workspace), *copies]

    def workspaces(self) -> builtins.list[str]:
        return sorted(p.name for p in self.copies.iterdir() if p.is_dir())

    def clone(self, source: str, target: str, snapshots: dict[str, str]) -> None:
        for old, new in snapshots.items():
            check_name("snapshot", new)
            origin = self._existing(source, old)
            with open(origin.with_name(old + ".json")) as fh:
                created_at = json.load(fh)["created_at"]
            partial = self._dir(target) / (new + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _copy_tree(origin, partial)
            write_json_atomic(partial.with_name(new + ".json"), {"snapshot_id": new, "created_at": created_at})
            os.rename(partial, partial.with_name(new))

    def _existing(self, workspace: str, snapshot_id: str) -> Path:
        path = self._dir(workspace) / check_name("snapshot", snapshot_id)
        if not path.is_dir():
            raise UnknownSnapshot(workspace, snapshot_id)
        return path


def _copy_tree(source: Path, target: Path) -> None:
    # cp -a keeps owners, modes, timestamps and symlinks as they are; shutil.copytree drops owners.
    target.mkdir(exist_ok=True)
    subprocess.run(["cp", "-a", f"{source}/.", str(target)], check=True)
    st = os.stat(source)
    os.chown(target, st.st_uid, st.st_gid)
    os.chmod(target, st.st_mode & 0o7777)
