"""Filesystem snapshots of sandbox workspaces: one interface (`SnapshotStore`), two backends."""

from __future__ import annotations

from pathlib import Path

from snapshots.base import (
    RestoreResult,
    SnapshotError,
    SnapshotRecord,
    SnapshotStore,
    TakeResult,
    UnknownSnapshot,
)

__all__ = [
    "RestoreResult",
    "SnapshotError",
    "SnapshotRecord",
    "SnapshotStore",
    "TakeResult",
    "UnknownSnapshot",
    "open_store",
]


def open_store(kind: str, root: Path, max_layers: int = 64) -> SnapshotStore:
    """The store backend named `kind` ("overlay" or "copy") rooted at `root`."""
    if kind == "overlay":
        from snapshots.overlay import OverlaySnapshotStore

        return OverlaySnapshotStore(root, max_layers=max_layers)
    if kind == "copy":
        from snapshots.copy import CopySnapshotStore

        return CopySnapshotStore(root)
    raise SnapshotError(f"unknown snapshot backend {kind!r}; use 'overlay' or 'copy'")
