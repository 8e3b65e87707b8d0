"""Typed configuration of the side-effect firewall: mail relay, HTTP allowlist, webhook, release policy.

The daemon turns its config file section into one `FirewallConfig` with `parse_config` and hands it to
`Firewall`; nothing inside the firewall reads raw dicts or environment variables. A tool whose backend
is not configured (no `smtp`, no `http`, no `webhook`) is simply not offered.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

import msgspec

ReleasePolicy = Literal["immediate", "on_commit", "manual"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


class AllowedHost(msgspec.Struct, frozen=True):
    """One allowlist entry: a host name or IP literal, and a port or None for the standard ports."""

    host: str
    port: int | None

    def allows(self, host: str, port: int) -> bool:
        """Whether a request to (host, port) matches this entry."""
        if host != self.host:
            return False
        return port in _DEFAULT_PORTS.values() if self.port is None else port == self.port

    def __str__(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if self.port is None else f"{shown}:{self.port}"


def parse_host_entry(entry: str) -> AllowedHost:
    """Parse `host`, `host:port`, `[v6]` or `[v6]:port` into an `AllowedHost` (ValueError if malformed)."""
    text = entry.strip().lower()
    port: int | None = None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"allowlist entry {entry!r}: junk after ']'")
            port = _port(entry, rest[1:])
        ipaddress.IPv6Address(host)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(entry, port_text)
    elif ":" in text:
        raise ValueError(f"allowlist entry {entry!r}: write IPv6 literals as [addr] or [addr]:port")
    else:
        host = text
    if not host or "/" in host or "@" in host or "*" in host:
        raise ValueError(f"allowlist entry {entry!r} is not a plain host name or address")
    return AllowedHost(host.rstrip("."), port)


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"allowlist entry {entry!r}: bad port {text!r}")
    return int(text)


class SmtpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where `send_email` delivers."""

    host: Annotated[str, msgspec.Meta(description="SMTP server host name or address.")] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535, description="SMTP server port.")] = 25
    sender: Annotated[
        str, msgspec.Meta(description="Envelope and From: address of every message the firewall sends.")
    ] = "sandboxd@localhost"
    timeout_s: Annotated[
        Annotated[float, msgspec.Meta(gt=0)] | None,
        msgspec.Meta(description="Socket timeout for one delivery; None uses adapter_timeout_s."),
    ] = None


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which hosts `http_request` and `http_get` may reach."""

    allowlist: Annotated[
        list[str],
        msgspec.Meta(
            description=(
                "Hosts a request may target: 'host' (standard ports 80/443 only), 'host:port', '[v6]:port'. "
                "Matched literally against the URL's host, without DNS resolution."
            )
        ),
    ] = []
    max_response_bytes: Annotated[
        int, msgspec.Meta(ge=0, description="Response bodies are cut to this many bytes in the result.")
    ] = 65536
    resolve: Annotated[
        dict[str, str],
        msgspec.Meta(
            description=(
                "Where an allowlisted 'host:port' is really reached, as curl's --resolve: "
                "{'vendor.test:80' = '127.0.0.1:18431'}. The allowlist, the ledger and the agent see the name; "
                "the connection goes to the address, with the name in the Host header."
            )
        ),
    ] = {}

    def __post_init__(self) -> None:
        for entry in self.allowlist:
            parse_host_entry(entry)
        for name, address in self.resolve.items():
            for entry in (name, address):
                try:
                    port = parse_host_entry(entry).port
                except ValueError as exc:
                    raise ValueError(f"resolve entry {name!r} = {address!r}: {exc}") from exc
                if port is None:
                    raise ValueError(f"resolve entry {name!r} = {address!r}: both sides need a port (host:port)")

    def resolved(self) -> dict[tuple[str, int], tuple[str, int]]:
        """The resolve table, parsed: (host, port) as written in a URL -> (address, port) connected to."""
        table: dict[tuple[str, int], tuple[str, int]] = {}
        for name, address in self.resolve.items():
            key, value = parse_host_entry(name), parse_host_entry(address)
            table[(key.host, key.port or 0)] = (value.host, value.port or 0)
        return table

    def allowed_hosts(self) -> list[AllowedHost]:
        """The allowlist, parsed."""
        return [parse_host_entry(entry) for entry in self.allowlist]


class WebhookConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where `webhook` posts."""

    url: Annotated[str, msgspec.Meta(description="The http(s) URL every webhook call is POSTed to.")]
    undo_url: Annotated[
        str | None,
        msgspec.Meta(description="The compensating action: where a rollback's orphaned webhook call is undone "
                                 "(POST {\"undo\": CALL_ID, \"body\": BODY}); None: webhooks cannot be compensated."),
    ] = None

    def __post_init__(self) -> None:
        for url in (self.url, self.undo_url or "http://"):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"webhook url {url!r} must be http:// or https://")


class FirewallConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole firewall configuration, validated once at the edge."""

    smtp: Annotated[
        SmtpConfig | None, msgspec.Meta(description="Mail relay for send_email; None disables the tool.")
    ] = None
    http: Annotated[
        HttpConfig | None,
        msgspec.Meta(description="Allowlist for http_request and http_get; None disables both tools."),
    ] = None
    webhook: Annotated[
        WebhookConfig | None, msgspec.Meta(description="Target of the webhook tool; None disables it.")
    ] = None
    adapter_timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="Per-operation network timeout of every effect adapter.")
    ] = 10.0
    flow_control: Annotated[
        bool, msgspec.Meta(description="Refuse (flow_blocked) an external call whose arguments carry a word of an "
                                       "observation the detector flagged and no revocation has yet forgotten.")
    ] = False
    release: Annotated[
        dict[str, ReleasePolicy],
        msgspec.Meta(description="Release policy per external tool name; a tool not listed is 'immediate'."),
    ] = {}

    def policy(self, tool: str) -> ReleasePolicy:
        """The release policy of one tool."""
        return self.release.get(tool, "immediate")


def parse_config(raw: dict[str, Any]) -> FirewallConfig:
    """Validate a decoded config section into a `FirewallConfig` (msgspec.ValidationError if bad)."""
    return msgspec.convert(raw, FirewallConfig, strict=True)
