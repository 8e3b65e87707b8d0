"""Snapshots exported to the storage every node mounts, so a lost node's session can start again elsewhere.

The overlay store's layers are immutable once a take renames the upper into one, and are named by their
snapshot: an export copies only the layers the shared directory lacks (incremental: a snapshot costs
what changed since the last), then the snapshot's record, last, so a record in the shared directory
always has all its layers. Layout, per workspace (session): `SHARED/<session>/<layer>/` and
`SHARED/<session>/snapshots/<snapshot>.json`; a copy lands under a temporary name and is renamed, so a
node dying mid-copy leaves no half layer.

Importing on another node writes the newest exported snapshot's layers, its record and a stack of it
into that node's store, in the store's own layout; the daemon's recovery (`Sessions.adopt`) mounts it.

The copy backend keeps a whole tree per snapshot, not layers (`export_copies`, `import_copy_session`):
a snapshot's tree is exported as `SHARED/<session>/<snapshot>/`, each regular file that is unchanged
since the session's last exported tree (same size, mtime, mode and owner) a hard link to that tree's
file, so a snapshot costs the shared storage only its changed files, as a layer would. Importing
copies the tree in as the store's snapshot and as the session's workspace (a plain directory there).
Its record says `"backend": "copy"`, and an import refuses a record of the other backend.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path


def _copy_tree(source: Path, target: Path) -> None:
    """`cp -a` (owners, modes, overlay whiteouts and their xattrs) into a temporary name, then rename."""
    partial = target.with_name(f".partial-{target.name}")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(["cp", "-a", "--", str(source), str(partial)], check=True, capture_output=True)
    os.rename(partial, target)


def _records(directory: Path) -> list[dict[str, object]]:
    found = []
    for path in sorted((directory / "snapshots").glob("*.json")):
        with open(path) as fh:
            found.append(json.load(fh))
    return sorted(found, key=lambda r: (float(r["created_at"]), str(r["snapshot_id"])))


def export_store(layers_root: Path, shared: Path) -> int:
    """Export every workspace's new snapshots (and their new layers); returns how many layers were copied."""
    copied = 0
    if not layers_root.is_dir():
        return 0
    for workspace in sorted(p for p in layers_root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out = shared / workspace.name
        (out / "snapshots").mkdir(parents=True, exist_ok=True)
        for record in _records(workspace):
            snapshot_id, layers = str(record["snapshot_id"]), [str(x) for x in record["layers"]]  # type: ignore[attr-defined]
            if (out / "snapshots" / f"{snapshot_id}.json").exists():
                continue
            if not all((workspace / layer).is_dir() for layer in layers):
                continue  # a take in progress (record written, upper not yet renamed): next round
            for layer in layers:
                if not (out / layer).exists():
                    _copy_tree(workspace / layer, out / layer)
                    copied += 1
            partial = out / "snapshots" / f".partial-{snapshot_id}.json"
            partial.write_text(json.dumps(record))
            os.rename(partial, out / "snapshots" / f"{snapshot_id}.json")
    return copied


def export_copies(copies_root: Path, shared: Path) -> int:
    """Copy backend: export every workspace's new snapshot trees; returns how many files were copied (not linked)."""
    copied = 0
    if not copies_root.is_dir():
        return 0
    for workspace in sorted(p for p in copies_root.iterdir() if p.is_dir()):
        out = shared / workspace.name
        (out / "snapshots").mkdir(parents=True, exist_ok=True)
        previous: Path | None = None
        for record in _copy_records(workspace):
            snapshot_id = str(record["snapshot_id"])
            if (out / "snapshots" / f"{snapshot_id}.json").exists():
                previous = out / snapshot_id
                continue
            if not (workspace / snapshot_id).is_dir():
                continue  # a take in progress (its record is written before its tree is renamed): next round
            partial = out / f".partial-{snapshot_id}"
            shutil.rmtree(partial, ignore_errors=True)
            copied += _link_tree(workspace / snapshot_id, partial, previous)
            os.rename(partial, out / snapshot_id)
            shared_record = {**record, "layers": [snapshot_id], "backend": "copy"}
            partial_record = out / "snapshots" / f".partial-{snapshot_id}.json"
            partial_record.write_text(json.dumps(shared_record))
            os.rename(partial_record, out / "snapshots" / f"{snapshot_id}.json")
            previous = out / snapshot_id
    return copied


def _copy_records(workspace: Path) -> list[dict[str, object]]:
    """The copy store's records of a workspace (`<snapshot>.json` beside each tree), oldest first."""
    found = []
    for path in workspace.glob("*.json"):
        with open(path) as fh:
            found.append(json.load(fh))
    return sorted(found, key=lambda r: (float(r["created_at"]), str(r["snapshot_id"])))


def _link_tree(source: Path, target: Path, previous: Path | None) -> int:
    """Copy `source` to `target`, owners and modes kept; an unchanged regular file is a hard link into `previous`.

    Hard links are safe because an exported tree is never written again; they share one inode, so
    nothing may chmod or touch a file of the shared directory in place."""
    copied = 0
    for root, dirs, files in os.walk(source):
        rel = Path(root).relative_to(source)
        (target / rel).mkdir()
        for name in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            here, there = Path(root) / name, target / rel / name
            old = previous / rel / name if previous is not None else None
            if old is not None and _same_file(here, old):
                os.link(old, there)
            else:
                subprocess.run(["cp", "-a", "--", str(here), str(there)], check=True, capture_output=True)
                copied += 1
    for root, _dirs, _files in os.walk(source, topdown=False):  # a directory's times after its entries
        rel = Path(root).relative_to(source)
        st = os.lstat(root)
        os.chown(target / rel, st.st_uid, st.st_gid)
        shutil.copystat(root, target / rel)
    return copied


def _same_file(here: Path, old: Path) -> bool:
    """Whether `old` (an exported file) holds what `here` does, by its metadata, as rsync decides by default."""
    try:
        a, b = os.lstat(here), os.lstat(old)
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(a.st_mode) and (a.st_mode, a.st_size, a.st_mtime_ns, a.st_uid, a.st_gid)
            == (b.st_mode, b.st_size, b.st_mtime_ns, b.st_uid, b.st_gid))


def import_copy_session(shared: Path, store_root: Path, session_id: str) -> str:
    """Copy backend: write the session's newest exported tree into a copy store as its snapshot and its
    workspace (a copy store's workspace is a plain directory, not a mount); returns the snapshot's id."""
    record = _newest(shared, session_id, "copy")
    snapshot_id = str(record["snapshot_id"])
    target, mount = store_root / "copies" / session_id, store_root / "mounts" / session_id
    if target.exists() or mount.exists():
        raise FileExistsError(f"{target} or {mount} exists: the session has a workspace on this node already")
    for where, into in ((store_root / "copies", Path(snapshot_id)), (store_root / "mounts", Path("ws"))):
        partial = where / f".partial-{session_id}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        subprocess.run(["cp", "-a", "--", str(shared / session_id / snapshot_id), str(partial / into)], check=True,
                       capture_output=True)
        if into.name == snapshot_id:
            (partial / f"{snapshot_id}.json").write_text(json.dumps(
                {"snapshot_id": snapshot_id, "created_at": record["created_at"]}))
        os.rename(partial, where / session_id)
    return snapshot_id


def _newest(shared: Path, session_id: str, backend: str) -> dict[str, object]:
    """The newest exported record of the session; FileNotFoundError if none, ValueError if of another backend."""
    source = shared / session_id
    records = _records(source) if (source / "snapshots").is_dir() else []
    if not records:
        raise FileNotFoundError(f"no exported snapshot of {session_id} in {shared}")
    exported = str(records[-1].get("backend", "overlay"))
    if exported != backend:
        raise ValueError(f"{session_id} was exported by the {exported} backend; this node uses {backend}")
    return records[-1]


def last_exported(shared: Path, session_id: str) -> str | None:
    """The newest snapshot of the session whose record (and so every layer) reached the shared directory."""
    directory = shared / session_id
    records = _records(directory) if (directory / "snapshots").is_dir() else []
    return str(records[-1]["snapshot_id"]) if records else None


def import_session(shared: Path, layers_root: Path, session_id: str) -> str:
    """Write the session's newest exported snapshot into a store's layout; returns its id."""
    source = shared / session_id
    record = _newest(shared, session_id, "overlay")
    target = layers_root / session_id
    if target.exists():
        raise FileExistsError(f"{target} exists: the session has a workspace on this node already")
    partial = layers_root / f".partial-{session_id}"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "snapshots").mkdir(parents=True)
    for layer in record["layers"]:  # type: ignore[attr-defined]
        subprocess.run(["cp", "-a", "--", str(source / layer), str(partial / layer)], check=True, capture_output=True)
    (partial / "snapshots" / f"{record['snapshot_id']}.json").write_text(json.dumps(record))
    (partial / "stack.json").write_text(json.dumps(record["layers"]))
    os.rename(partial, target)  # no upper: recovery makes a fresh one on the stack's top and mounts it
    (layers_root.parent / "mounts" / session_id / "ws").mkdir(parents=True, exist_ok=True)  # where it mounts
    return str(record["snapshot_id"])
