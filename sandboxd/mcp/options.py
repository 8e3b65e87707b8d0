"""`sandboxd mcp`'s options, validated once at the edge."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class McpOptions:
    """How `sandboxd mcp` serves one session."""

    transport: Literal["stdio", "http"] = "stdio"
    host: str = "127.0.0.1"
    """HTTP: the address to bind; anything but loopback needs `allow_remote`."""
    port: int = 8765
    path: str = "/mcp"
    token: str | None = None
    """HTTP: the bearer token clients must present; None: one is generated and printed at start."""
    allow_remote: bool = False
    session: str | None = None
    """Attach to this open session; None: open a new one."""
    image: str | None = None
    close_on_exit: bool | None = None
    """Close the session when the server stops; None: only a session this server opened."""
    idle_timeout_s: float = 0.0
    """Close the session and stop after this many seconds without an MCP request; 0: never."""
    retry_window_s: float = 60.0
    """How long after an answer an identical call is still a retry of it (see `sandboxd.mcp.retries`)."""
    hold_poll_s: float = 20.0
    """2026-07-28 clients: how long one input-required round waits for an operator's decision."""
    hold_wait_s: float = 600.0
    """Handshake-era clients: how long one call waits (with progress notifications) for a decision."""
    close_tool: bool = False
    """List `sandboxd_close_session`, so the model itself may end the session."""
    revocation_poll_s: float = 0.5
    endpoint: str | None = None
    server_key: Path | None = None
    client_key: Path | None = None
    wait_s: float = 120.0
    """Seconds to wait for one daemon reply."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if not self.path.startswith("/"):
            raise ValueError("--path must start with /")
        for name in ("idle_timeout_s", "retry_window_s", "hold_poll_s", "hold_wait_s", "revocation_poll_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, not {value!r}")
        if self.transport == "http" and not self.allow_remote and not _loopback(self.host):
            raise ValueError(f"--host {self.host} is not a loopback address: the MCP endpoint runs tools in a "
                             "sandbox and sends effects, so binding elsewhere needs --allow-remote (and TLS in "
                             "front of it)")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("--token must be at least 16 characters")
        if (self.server_key is None) != (self.client_key is None):
            raise ValueError("--server-key and --client-key go together")

    @property
    def closes_on_exit(self) -> bool:
        return self.close_on_exit if self.close_on_exit is not None else self.session is None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
