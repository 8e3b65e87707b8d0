"""The daemon's typed configuration, validated once at the edge.

A TOML file and CLI options become one `DaemonConfig`; nothing inside the daemon reads raw dicts or
environment variables.
"""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from sandboxd.firewall.config import FirewallConfig
from sandboxd.metrics import parse_metrics_address
from sandboxd.protocol import DEFAULT_MAX_FRAME

DEFAULT_IMAGE = "sandboxd-tool:bookworm-v3"

Runtime = Literal["runc", "runsc"]
"""The OCI runtimes a sandbox can run under (Docker's names for them)."""


def default_state_dir() -> Path:
    """Where state lives when no directory is given: /var/lib for root, XDG state otherwise."""
    if os.geteuid() == 0:
        return Path("/var/lib/sandboxd")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sandboxd"


def default_endpoint(state_dir: Path) -> str:
    """The ipc:// endpoint a daemon with this state directory binds by default."""
    return f"ipc://{state_dir / 'sandboxd.sock'}"


class SandboxLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Resource limits and hardening knobs of each session's container."""

    memory_mb: Annotated[int, msgspec.Meta(ge=32, description="Memory limit, swap included.")] = 512
    pids: Annotated[int, msgspec.Meta(ge=8, description="Most processes a sandbox may hold.")] = 128
    cpus: Annotated[float, msgspec.Meta(gt=0, description="CPU quota in cores.")] = 1.0
    tmp_mb: Annotated[int, msgspec.Meta(ge=1, description="Size of the tmpfs at /tmp.")] = 64
    disk_mb: Annotated[int, msgspec.Meta(ge=0, description=(
        "Disk quota of a session: its workspace and snapshots live in a loop-mounted filesystem of this "
        "size (overlay backend; 0 = no quota)."))] = 1024
    nofile: Annotated[int, msgspec.Meta(ge=64, description="Open-file limit per process.")] = 1024
    user: Annotated[str, msgspec.Meta(description="uid:gid the sandbox runs as; never root.")] = "1000:1000"
    network: Annotated[bool, msgspec.Meta(description="Give the container a network (off).")] = False
    runtime: Annotated[Runtime, msgspec.Meta(description=(
        "OCI runtime of every session's container: runc (the host kernel, hardened) or runsc (gVisor: a "
        "user-space kernel between the tool and the host; registered by docker/ensure-runsc.sh)."))] = "runc"


class ToolLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-call limits the in-container executor enforces."""

    timeout_s: Annotated[float, msgspec.Meta(gt=0, description="Default call timeout.")] = 30.0
    max_timeout_s: Annotated[float, msgspec.Meta(gt=0, description="Largest timeout a call may ask.")] = 600.0
    output_bytes: Annotated[
        int, msgspec.Meta(ge=1024, description="Cap on stdout and on stderr of one call, each.")
    ] = 64 * 1024
    read_bytes: Annotated[int, msgspec.Meta(ge=1024, description="Cap on what read_file returns.")] = (
        1024 * 1024
    )


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """CURVE authentication of tcp:// clients (see `sandboxd.auth`); ipc:// peers are the local owner.

    Relative paths in a config file are relative to the file's directory.
    """

    server_secret_key_file: Annotated[
        str, msgspec.Meta(description="The daemon's NAME.key_secret (from `sandboxd keys`); mode 0600.")
    ] = ""
    client_keys_dir: Annotated[
        str, msgspec.Meta(description="Allowlist: every *.key public key file in it may connect; read at "
                                      "each connection, so deleting a file shuts that client out.")
    ] = ""
    operator_keys: Annotated[
        list[str], msgspec.Meta(description="Public key files whose holders may connect and act on any "
                                            "session (others act only on sessions they opened).")
    ] = []

    @property
    def curve(self) -> bool:
        """Whether CURVE is configured (a server key and an allowlist)."""
        return bool(self.server_secret_key_file and self.client_keys_dir)


class WorldConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An outside world the daemon holds for its sessions (see `sandboxd.firewall.world`)."""

    agentdojo_suite: Annotated[
        str, msgspec.Meta(description="An AgentDojo suite by name (banking, slack, travel, workspace): its tools "
                                      "are served on a per-session environment; state-changing ones are external. "
                                      "A suite tool replaces a sandbox tool of the same name (banking's read_file).")
    ] = ""
    agentdojo_version: Annotated[str, msgspec.Meta(description="AgentDojo benchmark version.")] = "v1.2.2"


class DaemonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything `sandboxd serve` needs; the defaults are a working set-up."""

    state_dir: Annotated[str, msgspec.Meta(description="SQLite state, snapshot layers, sockets.")] = ""
    state: Annotated[
        str, msgspec.Meta(description="Where the state database lives: empty (default) for the SQLite file in "
                                       "state_dir, or postgresql://USER@HOST/DB for a PostgreSQL server that "
                                       "several daemons (nodes) may share.")
    ] = ""
    node_id: Annotated[
        str, msgspec.Meta(description="This daemon's name on a shared state database (its sessions carry it); "
                                       "default: HOST:STATE_DIR, the same across restarts.")
    ] = ""
    endpoint: Annotated[
        str, msgspec.Meta(description="ZeroMQ endpoint: ipc://PATH (default) or tcp://HOST:PORT, which needs "
                                       "[auth] CURVE keys; a tcp daemon also serves the ipc socket of its "
                                       "state directory for its owner.")
    ] = ""
    image: Annotated[str, msgspec.Meta(description="Tool image for sessions that name none.")] = DEFAULT_IMAGE
    max_frame_bytes: Annotated[
        int, msgspec.Meta(ge=1024, description="Largest request frame; bigger ones get frame_too_large.")
    ] = DEFAULT_MAX_FRAME
    workers: Annotated[int, msgspec.Meta(ge=1, description="Threads serving session requests.")] = 16
    snapshot_backend: Annotated[
        Literal["overlay", "copy"],
        msgspec.Meta(description="overlay: layered, O(1) snapshots (needs root); copy: portable."),
    ] = "overlay"
    max_layers: Annotated[
        int, msgspec.Meta(ge=2, le=400, description="Overlay depth at which a snapshot is flattened.")
    ] = 64
    detector: Annotated[
        str, msgspec.Meta(description="Injection detector run on observations: rules, none, or module:Class.")
    ] = "rules"
    metrics_address: Annotated[
        str, msgspec.Meta(description="HOST:PORT of the Prometheus /metrics endpoint, e.g. 127.0.0.1:9464; "
                                       "empty (default): no endpoint.")
    ] = ""
    metrics_allow_remote: Annotated[
        bool, msgspec.Meta(description="Allow a non-loopback metrics_address. The endpoint has no authentication: "
                                       "expose it only behind a proxy that adds some.")
    ] = False
    sandbox: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    tools: ToolLimits = msgspec.field(default_factory=ToolLimits)
    firewall: Annotated[
        FirewallConfig,
        msgspec.Meta(description="Effect adapters of external tools and their release policies (none by default)."),
    ] = msgspec.field(default_factory=FirewallConfig)
    auth: Annotated[
        AuthConfig, msgspec.Meta(description="CURVE keys for tcp:// endpoints and the operators' keys."),
    ] = msgspec.field(default_factory=AuthConfig)
    world: Annotated[
        WorldConfig, msgspec.Meta(description="An outside world held by the daemon (none by default)."),
    ] = msgspec.field(default_factory=WorldConfig)
    crash_at: Annotated[
        list[str],
        msgspec.Meta(description="Fault injection for crash tests: the daemon kills itself (SIGKILL) when a branch "
                                 "operation reaches one of these points: begun, committing, or committed:NAME "
                                 "(after participant NAME committed); or a fork reaches fork:opening (files "
                                 "and sandbox made) or fork:open (recorded). Never set in production."),
    ] = []

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def local_endpoint(self) -> str:
        """The owner-only ipc endpoint: the configured one, or the state directory's beside a tcp one."""
        return self.endpoint if self.endpoint.startswith("ipc://") else default_endpoint(self.state_path)


def load_config(path: Path | None = None, runtime: str | None = None, **overrides: object) -> DaemonConfig:
    """Read a TOML file (optional), apply CLI overrides that are not None, fill derived defaults.

    `runtime` overrides `[sandbox] runtime`; the other overrides are top-level keys.
    """
    raw: dict[str, object] = {}
    if path is not None:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    if runtime is not None:
        sandbox = raw.get("sandbox")
        raw["sandbox"] = {**(sandbox if isinstance(sandbox, dict) else {}), "runtime": runtime}
    try:
        config = msgspec.convert(raw, DaemonConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid configuration: {exc}") from exc
    if path is not None:
        _anchor_key_paths(config.auth, path.parent)
    if not config.state_dir:
        config.state_dir = str(default_state_dir())
    config.state_dir = str(Path(config.state_dir).resolve())
    if config.state and not config.state.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"state {config.state!r} must be empty (SQLite in state_dir) or a postgresql:// URL")
    if not config.node_id:
        config.node_id = f"{socket.gethostname()}:{config.state_dir}"
    if not config.endpoint:
        config.endpoint = default_endpoint(config.state_path)
    _check_endpoint(config)
    if config.metrics_address:
        parse_metrics_address(config.metrics_address, config.metrics_allow_remote)  # refuse it at start-up
    return config


def _anchor_key_paths(auth: AuthConfig, base: Path) -> None:
    """Key paths in a config file are relative to that file, wherever the daemon is started from."""
    def anchored(name: str) -> str:
        return str(base / Path(name).expanduser()) if name else name

    auth.server_secret_key_file = anchored(auth.server_secret_key_file)
    auth.client_keys_dir = anchored(auth.client_keys_dir)
    auth.operator_keys = [anchored(f) for f in auth.operator_keys]


def _check_endpoint(config: DaemonConfig) -> None:
    """ipc:// or tcp://, and tcp:// only with working CURVE keys."""
    endpoint = config.endpoint
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise ValueError(f"endpoint {endpoint!r} must be ipc://PATH or tcp://HOST:PORT")
    if not endpoint.startswith("tcp://"):
        return
    if not config.auth.curve:
        # Not even on loopback: any local user (off loopback, anyone) could connect and act as any agent.
        raise ValueError(f"refusing to bind {endpoint} without CURVE authentication: set [auth] "
                         "server_secret_key_file and client_keys_dir (make keys with `sandboxd keys`)")
