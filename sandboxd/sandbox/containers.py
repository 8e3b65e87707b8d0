"""One hardened Docker container per session, with the executor running inside it.

Containers are created through the Docker SDK. Each is locked down by default: no network, every
capability dropped, `no-new-privileges`, a read-only root filesystem, a tmpfs `/tmp`, limits on
pids, memory (swap included) and CPU, and a non-root user. The only writable persistent place is
the workspace, bound from the snapshot store's mount root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

import docker.errors
from docker.types import Mount, Ulimit

import docker
from sandboxd.config import DaemonConfig
from sandboxd.errors import SandboxUnavailable
from sandboxd.sandbox.channel import ExecutorChannel

SOCKET_IN_CONTAINER = "/run/sandboxd/exec.sock"
LABEL_SESSION = "sandboxd.session"
LABEL_INSTANCE = "sandboxd.instance"


class ContainerManager:
    """Creates, starts, finds and removes session containers of one daemon instance."""

    def __init__(self, config: DaemonConfig, client: docker.DockerClient | None = None) -> None:
        self.config = config
        self.client = client or docker.from_env(timeout=60)
        self.state = config.state_path
        # Containers carry the state directory's fingerprint, so two daemons on one engine never
        # adopt or reap each other's sandboxes.
        self.instance = hashlib.sha256(str(self.state).encode()).hexdigest()[:16]
        self.bin_dir = self.state / "bin"
        self.ctl_root = self.state / "ctl"
        self._channels: dict[str, ExecutorChannel] = {}
        self._lock = threading.Lock()
        self._install_executor()

    def _install_executor(self) -> None:
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        source = resources.files("sandboxd.sandbox").joinpath("executor.py")
        target = self.bin_dir / "executor.py"
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(source.read_bytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)

    def name(self, session_id: str) -> str:
        return f"sandboxd-{self.instance[:8]}-{session_id}"

    def owner(self) -> tuple[int, int]:
        uid, _, gid = self.config.sandbox.user.partition(":")
        return int(uid), int(gid or uid)

    def create(self, session_id: str, image: str, mount_root: Path, propagation: str) -> str:
        """Create and start the session's container; return its id once the executor answers."""
        limits = self.config.sandbox
        ctl = self.ctl_root / session_id
        ctl.mkdir(parents=True, exist_ok=True)
        os.chown(ctl, *self.owner())
        os.chmod(ctl, 0o700)
        mounts = [
            Mount(target="/sandbox", source=str(mount_root), type="bind", propagation=propagation),
            Mount(target="/run/sandboxd", source=str(ctl), type="bind"),
            Mount(target="/opt/sandboxd", source=str(self.bin_dir), type="bind", read_only=True),
        ]
        try:
            container = self.client.containers.run(
                image,
                ["python3", "-I", "-u", "/opt/sandboxd/executor.py", "--socket", SOCKET_IN_CONTAINER],
                name=self.name(session_id),
                detach=True,
                user=limits.user,
                network_mode="bridge" if limits.network else "none",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                read_only=True,
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,mode=1777"},
                mounts=mounts,
                pids_limit=limits.pids,
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(limits.cpus * 1e9),
                ulimits=[Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile)],
                init=True,
                working_dir="/",
                environment={"HOME": "/tmp"},
                labels={LABEL_SESSION: session_id, LABEL_INSTANCE: self.instance},
            )
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailable(f"image {image!r} not found; build it with `make image`", image=image) from exc
        except docker.errors.APIError as exc:
            raise SandboxUnavailable(f"could not create the sandbox: {exc.explanation or exc}") from exc
        self._wait_ready(session_id, container)
        return str(container.id)

    def _wait_ready(self, session_id: str, container: Any) -> None:
        """Wait for the executor's first answer; a container that exits meanwhile fails fast."""
        deadline = time.monotonic() + 15.0
        while True:
            try:
                self.channel(session_id).wait_ready(timeout=0.5)
                return
            except SandboxUnavailable:
                container.reload()
                if container.status not in ("created", "running") or time.monotonic() > deadline:
                    tail = container.logs(tail=5).decode(errors="replace").strip()
                    raise SandboxUnavailable(f"sandbox executor did not start (container {container.status}): "
                                             f"{tail or 'no output'}", session_id=session_id) from None

    def channel(self, session_id: str) -> ExecutorChannel:
        """The (cached) executor channel of a session."""
        with self._lock:
            chan = self._channels.get(session_id)
            if chan is None:
                chan = ExecutorChannel(self.ctl_root / session_id / "exec.sock")
                self._channels[session_id] = chan
            return chan

    def ensure_running(self, session_id: str) -> bool:
        """Start the session's container if it stopped, restart it if its executor does not answer;
        False when it no longer exists."""
        try:
            container = self.client.containers.get(self.name(session_id))
        except docker.errors.NotFound:
            return False
        if container.status != "running":
            self.channel(session_id).close()
            container.start()
            self._wait_ready(session_id, container)
        elif not self._answers(session_id):
            # Running but deaf: the executor serves one connection at a time and is still busy with a
            # call whose daemon was killed (it would hold the session until that call's timeout).
            # A restart kills the call and everything it started; the workspace is a bind mount.
            self.channel(session_id).close()
            container.restart(timeout=0)
            self._wait_ready(session_id, container)
        return True

    def _answers(self, session_id: str) -> bool:
        try:
            self.channel(session_id).request({"op": "ping"}, timeout=2.0)
        except SandboxUnavailable:
            return False
        return True

    def remove(self, session_id: str) -> None:
        """Remove the container and its control directory; a missing container is fine."""
        with self._lock:
            chan = self._channels.pop(session_id, None)
        if chan is not None:
            chan.close()
        try:
            self.client.containers.get(self.name(session_id)).remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        shutil.rmtree(self.ctl_root / session_id, ignore_errors=True)

    def container(self, session_id: str) -> Any:
        """The session's Docker container, or None."""
        try:
            return self.client.containers.get(self.name(session_id))
        except docker.errors.NotFound:
            return None

    def sessions_with_containers(self) -> list[str]:
        """Session ids that have a container of this instance, running or not."""
        found = self.client.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={self.instance}"})
        return [c.labels[LABEL_SESSION] for c in found if LABEL_SESSION in c.labels]

    def image_exists(self, image: str) -> bool:
        try:
            self.client.images.get(image)
        except docker.errors.NotFound:  # ImageNotFound, or a bare 404 when the name breaks the API's route
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 400:  # not even a valid reference ("invalid reference format")
                return False
            raise
        return True
