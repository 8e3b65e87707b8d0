"""Effect adapters: the only code in sandboxd that talks to the world outside the sandbox.

An adapter declares its tool manifest and intent fields, checks arguments beyond their JSON schema
(addresses, the host allowlist) before anything is recorded, and fires the effect. A failure says
whether the effect certainly did not happen (`EffectNotDelivered`: a retry may fire it) or might
have (`EffectOutcomeUnknown`: the call becomes `unknown` until an operator resolves it). The rule
is "unknown once bytes may have reached the other side": a connect timeout is not delivered, a
timeout waiting for the reply to a sent POST is unknown, because the server may have acted on it.
Every fired request carries the ledger call id (`Message-ID`, `Idempotency-Key`) so that the far
side can deduplicate too and an operator can look the call up when resolving it.

Why one module of this size: each adapter is short (manifest, intent, checks, fire) and they share
the delivered-or-unknown rule above; one module keeps that rule and every place it is applied together.
"""

from __future__ import annotations

import abc
import re
import smtplib
from email.message import EmailMessage
from typing import Any

import httpx
import msgspec

from sandboxd.errors import HostNotAllowed, InvalidArguments
from sandboxd.firewall.config import AllowedHost, HttpConfig, SmtpConfig, WebhookConfig
from sandboxd.protocol import ToolManifest


class EffectNotDelivered(Exception):
    """The effect certainly did not happen (nothing reached the other side, or it refused)."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


class EffectOutcomeUnknown(Exception):
    """The request may have reached the other side and been acted on; nobody can tell from here."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


class EffectAdapter(abc.ABC):
    """One tool served in the daemon: its manifest, argument checks and the effect itself."""

    manifest: ToolManifest
    timeout_s: float

    def validate(self, args: dict[str, Any]) -> None:
        """Check arguments beyond their JSON schema; raise a SandboxdError before anything is recorded."""
        return None

    def intent(self, args: dict[str, Any]) -> dict[str, Any]:
        """The intent fields of a call, before canonicalisation."""
        return {name: args.get(name) for name in self.manifest.intent_fields}

    def target(self, args: dict[str, Any]) -> str:
        """Where the effect goes, for an operator judging it: recipients, or method and URL ("" if unknown)."""
        return ""

    def check_session(self, session_id: str) -> None:
        """Refuse, before anything is recorded, a call this session cannot make (raise a SandboxdError)."""
        return None

    @abc.abstractmethod
    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        """Perform the effect and return its result (JSON-like); raise EffectNotDelivered/OutcomeUnknown.

        A result whose `output` is a string is shown to the agent as that text (a world tool's output);
        any other result is shown as its JSON.
        """

    def fire_in(self, session_id: str, clock: float | None, args: dict[str, Any], call_id: str,
                branch: str = "") -> dict[str, Any]:
        """`fire`, for adapters whose effect depends on the calling session, its branch or its virtual clock."""
        return self.fire(args, call_id)

    def compensate(self, args: dict[str, Any], call_id: str, compensation_id: str) -> dict[str, Any]:
        """Run the compensating action the manifest declares for the fired call `call_id` (its `args`);
        raise EffectNotDelivered/OutcomeUnknown like `fire`. Only called when `manifest.compensation` is set."""
        raise EffectNotDelivered(f"{self.manifest.name} declares no compensating action")

    def shadow(self, session_id: str, branch: str, clock: float | None, args: dict[str, Any]) -> dict[str, Any] | None:
        """A replay's call that did not fire (answered from the ledger, or staged): a simulated world
        the adapter holds takes its effect in the branch's shadow and its answer is returned, shaped
        like `fire`'s. Real far sides have no shadow: None."""
        return None

    def close(self) -> None:
        """Release network resources."""
        return None


# Mail --------------------------------------------------------------------------------------------

# A deliberately plain addr-spec: no display names, comments or quoted local parts, so what the agent
# wrote is exactly what the envelope carries. The domain needs a dot or must be `localhost`.
_LOCAL = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ADDRESS = re.compile(rf"{_LOCAL}@(?:{_LABEL}(?:\.{_LABEL})+|localhost)")

SEND_EMAIL = ToolManifest(
    name="send_email",
    description="Send an email. It leaves the sandbox: it is sent at most once per intent and may be held "
    "for approval.",
    parameters={
        "type": "object",
        "properties": {
            "to": {
                "type": "array",
                "items": {"type": "string", "maxLength": 254},
                "minItems": 1,
                "maxItems": 50,
                "description": "Recipient addresses, like alice@example.com.",
            },
            "subject": {"type": "string", "maxLength": 998, "description": "One-line subject."},
            "body": {"type": "string", "description": "Plain-text body."},
        },
        "required": ["to", "subject", "body"],
        "additionalProperties": False,
    },
    effect="external",
    destructive=False,  # a message is added to a mailbox; nothing there is changed
    intent_fields=["to", "subject", "body"],
)


def valid_address(address: str) -> bool:
    """Whether `address` is a plain addr-spec this firewall will put on an envelope."""
    return len(address) <= 254 and _ADDRESS.fullmatch(address) is not None


class SmtpAdapter(EffectAdapter):
    """`send_email`: delivers one plain-text message through a configured SMTP server."""

    manifest = SEND_EMAIL

    def __init__(self, config: SmtpConfig, timeout_s: float) -> None:
        self._config = config
        self.timeout_s = config.timeout_s or timeout_s

    def validate(self, args: dict[str, Any]) -> None:
        """Reject malformed addresses and header injection."""
        for index, address in enumerate(args["to"]):
            if not valid_address(address):
                raise InvalidArguments(
                    self.manifest.name,
                    f"{address!r} is not an email address like name@example.com",
                    f"$.to[{index}]",
                )
        if "\r" in args["subject"] or "\n" in args["subject"]:
            raise InvalidArguments(self.manifest.name, "the subject must be one line", "$.subject")

    def target(self, args: dict[str, Any]) -> str:
        return ", ".join(str(a) for a in args.get("to") or [])

    def intent(self, args: dict[str, Any]) -> dict[str, Any]:
        """Recipients as a set (order and repeats do not change who gets the mail), domains lowercased."""
        recipients = sorted({_fold_domain(address) for address in args["to"]})
        return {"to": recipients, "subject": args["subject"], "body": args["body"]}

    def message(self, args: dict[str, Any], call_id: str) -> EmailMessage:
        """The message as it goes on the wire; its Message-ID is the ledger call id."""
        msg = EmailMessage()
        msg["From"] = self._config.sender
        msg["To"] = ", ".join(args["to"])
        msg["Subject"] = args["subject"]
        msg["Message-ID"] = f"<{call_id}@sandboxd>"
        msg.set_content(args["body"])
        return msg

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        """Deliver the message; refusals are not delivered, a dropped session mid-send is unknown."""
        where = f"{self._config.host}:{self._config.port}"
        try:
            client = smtplib.SMTP(self._config.host, self._config.port, timeout=self.timeout_s)
        except TimeoutError as exc:
            raise EffectNotDelivered(f"connecting to SMTP server {where} timed out", timed_out=True) from exc
        except OSError as exc:  # includes SMTPConnectError: nothing was handed over yet
            raise EffectNotDelivered(f"cannot reach SMTP server {where}: {exc}") from exc
        try:
            refused = client.send_message(
                self.message(args, call_id), from_addr=self._config.sender, to_addrs=list(args["to"])
            )
        except smtplib.SMTPRecipientsRefused as exc:
            raise EffectNotDelivered(f"the server refused every recipient: {exc.recipients}") from exc
        except (smtplib.SMTPSenderRefused, smtplib.SMTPDataError, smtplib.SMTPHeloError) as exc:
            raise EffectNotDelivered(f"the server refused the message: {exc}") from exc
        except TimeoutError as exc:
            raise EffectOutcomeUnknown(f"SMTP server {where} stopped answering", timed_out=True) from exc
        except OSError as exc:  # SMTPServerDisconnected and friends: maybe after the final '.'
            raise EffectOutcomeUnknown(f"SMTP session with {where} broke off: {exc}") from exc
        finally:
            client.close()
        accepted = [address for address in args["to"] if address not in refused]
        return {
            "message_id": f"<{call_id}@sandboxd>",
            "accepted": accepted,
            "refused": {
                address: [code, text.decode(errors="replace")] for address, (code, text) in refused.items()
            },
        }


def _fold_domain(address: str) -> str:
    local, _, domain = address.rpartition("@")
    return f"{local}@{domain.lower()}"


# HTTP --------------------------------------------------------------------------------------------

HTTP_REQUEST = ToolManifest(
    name="http_request",
    description="Send an HTTP POST, PUT or DELETE to an allowed host. It leaves the sandbox: it is sent at "
    "most once per intent and may be held for approval.",
    parameters={
        "type": "object",
        "properties": {
            "method": {"type": "string", "enum": ["POST", "PUT", "DELETE"]},
            "url": {"type": "string", "maxLength": 2048, "description": "Absolute http(s) URL."},
            "body": {"type": "string", "default": "", "description": "Request body, sent as is."},
        },
        "required": ["method", "url"],
        "additionalProperties": False,
    },
    effect="external",
    destructive=True,  # PUT replaces, DELETE removes
    intent_fields=["method", "url", "body"],
)

HTTP_GET = ToolManifest(
    name="http_get",
    description="Fetch a URL on an allowed host with HTTP GET.",
    parameters={
        "type": "object",
        "properties": {"url": {"type": "string", "maxLength": 2048, "description": "Absolute http(s) URL."}},
        "required": ["url"],
        "additionalProperties": False,
    },
    effect="read",
    open_world=True,
)

WEBHOOK = ToolManifest(
    name="webhook",
    description="POST a JSON document to the configured webhook. It leaves the sandbox: it is sent at most "
    "once per intent and may be held for approval.",
    parameters={
        "type": "object",
        "properties": {"body": {"description": "Any JSON value; it is the request body."}},
        "required": ["body"],
        "additionalProperties": False,
    },
    effect="external",
    destructive=True,  # the far side decides what a POST does
    intent_fields=["body"],
)


class HttpSender:
    """One httpx client shared by the HTTP adapters; never follows redirects nor reads proxy env vars."""

    def __init__(self, timeout_s: float, max_response_bytes: int,
                 resolve: dict[tuple[str, int], tuple[str, int]] | None = None) -> None:
        self.timeout_s = timeout_s
        self._max = max_response_bytes
        self._resolve = resolve or {}
        # trust_env=False: egress is decided by this config, not by whatever HTTP_PROXY the daemon inherited.
        # No redirects: a 30x to a host off the allowlist must not be followed.
        self._client = httpx.Client(timeout=timeout_s, trust_env=False, follow_redirects=False)

    def send(self, method: str, url: httpx.URL, content: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """Send one request and classify failures by whether the request may have been acted on."""
        port = url.port or (443 if url.scheme == "https" else 80)
        target = self._resolve.get((url.host.rstrip("."), port))
        extensions: dict[str, Any] = {}
        if target is not None:  # `resolve`: the name stays in Host (and TLS's SNI), the address is connected to
            headers = {**headers, "Host": url.netloc.decode("ascii")}
            extensions["sni_hostname"] = url.host
            url = url.copy_with(host=target[0], port=target[1])
        try:
            with self._client.stream(method, url, content=content, headers=headers,
                                     extensions=extensions) as response:
                body, truncated = self._read(response)
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise EffectNotDelivered(f"connecting to {url.host} timed out", timed_out=True) from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
            raise EffectNotDelivered(f"cannot reach {url.host}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise EffectOutcomeUnknown(f"{url.host} did not answer in time", timed_out=True) from exc
        except httpx.HTTPError as exc:
            raise EffectOutcomeUnknown(f"the exchange with {url.host} broke off: {exc}") from exc
        return {
            "status": response.status_code,
            "content_type": response.headers.get("content-type", ""),
            "body": body,
            "truncated": truncated,
        }

    def _read(self, response: httpx.Response) -> tuple[str, bool]:
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > self._max:
                break
        data = b"".join(chunks)
        return data[: self._max].decode("utf-8", errors="replace"), size > self._max

    def close(self) -> None:
        """Close pooled connections."""
        self._client.close()


class HostAllowlist:
    """Parses a URL and admits it only if its scheme is http(s) and its host:port is listed."""

    def __init__(self, hosts: list[AllowedHost]) -> None:
        self._hosts = hosts

    def check(self, tool: str, url_text: str) -> httpx.URL:
        """The parsed URL, or InvalidArguments / HostNotAllowed."""
        try:
            url = httpx.URL(url_text)
        except (httpx.InvalidURL, TypeError) as exc:
            raise InvalidArguments(tool, f"not a URL: {exc}", "$.url") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise InvalidArguments(tool, "the URL must be absolute http:// or https://", "$.url")
        port = url.port or (443 if url.scheme == "https" else 80)
        host = url.host.rstrip(".")
        if not any(entry.allows(host, port) for entry in self._hosts):
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise HostNotAllowed(shown, [str(entry) for entry in self._hosts])
        return url


class _AllowlistedHttp(EffectAdapter):
    """An HTTP tool whose URLs must be on the allowlist, checked before anything is recorded."""

    def __init__(self, sender: HttpSender, allowlist: HostAllowlist) -> None:
        self._sender = sender
        self._allowlist = allowlist
        self.timeout_s = sender.timeout_s

    def validate(self, args: dict[str, Any]) -> None:
        """The URL must be http(s) on the allowlist."""
        self._allowlist.check(self.manifest.name, args["url"])


class HttpRequestAdapter(_AllowlistedHttp):
    """`http_request`: POST/PUT/DELETE to an allowlisted host."""

    manifest = HTTP_REQUEST

    def target(self, args: dict[str, Any]) -> str:
        return f"{args.get('method', '')} {args.get('url', '')}"

    def intent(self, args: dict[str, Any]) -> dict[str, Any]:
        """Method, URL in httpx's normalised spelling (host case, default port), body."""
        url = str(httpx.URL(args["url"]))
        return {"method": args["method"], "url": url, "body": args.get("body", "")}

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        """Send the request with the call id as its Idempotency-Key."""
        url = self._allowlist.check(self.manifest.name, args["url"])
        body = args.get("body", "").encode()
        return self._sender.send(args["method"], url, body, {"Idempotency-Key": call_id})


class HttpGetAdapter(_AllowlistedHttp):
    """`http_get`: a read-class GET to an allowlisted host; not ledgered, but still allowlisted."""

    manifest = HTTP_GET

    def intent(self, args: dict[str, Any]) -> dict[str, Any]:
        """The URL (identifies the read for logging; reads are not ledgered)."""
        return {"url": str(httpx.URL(args["url"]))}

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        """Fetch the URL."""
        url = self._allowlist.check(self.manifest.name, args["url"])
        return self._sender.send("GET", url, b"", {})


class WebhookAdapter(EffectAdapter):
    """`webhook`: POST a JSON body to the configured URL."""

    manifest = WEBHOOK

    def __init__(self, config: WebhookConfig, sender: HttpSender) -> None:
        self._url = httpx.URL(config.url)
        self._undo = httpx.URL(config.undo_url) if config.undo_url else None
        self._sender = sender
        self.timeout_s = sender.timeout_s
        if config.undo_url:
            self.manifest = msgspec.structs.replace(
                WEBHOOK, compensation=f'POST {{"undo": CALL_ID, "body": BODY}} to {config.undo_url}')

    def compensate(self, args: dict[str, Any], call_id: str, compensation_id: str) -> dict[str, Any]:
        """POST the undo of one fired call; its Idempotency-Key is the compensation's own ledger id."""
        if self._undo is None:
            return super().compensate(args, call_id, compensation_id)
        headers = {"Content-Type": "application/json", "Idempotency-Key": compensation_id}
        return self._sender.send("POST", self._undo, msgspec.json.encode({"undo": call_id, "body": args["body"]}),
                                 headers)

    def target(self, args: dict[str, Any]) -> str:
        return f"POST {self._url}"

    def fire(self, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        """POST the body as the agent wrote it (the canonical form is only for the intent key)."""
        headers = {"Content-Type": "application/json", "Idempotency-Key": call_id}
        return self._sender.send("POST", self._url, msgspec.json.encode(args["body"]), headers)


def build_adapters(
    smtp: SmtpConfig | None, http: HttpConfig | None, webhook: WebhookConfig | None, timeout_s: float
) -> tuple[list[EffectAdapter], list[HttpSender]]:
    """The built-in adapters the configuration enables, plus the HTTP clients to close at shutdown."""
    adapters: list[EffectAdapter] = []
    senders: list[HttpSender] = []
    if smtp is not None:
        adapters.append(SmtpAdapter(smtp, timeout_s))
    if http is not None or webhook is not None:
        sender = HttpSender(timeout_s, http.max_response_bytes if http else 65536, http.resolved() if http else None)
        senders.append(sender)
        if http is not None:
            allowlist = HostAllowlist(http.allowed_hosts())
            adapters += [HttpRequestAdapter(sender, allowlist), HttpGetAdapter(sender, allowlist)]
        if webhook is not None:
            adapters.append(WebhookAdapter(webhook, sender))
    return adapters, senders
