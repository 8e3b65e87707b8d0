"""One hardened Docker container per session, with the executor running inside it.

Containers are created through the Docker SDK. Each is locked down by default: no network, every
capability dropped, `no-new-privileges`, a read-only root filesystem, a tmpfs `/tmp`, limits on
pids, memory (swap included) and CPU, and a non-root user. The only writable persistent place is
the workspace, bound from the snapshot store's mount root.

Under runsc (gVisor) the same options hold, and the runtime must be registered with the arguments
`sandboxd.sandbox.runsc.RUNSC_ARGS` (docker/ensure-runsc.sh does it); see `check_runtime`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import docker.errors
import msgspec
import requests
from docker.types import Mount, Ulimit

import docker
from sandboxd.config import DaemonConfig
from sandboxd.errors import SandboxUnavailable
from sandboxd.revocation.leakscan import LeakReport, scan_inside, scan_paths
from sandboxd.sandbox.channel import ExecutorChannel
from sandboxd.sandbox.hostread import HostReader
from sandboxd.sandbox.runsc import HOST_TASKS_PER_PID, RUNSC_ARGS, halt, runsc_seccomp_profile
from sandboxd.sandbox.usage import start_time
from snapshots.base import write_atomic

SOCKET_IN_CONTAINER = "/run/sandboxd/exec.sock"
LABEL_SESSION = "sandboxd.session"
LABEL_INSTANCE = "sandboxd.instance"
#: scratch mounts of a sandbox: tmpfs, outside every snapshot, and held only by the container
SCRATCH_PATHS = ("/tmp", "/dev/shm")

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
        self._inits: dict[str, tuple[int, str]] = {}
        """Each running sandbox's init process as last seen: pid and start time (see `_root`)."""
        self.runtime = config.sandbox.runtime
        self._install_executor()
        self._workspaces: dict[str, Path | None] = {}
        self._host_reader = self._make_host_reader()

    def check_runtime(self) -> None:
        """Refuse to start on an engine that does not offer the configured runtime as sandboxes need it."""
        if self.runtime == "runc":
            return
        registered = (self.client.info().get("Runtimes") or {}).get(self.runtime)
        fix = "run docker/ensure-runsc.sh (or `make engine`), which registers it"
        if registered is None:
            raise SandboxUnavailable(f"the Docker engine has no runtime {self.runtime!r}: {fix}")
        args = registered.get("runtimeArgs") or []
        missing = [f"{arg} ({why})" for arg, why in RUNSC_ARGS.items() if arg not in args]
        if missing:
            raise SandboxUnavailable(f"the engine's {self.runtime} runtime lacks {', '.join(missing)}: {fix}")

    def _make_host_reader(self) -> HostReader | None:
        """Reads served from the host where they are the executor's own (see sandboxd.sandbox.hostread)."""
        if self.runtime != "runc":
            return None
        if any("userns" in option for option in self.client.info().get("SecurityOptions") or []):
            return None
        reader = HostReader(*self.owner())
        return reader if reader.usable else None

    def _install_executor(self) -> None:
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        source = resources.files("sandboxd.sandbox").joinpath("executor.py")
        target = self.bin_dir / "executor.py"
        write_atomic(target, lambda fh: fh.write(source.read_bytes()))
        os.chmod(target, 0o644)

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
        self._clear_socket(session_id)
        os.chown(ctl, *self.owner())
        os.chmod(ctl, 0o700)
        mounts = [
            Mount(target="/sandbox", source=str(mount_root), type="bind", propagation=propagation),
            Mount(target="/run/sandboxd", source=str(ctl), type="bind"),
            Mount(target="/opt/sandboxd", source=str(self.bin_dir), type="bind", read_only=True),
        ]
        # runc enforces the engine's default seccomp profile; runsc is given it (see runsc_seccomp_profile)
        seccomp = [f"seccomp={runsc_seccomp_profile()}"] if self.runtime == "runsc" else []
        try:
            container = self.client.containers.run(
                image,
                ["python3", "-I", "-u", "/opt/sandboxd/executor.py", "--socket", SOCKET_IN_CONTAINER],
                name=self.name(session_id),
                runtime=self.runtime,
                detach=True,
                user=limits.user,
                network_mode="bridge" if limits.network else "none",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges", *seccomp],
                read_only=True,
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,mode=1777"},
                mounts=mounts,
                pids_limit=limits.pids * (HOST_TASKS_PER_PID if self.runtime == "runsc" else 1),
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(limits.cpus * 1e9),
                ulimits=self._ulimits(),
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
        with self._lock:
            self._workspaces[session_id] = mount_root / "ws"
        return str(container.id)

    def _clear_socket(self, session_id: str) -> None:
        # A socket left by an executor that is gone: under gVisor it is a host socket file, which a new
        # executor can neither see through the file proxy nor bind over.
        (self.ctl_root / session_id / "exec.sock").unlink(missing_ok=True)

    def _ulimits(self) -> list[Ulimit]:
        limits = self.config.sandbox
        ulimits = [Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile)]
        if self.runtime == "runsc":
            ulimits.append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
        return ulimits

    def stop_cause(self, session_id: str) -> dict[str, Any]:
        """Whether the session's container was stopped by the OOM killer (a whole gVisor sandbox is; under runc
        the OOM killer takes the tool, its oom_score_adj 1000, which the executor reports), and its exit code."""
        container = self.container(session_id)
        if container is None:
            return {}
        # Only on a broken channel; the engine marks the container exited a moment after its sandbox died, and a
        # loaded engine takes its time (gVisor's more). A channel that timed out has a container still running.
        deadline = time.monotonic() + (10.0 if self.runtime == "runsc" else 2.0)
        while container.status == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
            container.reload()
        if container.status == "running":
            return {}
        state = container.attrs.get("State", {})
        return {"oom_killed": bool(state.get("OOMKilled")), "exit_code": int(state.get("ExitCode") or 0)}

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

    def request(self, session_id: str, payload: dict[str, Any], timeout: float,
                on_output: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """One request to the session's executor (a read the host can answer as it would: answered so)."""
        channel = self.channel(session_id)
        reader, op = self._host_reader, payload.get("op")
        read = (reader.read_file if op == "read_file" else reader.list_dir if op == "list_dir" else None) \
            if reader is not None else None
        # Only while the executor is connected and alive, so a dead sandbox fails a read as it fails a shell.
        if read is not None and channel.alive() and (workspace := self._workspace(session_id)) is not None:
            if (reply := read(workspace, payload)) is not None:
                return reply
        return channel.request(payload, timeout, on_output)

    def _restart(self, session_id: str, container: Any) -> None:
        """Start a sandbox again, stopped at once first if it runs (the workspace is a bind mount: it stays)."""
        self.channel(session_id).close()
        if container.status == "running":
            self._halt(session_id, container)
        self._clear_socket(session_id)
        container.start()
        self._wait_ready(session_id, container)

    def _halt(self, session_id: str, container: Any) -> None:
        """Stop a running sandbox now: its processes end (see `sandboxd.sandbox.runsc.halt` for gVisor's)."""
        if self.runtime == "runsc" and (pid := self._init_pid(session_id)) is not None:
            halt(pid)
            try:
                # Not the engine's stop: it would ask runsc to kill a sandbox that is gone, which took 23 s.
                container.wait(timeout=30)
                return
            except requests.RequestException:
                pass
        container.stop(timeout=0)

    def read_now(self, session_id: str, payload: dict[str, Any], at_most: int) -> dict[str, Any] | None:
        """The host's answer to a read as `request` would give it, or None: only where nothing can wait (no
        engine lookup, no executor, a channel no request holds) and the read is small (`at_most`)."""
        reader, op = self._host_reader, payload.get("op")
        with self._lock:
            workspace, channel = self._workspaces.get(session_id), self._channels.get(session_id)
        if reader is None or workspace is None or channel is None or not channel.alive(wait=False):
            return None
        read = reader.read_file if op == "read_file" else reader.list_dir if op == "list_dir" else None
        return read(workspace, payload, at_most) if read is not None else None

    def _workspace(self, session_id: str) -> Path | None:
        """The host directory that is the session's /workspace: from `create`, or after a daemon restart from
        the container's bind of /sandbox, once the directory the engine names is seen to be the one the
        container holds (None where it is not: the daemon may see the host's paths otherwise than the engine)."""
        with self._lock:
            if session_id in self._workspaces:
                return self._workspaces[session_id]
        container, workspace = self.container(session_id), None
        if container is not None and container.status == "running":
            mounts = container.attrs.get("Mounts") or []
            root = next((m.get("Source") for m in mounts if m.get("Destination") == "/sandbox"), None)
            try:
                here, there = os.stat(str(root)), os.stat(f"/proc/{container.attrs['State']['Pid']}/root/sandbox")
                if root and (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                    workspace = Path(root) / "ws"
            except (OSError, KeyError):
                pass
        with self._lock:
            self._workspaces[session_id] = workspace
        return workspace

    def ensure_running(self, session_id: str) -> bool:
        """Start the session's container if it stopped, restart it if its executor does not answer;
        False when it no longer exists."""
        try:
            container = self.client.containers.get(self.name(session_id))
        except docker.errors.NotFound:
            return False
        # Running but deaf: the executor serves one connection at a time and is still busy with a call whose
        # daemon was killed (it would hold the session until that call's timeout). A restart kills the call
        # and everything it started; the workspace is a bind mount.
        if container.status != "running" or not self._answers(session_id):
            self._restart(session_id, container)
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
            self._workspaces.pop(session_id, None)
        if chan is not None:
            chan.close()
        container = self.container(session_id)
        if container is not None:
            if container.status == "running":
                self._halt(session_id, container)
            try:
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass
        shutil.rmtree(self.ctl_root / session_id, ignore_errors=True)

    def stop(self, session_id: str) -> None:
        """Stop the container (its processes end); the next `ensure_running` starts it with fresh binds."""
        with self._lock:
            chan = self._channels.pop(session_id, None)
        if chan is not None:
            chan.close()
        container = self.container(session_id)
        if container is not None and container.status == "running":
            self._halt(session_id, container)

    def container(self, session_id: str) -> Any:
        """The session's Docker container, or None."""
        try:
            return self.client.containers.get(self.name(session_id))
        except docker.errors.NotFound:
            return None

    def scan_scratch(self, session_id: str, needles: list[bytes]) -> LeakReport:
        """Byte-scan the sandbox's scratch tmpfs mounts, which only the container holds; hits are located
        by their paths in the container. A stopped container's tmpfs is gone, and with it what it held."""
        if self.runtime == "runsc":
            container = self.container(session_id)
            if container is None or container.status != "running":
                return LeakReport()
            # gVisor keeps a tmpfs in its own kernel's memory: on the host, /proc/PID/root of the
            # sandbox process is an empty directory, and a scan there would find nothing and say clean.
            return scan_inside(container, needles, SCRATCH_PATHS)
        # runc: read through the container's root as the host sees it, without a round of Docker API calls.
        root = self._root(session_id)
        if root is None:
            return LeakReport()
        report = scan_paths(needles, [Path(root + path) for path in SCRATCH_PATHS])
        report.hits = [msgspec.structs.replace(hit, location=hit.location.removeprefix(root)) for hit in report.hits]
        return report

    def _root(self, session_id: str) -> str | None:
        """The running sandbox's root as the host sees it (`/proc/PID/root`), or None when it is not running.

        Asking the engine for the pid cost more than the scan it served (an inspect on every revocation),
        so the init process is remembered with its start time: the same pid with the same start time is
        the same process, and a sandbox that stopped or was started again has another (a pid reused by
        some other process has another start time)."""
        pid = self._init_pid(session_id)
        return f"/proc/{pid}/root" if pid is not None else None

    def _init_pid(self, session_id: str) -> int | None:
        """The host pid of the running sandbox's init process (see `_root`), or None."""
        known = self._inits.get(session_id)
        if known is not None and start_time(known[0]) == known[1]:
            return known[0]
        container = self.container(session_id)
        pid = int(container.attrs["State"]["Pid"]) if container is not None and container.status == "running" else 0
        started = start_time(pid) if pid else None
        if started is None:
            self._inits.pop(session_id, None)
            return None
        self._inits[session_id] = (pid, started)
        return pid

    def sessions(self) -> list[str]:
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

