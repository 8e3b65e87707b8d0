"""The daemon's typed configuration, validated once at the edge.

A TOML file and CLI options become one `DaemonConfig`; nothing inside the daemon reads raw dicts or
environment variables.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from sandboxd.firewall.config import FirewallConfig
from sandboxd.protocol import DEFAULT_MAX_FRAME

DEFAULT_IMAGE = "sandboxd-tool:bookworm"


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
    nofile: Annotated[int, msgspec.Meta(ge=64, description="Open-file limit per process.")] = 1024
    user: Annotated[str, msgspec.Meta(description="uid:gid the sandbox runs as; never root.")] = "1000:1000"
    network: Annotated[bool, msgspec.Meta(description="Give the container a network (off).")] = False


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


class DaemonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything `sandboxd serve` needs; the defaults are a working set-up."""

    state_dir: Annotated[str, msgspec.Meta(description="SQLite state, snapshot layers, sockets.")] = ""
    endpoint: Annotated[
        str, msgspec.Meta(description="ZeroMQ endpoint: ipc://PATH (default) or tcp://127.0.0.1:PORT.")
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
    sandbox: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    tools: ToolLimits = msgspec.field(default_factory=ToolLimits)
    firewall: Annotated[
        FirewallConfig,
        msgspec.Meta(description="Effect adapters of external tools and their release policies (none by default)."),
    ] = msgspec.field(default_factory=FirewallConfig)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


def load_config(path: Path | None = None, **overrides: object) -> DaemonConfig:
    """Read a TOML file (optional), apply CLI overrides that are not None, fill derived defaults."""
    raw: dict[str, object] = {}
    if path is not None:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = msgspec.convert(raw, DaemonConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid configuration: {exc}") from exc
    if not config.state_dir:
        config.state_dir = str(default_state_dir())
    config.state_dir = str(Path(config.state_dir).resolve())
    if not config.endpoint:
        config.endpoint = default_endpoint(config.state_path)
    if config.endpoint.startswith("tcp://") and not config.endpoint.startswith(("tcp://127.", "tcp://[::1]")):
        # CURVE authentication is not in place yet, so a non-loopback bind would be an open door.
        raise ValueError(f"refusing to bind {config.endpoint}: only loopback TCP endpoints are allowed")
    return config
