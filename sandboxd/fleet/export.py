"""Snapshots exported to the storage every node mounts, so a lost node's session can start again elsewhere.

The overlay store's layers are immutable once a take renames the upper into one, and are named by their
snapshot: an export copies only the layers the shared directory lacks (incremental: a snapshot costs
what changed since the last), then the snapshot's record, last, so a record in the shared directory
always has all its layers. Layout, per workspace (session): `SHARED/<session>/<layer>/` and
`SHARED/<session>/snapshots/<snapshot>.json`; a copy lands under a temporary name and is renamed, so a
node dying mid-copy leaves no half layer.

Importing on another node writes the newest exported snapshot's layers, its record and a stack of it
into that node's store, in the store's own layout; the daemon's recovery (`Sessions.adopt`) mounts it.
Only the overlay backend is exported (the copy backend keeps whole trees, not layers): a fleet with a
shared directory refuses a configuration naming the copy backend at start (`NodeSpec.check`), rather
than serve sessions it could not re-create. Exporting copy trees incrementally (hard links to the last
exported tree for unchanged files) would lift that; it is not written.
"""

from __future__ import annotations

import json
import os
import shutil
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


def last_exported(shared: Path, session_id: str) -> str | None:
    """The newest snapshot of the session whose record (and so every layer) reached the shared directory."""
    directory = shared / session_id
    records = _records(directory) if (directory / "snapshots").is_dir() else []
    return str(records[-1]["snapshot_id"]) if records else None


def import_session(shared: Path, layers_root: Path, session_id: str) -> str:
    """Write the session's newest exported snapshot into a store's layout; returns its id."""
    source = shared / session_id
    records = _records(source) if (source / "snapshots").is_dir() else []
    if not records:
        raise FileNotFoundError(f"no exported snapshot of {session_id} in {shared}")
    record = records[-1]
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
