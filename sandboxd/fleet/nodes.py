"""One sandboxd daemon per Ray node: an actor pinned to the node starts it and owns it.

The daemon is a `sandboxd serve` child of the actor's worker process with the parent-death signal set
to SIGKILL: when Ray loses the node (its raylet and workers die), the daemon dies with it, mid-call if
it was in one, exactly as on a machine that went away. Its sessions carry the Ray node id as their
node (`--node-id`), which is how the front door routes them and how their loss is recorded.

Where a daemon listens: with the fleet's key directory (`NodeSpec.keys_dir`, see `fleet.keys`), on
tcp://<its Ray node's IP>:<port> with CURVE, admitting only the door, so the door reaches nodes on
any host and a node's port is no open door into its sandboxes. Without one, on an ipc:// socket in
its state directory: the socket's file mode is its authentication and there are no keys to hand out,
but only a door on the same host can reach it, so the door refuses a node on another host
(`check_reachable`). ipc stays the default because a one-host fleet (tests, a workstation, a big
machine cut into Ray nodes) then needs no key material at all; a fleet over several hosts names a
key directory, and is tcp+CURVE throughout. Either way the actor itself talks to its daemon on the
daemon's ipc socket (a tcp daemon serves one for its owner too).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sandboxd import protocol as p
from sandboxd.client import Client, DaemonUnreachable
from sandboxd.config import load_config
from sandboxd.fleet.export import export_copies, export_store, import_copy_session, import_session
from sandboxd.fleet.keys import FleetKeys, node_config_text

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class NodeSpec:
    """How every node's daemon is started: the shared state, where node state dirs go, its options."""

    state: str
    """postgresql:// URL of the one state database."""
    state_root: str
    """Each node's daemon gets STATE_ROOT/<node id> (node-local: snapshot layers, sockets, log)."""
    config: str = ""
    """A TOML configuration every daemon reads (firewall adapters, limits), or none."""
    runtime: str = "runc"
    shared_dir: str = ""
    """Storage every node mounts: snapshots are exported there, and lost sessions re-created from it."""
    export_every_s: float = 0.5
    keys_dir: str = ""
    """The fleet's key directory (`fleet.keys`), on storage every node reads: given, daemons listen on tcp://
    with CURVE; empty, on ipc:// sockets, which only a door on the same host can reach."""
    port: int = 0
    """tcp: the port every daemon binds on its node's IP (0: a free one each, as two Ray nodes may share a host)."""

    def check(self) -> None:
        """Refuse, with the reason, a spec whose daemons could not do what the fleet promises; ValueError."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not a TCP port")
        if self.port and not self.keys_dir:
            raise ValueError("a node port is for tcp nodes: give the fleet's key directory too")
        load_config(Path(self.config) if self.config else None)  # a bad file stops the door, not every node


class NodeDaemon:
    """The actor (made remote by `start_node`): starts the node's daemon, answers where it listens."""

    def __init__(self, spec: NodeSpec, node_id: str) -> None:
        self.node_id = node_id
        self.state_dir = Path(spec.state_root) / node_id[:16]
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        self.local = f"ipc://{self.state_dir / 'sandboxd.sock'}"
        self.endpoint, config = self.local, spec.config
        if spec.keys_dir:
            ip = ray.util.get_node_ip_address()
            host = f"[{ip}]" if ":" in ip else ip
            self.endpoint = f"tcp://{host}:{spec.port or _free_port(ip)}"
            config = str(self.state_dir.parent / f"{node_id[:16]}.toml")
            user = Path(spec.config) if spec.config else None
            # 0600: it may name the state database's URL, password included, as the user's file did.
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
            with os.fdopen(fd, "w") as fh:
                fh.write(node_config_text(user, FleetKeys(Path(spec.keys_dir))))
        argv = [sys.executable, "-m", "sandboxd.cli", "serve", "--state-dir", str(self.state_dir),
                "--state", spec.state, "--node-id", node_id, "--runtime", spec.runtime, "--endpoint", self.endpoint]
        if config:
            argv += ["--config", config]
        self.backend = load_config(Path(config) if config else None, state_dir=str(self.state_dir),
                                   endpoint=self.endpoint).snapshot_backend
        stderr = self.state_dir.parent / f"{node_id[:16]}.stderr"
        log = open(stderr, "ab")  # noqa: SIM115  (the child's)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon of node {node_id} exited with {self.proc.returncode}; see {stderr}")
            try:
                with Client(self.local, timeout_s=0.5) as probe:
                    probe.health()
                self._start_export(spec)
                return
            except DaemonUnreachable:
                continue
        raise RuntimeError(f"the daemon of node {node_id} did not answer within 120 s")

    def _start_export(self, spec: NodeSpec) -> None:
        self.shared = Path(spec.shared_dir) if spec.shared_dir else None
        self.exported = threading.Event()
        if self.shared is not None:
            threading.Thread(target=self._export, args=(spec.export_every_s,), daemon=True).start()

    def _export(self, every_s: float) -> None:
        assert self.shared is not None
        while self.proc.poll() is None:
            try:
                if self.backend == "copy":
                    export_copies(self.state_dir / "snapshots" / "copies", self.shared)
                else:
                    export_store(self.state_dir / "snapshots" / "layers", self.shared)
            except (OSError, subprocess.CalledProcessError, ValueError) as exc:  # next round tries again
                print(f"export from {self.node_id}: {exc}", file=sys.stderr)
            time.sleep(every_s)

    def adopt(self, session_id: str) -> dict[str, Any]:
        """Import the lost session's last exported snapshot into this node's store, then have the daemon
        serve it; returns the daemon's answer (an AdoptSessionResponse or ErrorResponse, as builtins)."""
        if self.shared is None:
            raise RuntimeError("no shared directory: nothing was exported to re-create a session from")
        if self.backend == "copy":
            import_copy_session(self.shared, self.state_dir / "snapshots", session_id)
        else:
            import_session(self.shared, self.state_dir / "snapshots" / "layers", session_id)
        with Client(self.local, timeout_s=300) as client:
            reply = client.send_raw(p.encode(p.AdoptSessionRequest(request_id=uuid.uuid4().hex,
                                                                   session_id=session_id)))
        return msgspec.to_builtins(reply)

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "endpoint": self.endpoint, "state_dir": str(self.state_dir),
                "pid": self.proc.pid, "host": os.uname().nodename}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def _free_port(ip: str) -> int:
    """A port free on `ip` now; the daemon binds it a moment later (a race another binder could win: the
    daemon then fails to start, and says so)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((ip, 0))
        return int(probe.getsockname()[1])


def start_node(spec: NodeSpec, node_id: str) -> Any:
    """The actor owning `node_id`'s daemon, pinned there (not soft: a daemon elsewhere owns nothing)."""
    actor = ray.remote(num_cpus=0)(NodeDaemon).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        max_restarts=0, name=f"sandboxd-node-{node_id}", lifetime=None)
    return actor.remote(spec, node_id)


def alive_nodes() -> list[str]:
    """Ray's live nodes, by id."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
