"""Both snapshot backends behind the one interface: exact trees, layering, deletion, crash recovery."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshots import SnapshotError, SnapshotStore, UnknownSnapshot, open_store
from snapshots.overlay import OverlaySnapshotStore, _mountpoints, _umount

OWNER = (1000, 1000)


@pytest.fixture(params=["overlay", "copy"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SnapshotStore]:
    if request.param == "overlay" and os.geteuid() != 0:
        pytest.fail("the overlay backend needs root (mount); run the suite as root")
    made = open_store(request.param, tmp_path / request.param, max_layers=4)
    yield made
    for workspace in made.workspaces():
        made.destroy(workspace)
    made.release()


def listing(root: Path) -> list[tuple[str, str, int, int, int, str]]:
    rows = []
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            full = Path(base) / name
            st = full.lstat()
            body = os.readlink(full) if full.is_symlink() else full.read_text() if full.is_file() else ""
            rows.append((str(full.relative_to(root)), oct(st.st_mode), st.st_uid, st.st_gid, st.st_size, body))
    return sorted(rows)


def build(ws: Path) -> None:
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "main.py").write_text("print(1)\n")
    (ws / "src" / "pkg" / "m.py").write_text("x = 1\n")
    (ws / "secret").write_text("s")
    os.chmod(ws / "secret", 0o600)
    os.chown(ws / "secret", *OWNER)
    (ws / "link").symlink_to("src/main.py")
    (ws / "empty").mkdir()


def mutate(ws: Path) -> None:
    (ws / "src" / "pkg" / "m.py").unlink()
    (ws / "src" / "pkg").rmdir()
    (ws / "src" / "main.py").write_text("changed\n")
    os.chmod(ws / "secret", 0o644)
    (ws / "link").unlink()
    (ws / "new").write_text("new")


def test_restore_gives_back_the_exact_tree(store: SnapshotStore) -> None:
    ws = store.create("w1", OWNER) / "ws"
    build(ws)
    before = listing(ws)
    store.take("w1", "s1")
    mutate(ws)
    assert listing(ws) != before
    store.restore("w1", "s1")
    assert listing(ws) == before
    assert (ws.stat().st_uid, ws.stat().st_gid) == OWNER


def test_snapshots_stack_and_survive_deleting_their_parents(store: SnapshotStore) -> None:
    ws = store.create("w1", OWNER) / "ws"
    states = []
    for i in range(7):  # past max_layers=4, so the overlay backend flattens on the way
        (ws / f"f{i}").write_text(str(i))
        if i % 2:
            (ws / f"f{i - 1}").unlink()
        store.take("w1", f"s{i}")
        states.append(listing(ws))
    store.delete("w1", "s0")
    store.delete("w1", "s3")
    assert [r.snapshot_id for r in store.list("w1")] == ["s1", "s2", "s4", "s5", "s6"]
    for i in (6, 1, 4, 2, 5):
        store.restore("w1", f"s{i}")
        assert listing(ws) == states[i], i
    with pytest.raises(UnknownSnapshot):
        store.restore("w1", "s3")


def test_names_are_checked(store: SnapshotStore) -> None:
    store.create("w1", OWNER)
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(SnapshotError):
            store.take("w1", bad)
    with pytest.raises(SnapshotError):
        store.create("../escape", OWNER)
    store.take("w1", "ok")
    with pytest.raises(SnapshotError):
        store.take("w1", "ok")


def test_destroy_leaves_nothing(store: SnapshotStore, tmp_path: Path) -> None:
    ws = store.create("w1", OWNER) / "ws"
    build(ws)
    store.take("w1", "s1")
    store.destroy("w1")
    assert store.workspaces() == []
    leftovers = [p for p in tmp_path.rglob("*") if "w1" in str(p)]
    assert leftovers == []


def test_overlay_snapshot_copies_no_file_data(tmp_path: Path) -> None:
    store = OverlaySnapshotStore(tmp_path / "o")
    ws = store.create("w1", OWNER) / "ws"
    try:
        (ws / "big").write_bytes(b"x" * 1_000_000)
        store.take("w1", "s1")
        (ws / "small").write_text("y")
        store.take("w1", "s2")
        layer_s2 = tmp_path / "o" / "layers" / "w1" / "s2"
        # The second snapshot's own layer holds only what changed after the first.
        assert sorted(p.name for p in layer_s2.iterdir()) == ["small"]
    finally:
        store.destroy("w1")
        store.release()


def test_overlay_recovers_from_a_crash_before_the_upper_was_frozen(tmp_path: Path) -> None:
    store = OverlaySnapshotStore(tmp_path / "o")
    ws = store.create("w1", OWNER) / "ws"
    try:
        (ws / "a").write_text("kept")
        layers = tmp_path / "o" / "layers" / "w1"
        # Crash after the record was written, before the upper was renamed into a layer.
        (layers / "snapshots" / "half.json").write_text(
            '{"snapshot_id": "half", "workspace": "w1", "created_at": 1, "layers": ["half", "base"]}')
        _umount(str(ws))
        store.recover("w1")
        assert (ws / "a").read_text() == "kept"
        assert [r.snapshot_id for r in store.list("w1")] == []
        assert not (layers / "snapshots" / "half.json").exists()
    finally:
        store.destroy("w1")
        store.release()


def test_overlay_recovers_from_a_crash_after_the_upper_was_frozen(tmp_path: Path) -> None:
    store = OverlaySnapshotStore(tmp_path / "o")
    ws = store.create("w1", OWNER) / "ws"
    try:
        (ws / "a").write_text("frozen")
        layers = tmp_path / "o" / "layers" / "w1"
        (layers / "snapshots" / "s1.json").write_text(
            '{"snapshot_id": "s1", "workspace": "w1", "created_at": 1, "layers": ["s1", "base"]}')
        _umount(str(ws))
        os.rename(layers / "upper", layers / "s1")  # crash right here: no live stack update, no upper
        store.recover("w1")
        assert (ws / "a").read_text() == "frozen"
        assert [r.snapshot_id for r in store.list("w1")] == ["s1"]
        (ws / "a").write_text("later")
        store.restore("w1", "s1")
        assert (ws / "a").read_text() == "frozen"
    finally:
        store.destroy("w1")
        store.release()


def test_overlay_mount_root_is_shared_for_propagation(tmp_path: Path) -> None:
    store = OverlaySnapshotStore(tmp_path / "o")
    try:
        assert "shared:" in _mountpoints()[str(tmp_path / "o" / "mounts")]
        assert store.propagation == "rslave"
    finally:
        store.release()
    assert str(tmp_path / "o" / "mounts") not in _mountpoints()


def test_modes_of_the_workspace_root_survive(store: SnapshotStore) -> None:
    ws = store.create("w1", OWNER) / "ws"
    os.chmod(ws, 0o750)
    store.take("w1", "s1")
    os.chmod(ws, 0o755)
    store.restore("w1", "s1")
    assert stat.S_IMODE(ws.stat().st_mode) == 0o750


def test_overlay_quota_stops_a_session_filling_the_disk(tmp_path: Path) -> None:
    store = OverlaySnapshotStore(tmp_path / "o", quota_mb=16)
    ws = store.create("w1", OWNER) / "ws"
    try:
        with pytest.raises(OSError) as err, open(ws / "big", "wb") as fh:
            for _ in range(32):
                fh.write(b"x" * (1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
        assert err.value.errno == errno.ENOSPC
        (ws / "big").unlink()
        (ws / "fits").write_bytes(b"y" * (1 << 20))
        store.take("w1", "s1")  # snapshots live inside the quota too, and still work
        store.restore("w1", "s1")
        assert (ws / "fits").stat().st_size == 1 << 20
    finally:
        store.destroy("w1")
        store.release()
    assert not (tmp_path / "o" / "layers" / ".w1.img").exists()
    assert not [p for p in _mountpoints() if p.startswith(str(tmp_path))]


def test_the_sandboxs_files_are_in_its_file_trees_and_every_other_name_is_the_stores(store: SnapshotStore) -> None:
    ws = store.create("w1", OWNER) / "ws"
    # Named as the store names its own entries: still the sandbox's files, found in a file tree.
    names = {"snapshots", "stack.json", "upper", "work", "base", "s1", "s1.json", "w1"}
    for name in names:
        (ws / name).write_text("mine")
    store.take("w1", "s1")
    (ws / "later").write_text("mine")
    store.take("w1", "s2")
    trees = store.file_trees("w1")
    inside = set()
    for root in store.paths("w1"):
        for base, dirs, files in os.walk(root):
            for name in dirs + files:
                path = Path(base) / name
                tree = next((t for t in trees if path.is_relative_to(t) and path != t), None)
                if tree is not None:
                    inside.add(path.relative_to(tree).as_posix())
    # Every tree holds only the sandbox's files (the overlay's whiteout-free layers hold a subset of them).
    assert inside and inside <= names | {"later"}
    assert "later" in inside and names <= inside
    # No file of the sandbox's lies outside a tree: every file there holds the store's own bytes.
    for root in store.paths("w1"):
        for base, _, files in os.walk(root):
            for name in files:
                path = Path(base) / name
                if not any(path.is_relative_to(t) for t in trees) and path.is_file():
                    assert path.read_bytes() != b"mine", path
