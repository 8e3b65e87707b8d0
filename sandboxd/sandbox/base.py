"""Where a session's tools run: the one interface of sandboxes, whatever isolates them.

`ContainerManager` (sandboxd/sandbox/containers.py) is the real one: a hardened Docker container per
session, with the executor inside. `LocalSandbox` (sandboxd/sandbox/local.py) runs the same executor
code in the daemon's process on a temporary directory, with no isolation at all: it exists so the core
logic (calls, snapshots, provenance, revocation) is tested in seconds without an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sandboxd.revocation.leakscan import LeakReport


class Sandbox(Protocol):
    """One sandbox per session, its workspace bound from the snapshot store's mount root."""

    def image_exists(self, image: str) -> bool:
        """Whether a session can be opened on this image."""
        ...

    def owner(self) -> tuple[int, int]:
        """uid and gid that own the workspace inside the sandbox."""
        ...

    def create(self, session_id: str, image: str, mount_root: Path, propagation: str) -> str:
        """Create and start the session's sandbox; returns its id once its executor answers."""
        ...

    def remove(self, session_id: str) -> None:
        """Remove the session's sandbox; a missing one is fine."""
        ...

    def stop(self, session_id: str) -> None:
        """Stop the session's sandbox, keeping it (`ensure_running` starts it again); a missing one is fine."""
        ...

    def ensure_running(self, session_id: str) -> bool:
        """Start (or restart) a sandbox that stopped or stopped answering; False when it no longer exists."""
        ...

    def request(self, session_id: str, payload: dict[str, Any], timeout: float,
                on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """One executor request (raises SandboxUnavailable when the sandbox does not answer); a streamed
        call's output goes to `on_output(stream, text)` as it comes, where the sandbox can stream."""
        ...

    def read_now(self, session_id: str, payload: dict[str, Any], at_most: int) -> dict[str, Any] | None:
        """What `request` answers to a read_file or list_dir payload, where that can be had without waiting
        on anything and the file holds at most `at_most` bytes (a directory, entries); else None."""
        ...

    def stop_cause(self, session_id: str) -> dict[str, Any]:
        """Why the sandbox stopped, asked once its channel broke: `oom_killed` (the whole sandbox was stopped
        for running out of memory) and `exit_code`; empty while it runs or where nothing is known."""
        ...

    def sessions(self) -> list[str]:
        """Sessions that have a sandbox of this daemon, running or not."""
        ...

    def scan_scratch(self, session_id: str, needles: list[bytes]) -> LeakReport:
        """Byte-scan what only the sandbox holds (its scratch tmpfs)."""
        ...
