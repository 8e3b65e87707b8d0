"""`[firewall.http] resolve`: an allowlisted name reached at another address, as curl's --resolve. The name is
what the allowlist, the ledger and the agent see; the connection goes to the address (a real loopback server)."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.harness import Web
from sandboxd.firewall.adapters import HostAllowlist, HttpSender
from sandboxd.firewall.config import parse_config

names = st.from_regex(r"[a-z][a-z0-9-]{0,12}\.(test|example|internal)", fullmatch=True)
paths = st.from_regex(r"/[a-z0-9/_-]{0,20}", fullmatch=True)


@pytest.fixture(scope="module")
def web() -> object:
    server = Web({"/vendors": "prices"})
    yield server
    server.close()


@settings(max_examples=25, deadline=None)
@given(name=names, path=paths)
def test_a_resolved_name_reaches_the_address_and_keeps_its_host_header(web: Web, name: str, path: str) -> None:
    config = parse_config({"http": {"allowlist": [name], "resolve": {f"{name}:80": f"127.0.0.1:{web.port}"}}})
    assert config.http is not None
    url = HostAllowlist(config.http.allowed_hosts()).check("http_get", f"http://{name}{path}")
    sender = HttpSender(5.0, 1024, config.http.resolved())
    try:
        answer = sender.send("GET", url, b"", {})
    finally:
        sender.close()
    assert answer["status"] == (200 if path == "/vendors" else 404)
    assert answer["body"] == ("prices" if path == "/vendors" else "not found")


@given(name=names)
def test_an_unresolved_name_is_not_rerouted(name: str) -> None:
    # Only the listed host:port is rerouted: the same name on another port goes where DNS says (here: nowhere).
    config = parse_config({"http": {"allowlist": [f"{name}:8080"], "resolve": {f"{name}:80": "127.0.0.1:9"}}})
    assert config.http is not None
    assert (name, 8080) not in config.http.resolved() and config.http.resolved()[(name, 80)] == ("127.0.0.1", 9)


@pytest.mark.parametrize("entry", [{"vendor.test": "127.0.0.1:80"}, {"vendor.test:80": "127.0.0.1"},
                                   {"http://vendor.test:80": "127.0.0.1:80"}, {"vendor.test:80": "127.0.0.1:0"}])
def test_a_resolve_entry_without_ports_is_refused(entry: dict[str, str]) -> None:
    with pytest.raises(msgspec.ValidationError, match="resolve entry"):
        parse_config({"http": {"allowlist": ["vendor.test"], "resolve": entry}})


def test_the_header_names_the_host_as_written() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:  # a transport double: only the request is looked at
        seen.append(f"{request.url.host}:{request.url.port} Host={request.headers['host']}")
        return httpx.Response(200, text="ok")

    sender = HttpSender(5.0, 1024, {("vendor.test", 80): ("127.0.0.1", 4321)})
    sender._client = httpx.Client(transport=httpx.MockTransport(handler))
    sender.send("GET", httpx.URL("http://vendor.test/x"), b"", {})
    assert seen == ["127.0.0.1:4321 Host=vendor.test"]
