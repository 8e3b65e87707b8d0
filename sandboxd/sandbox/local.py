"""A sandbox in the daemon's own process, on a temporary directory: for tests of the core logic only.

It runs the executor's own code (sandboxd/sandbox/executor.py) in-process, on the workspace the
snapshot store made, so calls, snapshots, provenance and revocations behave as with containers while
a test needs no engine and takes milliseconds. It isolates nothing: a tool runs as the daemon's user
on the host. `sandboxd serve` never uses it (DaemonConfig has no setting for it); tests build it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxd.errors import SandboxUnavailable
from sandboxd.revocation.leakscan import LeakReport, scan_paths
from sandboxd.sandbox import executor


class LocalSandbox:
    """`Sandbox` over directories of this process; see the module docstring for what it is not."""

    def __init__(self, scratch_root: Path) -> None:
        self.scratch_root = scratch_root
        self._workspaces: dict[str, Path] = {}
        self._lock = threading.Lock()
        self.stopped: set[str] = set()
        """Sessions whose sandbox a test stopped: their requests fail as a dead container's do."""

    def image_exists(self, image: str) -> bool:
        return True

    def owner(self) -> tuple[int, int]:
        return os.getuid(), os.getgid()

    def create(self, session_id: str, image: str, mount_root: Path, propagation: str) -> str:
        with self._lock:
            self._workspaces[session_id] = mount_root / "ws"
        (self.scratch_root / session_id).mkdir(parents=True, exist_ok=True)
        return f"local-{session_id}"

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._workspaces.pop(session_id, None)
        shutil.rmtree(self.scratch_root / session_id, ignore_errors=True)

    def stop(self, session_id: str) -> None:
        """Its requests fail as a stopped container's do until `ensure_running`."""
        self.stopped.add(session_id)

    def ensure_running(self, session_id: str) -> bool:
        self.stopped.discard(session_id)
        return session_id in self._workspaces

    def request(self, session_id: str, payload: dict[str, Any], timeout: float,
                on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """As a container's executor would answer; nothing is streamed (`on_output` is never called)."""
        with self._lock:
            workspace = self._workspaces.get(session_id)
        if workspace is None or session_id in self.stopped:
            raise SandboxUnavailable(f"the local sandbox of {session_id} is not running", session_id=session_id)
        op = payload.get("op")
        if op == "reap":
            return {"ok": True}  # a call's processes end with it here; nothing of the host may be reaped
        if op == "clear_scratch":
            scratch = self.scratch_root / session_id
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            return {"ok": True, "removed": 0}
        token = executor._workspace.set(str(workspace))
        try:
            return executor.handle(json.dumps(payload).encode())
        finally:
            executor._workspace.reset(token)

    def read_now(self, session_id: str, payload: dict[str, Any], at_most: int) -> dict[str, Any] | None:
        """As `request` answers a read that succeeds, when it is small: a file's size or a listing's entries
        at most `at_most` (measured after the read: nothing here can block)."""
        if payload.get("op") not in ("read_file", "list_dir") or payload.get("recursive"):
            return None
        try:
            reply = self.request(session_id, payload, 0.0)
        except SandboxUnavailable:
            return None
        size = reply.get("stdout_size") if payload["op"] == "read_file" else str(reply.get("stdout")).count("\n") + 1
        return reply if "error" not in reply and isinstance(size, int) and size <= at_most else None

    def stop_cause(self, session_id: str) -> dict[str, Any]:
        return {}

    def sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._workspaces)

    def scan_scratch(self, session_id: str, needles: list[bytes]) -> LeakReport:
        return scan_paths(needles, [self.scratch_root / session_id])
