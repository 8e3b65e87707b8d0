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


def open_store(kind: str, root: Path, max_layers: int = 64, quota_mb: int = 0) -> SnapshotStore:
    """The store backend named `kind` ("overlay" or "copy") rooted at `root`; quota_mb 0 means none."""
    if kind == "overlay":
        from snapshots.overlay import OverlaySnapshotStore

        return OverlaySnapshotStore(root, max_layers=max_layers, quota_mb=quota_mb)
    if kind == "copy":
        from snapshots.copy import CopySnapshotStore

        return CopySnapshotStore(root)
    raise SnapshotError(f"unknown snapshot backend {kind!r}; use 'overlay' or 'copy'")
