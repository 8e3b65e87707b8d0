"""Each session's Ray placement group: one bundle holding its sandbox's CPU and memory while it is open.

A new session's group is placed by Ray's scheduler, and the session opened on the node Ray chose. A
fork's sandbox runs on its parent's node, so its group is pinned there by the `ray.io/node-id` label
every Ray node carries (Ray 2.60). `_soft_target_node_id` was the other way to pin a group, and is not
used: it is a hint, so with no room on that node Ray would reserve the bundle elsewhere, holding
resources on a node where nothing runs and none where the fork does.
"""

from __future__ import annotations

import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from sandboxd.errors import SandboxUnavailable

#: how long a new session may wait for Ray to find room for its sandbox
PLACEMENT_TIMEOUT_S = 60.0


class Placements:
    """The groups of the door's sessions, by session id; a group is removed when its session goes."""

    def __init__(self, cpus: float, memory_mb: int) -> None:
        self.bundle = {"CPU": cpus, "memory": memory_mb * 1024 * 1024}
        self.groups: dict[str, PlacementGroup] = {}
        self._lock = threading.Lock()

    def reserve(self, on: str | None = None) -> tuple[PlacementGroup, str]:
        """A ready group for one sandbox and the node it is on: where Ray finds room, or on node `on`.

        SandboxUnavailable (details: `node`) if Ray finds no room within PLACEMENT_TIMEOUT_S."""
        selector = [{"ray.io/node-id": on}] if on is not None else None
        group = placement_group([dict(self.bundle)], strategy="STRICT_PACK", bundle_label_selector=selector)
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as exc:
            remove_placement_group(group)  # a pending group would be placed later, for nobody
            where = f"node {on}" if on is not None else "no node"
            raise SandboxUnavailable(f"{where} has no room for a sandbox of {self.bundle} ({exc})", node=on) from exc
        return group, str(placement_group_table(group)["bundles_to_node_id"][0])

    def keep(self, session_id: str, group: PlacementGroup) -> None:
        """`group` holds `session_id`'s sandbox from now until `release`."""
        with self._lock:
            self.groups[session_id] = group

    def release(self, session_id: str) -> None:
        """Give the session's resources back to Ray (no group: nothing to do)."""
        with self._lock:
            group = self.groups.pop(session_id, None)
        if group is not None:
            remove_placement_group(group)

    def release_all(self) -> None:
        with self._lock:
            groups, self.groups = list(self.groups.values()), {}
        for group in groups:
            remove_placement_group(group)
