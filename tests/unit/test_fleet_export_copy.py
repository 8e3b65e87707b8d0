"""The copy backend's export to the shared directory (only changed files copied, the rest hard links to
the last exported tree) and its import into another node's copy store, on real stores and files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.fleet.export import export_copies, import_copy_session, import_session, last_exported
from snapshots.copy import CopySnapshotStore


def test_a_copy_snapshot_exports_its_changes_and_imports_whole_elsewhere(tmp_path: Path) -> None:
    here = CopySnapshotStore(tmp_path / "a" / "snapshots")
    ws = here.create("s-1", (os.getuid(), os.getgid())) / "ws"
    (ws / "keep.txt").write_text("unchanged")
    (ws / "change.txt").write_text("v1")
    (ws / "dir").mkdir()
    (ws / "dir" / "deep.txt").write_text("deep")
    (ws / "link").symlink_to("keep.txt")
    (ws / "secret.txt").write_text("mode kept")
    (ws / "secret.txt").chmod(0o600)
    here.take("s-1", "snap-1")
    shared = tmp_path / "shared"
    assert export_copies(here.copies, shared) == 5  # everything, the first time
    assert last_exported(shared, "s-1") == "snap-1"
    assert export_copies(here.copies, shared) == 0  # nothing new

    (ws / "change.txt").write_text("version two")
    (ws / "new.txt").write_text("new")
    here.take("s-1", "snap-2")
    assert export_copies(here.copies, shared) == 3  # change.txt, new.txt, and the symlink (never linked)
    one, two = shared / "s-1" / "snap-1", shared / "s-1" / "snap-2"
    for name in ("keep.txt", "dir/deep.txt", "secret.txt"):  # unchanged: one inode, stored once
        assert (one / name).stat().st_ino == (two / name).stat().st_ino, name
    assert (one / "change.txt").stat().st_ino != (two / "change.txt").stat().st_ino
    assert (one / "change.txt").read_text() == "v1"  # the older tree is as it was
    assert last_exported(shared, "s-1") == "snap-2"

    there_root = tmp_path / "b" / "snapshots"
    assert import_copy_session(shared, there_root, "s-1") == "snap-2"
    there = CopySnapshotStore(there_root)
    assert there.workspaces() == ["s-1"] and [r.snapshot_id for r in there.list("s-1")] == ["snap-2"]
    imported = there_root / "mounts" / "s-1" / "ws"
    assert (imported / "change.txt").read_text() == "version two" and (imported / "new.txt").read_text() == "new"
    assert os.readlink(imported / "link") == "keep.txt"
    assert (imported / "secret.txt").stat().st_mode & 0o777 == 0o600
    assert (imported / "keep.txt").stat().st_ino != (two / "keep.txt").stat().st_ino  # a copy, not the export
    (imported / "change.txt").write_text("edited after adoption")
    there.restore("s-1", "snap-2")  # the imported snapshot restores like one taken here
    assert (imported / "change.txt").read_text() == "version two"

    with pytest.raises(FileExistsError):
        import_copy_session(shared, there_root, "s-1")
    with pytest.raises(ValueError, match="exported by the copy backend"):
        import_session(shared, tmp_path / "c" / "layers", "s-1")  # an overlay node cannot take a copy export
