"""Intent canonicalisation, derived call ids, address and allowlist checks: pure functions, no I/O."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandboxd.errors import ErrorCode, HostNotAllowed, InvalidArguments
from sandboxd.firewall.adapters import HostAllowlist, valid_address
from sandboxd.firewall.config import FirewallConfig, parse_config, parse_host_entry
from sandboxd.firewall.intent import canonical_json, derive_call_id, intent_key, normalize_text

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def test_key_order_is_irrelevant() -> None:
    a = {"subject": "hi", "to": ["a@x.org"], "body": "b"}
    b = {"body": "b", "to": ["a@x.org"], "subject": "hi"}
    assert canonical_json(a) == canonical_json(b) == '{"body":"b","subject":"hi","to":["a@x.org"]}'


def test_whitespace_is_collapsed_and_stripped() -> None:
    assert normalize_text("  hello \t\n  world  ") == "hello world"
    assert canonical_json({"s": " a  b\n"}) == canonical_json({"s": "a b"})
    # Only runs collapse: a word boundary still matters.
    assert canonical_json({"s": "ab"}) != canonical_json({"s": "a b"})


def test_unicode_is_nfc_normalised() -> None:
    assert canonical_json("caf\u00e9") == canonical_json("cafe\u0301")


@pytest.mark.parametrize(
    ("left", "right"),
    [(1, 1.0), (100, 1e2), (1e20, 100000000000000000000), (1e-7, 0.0000001), (-0.0, 0), (2.50, 2.5)],
)
def test_equal_numbers_have_one_spelling(left: float, right: float) -> None:
    assert canonical_json(left) == canonical_json(right)
    assert "e" not in canonical_json(left).lower()


def test_distinct_values_stay_distinct() -> None:
    assert canonical_json(1) != canonical_json("1")
    assert canonical_json(True) != canonical_json(1)
    assert canonical_json(0.1) != canonical_json(0.10000000000000002)
    assert canonical_json([1, 2]) != canonical_json([2, 1])


def test_non_finite_numbers_are_rejected() -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})
    with pytest.raises(ValueError):
        canonical_json(math.inf)


def test_keys_colliding_after_normalisation_are_rejected() -> None:
    with pytest.raises(ValueError, match="collides"):
        canonical_json({"caf\u00e9": 1, "cafe\u0301": 2})


@given(json_values)
def test_canonical_json_is_valid_json_and_idempotent(value: object) -> None:
    text = canonical_json(value)
    assert canonical_json(json.loads(text)) == text


@given(st.dictionaries(st.text(max_size=6), json_scalars, max_size=6))
def test_canonical_json_ignores_insertion_order(value: dict[str, object]) -> None:
    reversed_value = dict(reversed(list(value.items())))
    assert canonical_json(reversed_value) == canonical_json(value)


def test_intent_key_depends_on_tool_and_content() -> None:
    key, text = intent_key("send_email", {"to": ["a@x.org"], "subject": "hi", "body": "b"})
    assert len(key) == 64 and text.startswith("{")
    assert intent_key("webhook", {"to": ["a@x.org"], "subject": "hi", "body": "b"})[0] != key
    assert intent_key("send_email", {"to": ["a@x.org"], "subject": "hi!", "body": "b"})[0] != key
    assert intent_key("send_email", {"body": "b ", "subject": " hi", "to": ["a@x.org"]})[0] == key


def test_derived_call_id_changes_with_each_component() -> None:
    base = derive_call_id("lin", "send_email", "k" * 64, 0)
    assert base.startswith("fx-") and len(base) == 35
    assert derive_call_id("lin", "send_email", "k" * 64, 0) == base
    others = {
        derive_call_id("lin2", "send_email", "k" * 64, 0),
        derive_call_id("lin", "webhook", "k" * 64, 0),
        derive_call_id("lin", "send_email", "j" * 64, 0),
        derive_call_id("lin", "send_email", "k" * 64, 1),
    }
    assert base not in others and len(others) == 4
    with pytest.raises(ValueError):
        derive_call_id("lin", "send_email", "k", -1)


@pytest.mark.parametrize("address", ["alice@example.com", "a.b+tag@mail.example.co.uk", "root@localhost"])
def test_valid_addresses(address: str) -> None:
    assert valid_address(address)


@pytest.mark.parametrize(
    "address",
    [
        "alice",
        "alice@",
        "@example.com",
        "a b@example.com",
        "alice@example",
        "a..b@example.com",
        "Alice <alice@example.com>",
        "alice@example.com\r\nBcc: x@evil.com",
        "alice@-bad-.com",
    ],
)
def test_malformed_addresses(address: str) -> None:
    assert not valid_address(address)


def test_allowlist_entries_parse() -> None:
    assert str(parse_host_entry("Example.COM")) == "example.com"
    assert parse_host_entry("127.0.0.1:8080").port == 8080
    assert parse_host_entry("[::1]:9000").host == "::1"
    for bad in ["host:0", "host:99999", "http://x", "a@b", "::1", "*.example.com"]:
        with pytest.raises(ValueError):
            parse_host_entry(bad)


def test_allowlist_matches_host_and_port() -> None:
    allow = HostAllowlist([parse_host_entry("api.example.com"), parse_host_entry("127.0.0.1:8080")])
    assert allow.check("t", "https://API.example.com/x").host == "api.example.com"
    assert allow.check("t", "http://127.0.0.1:8080/hook").port == 8080
    for url in [
        "http://127.0.0.1:8081/",
        "https://api.example.com:8443/",
        "http://127.0.0.1:8080@evil.com/",
        "http://evil.com/?api.example.com",
    ]:
        with pytest.raises(HostNotAllowed) as caught:
            allow.check("t", url)
        assert caught.value.code is ErrorCode.HOST_NOT_ALLOWED
    with pytest.raises(InvalidArguments):
        allow.check("t", "ftp://api.example.com/")


def test_config_is_strict_and_described() -> None:
    config = parse_config({"http": {"allowlist": ["127.0.0.1:80"]}, "release": {"send_email": "manual"}})
    assert config.policy("send_email") == "manual" and config.policy("webhook") == "immediate"
    with pytest.raises(msgspec.ValidationError):
        parse_config({"smtp": {"hots": "x"}})
    with pytest.raises(msgspec.ValidationError):
        parse_config({"release": {"send_email": "sometimes"}})
    with pytest.raises(msgspec.ValidationError):
        parse_config({"http": {"allowlist": ["http://x/"]}})
    schema = msgspec.json.schema(FirewallConfig)
    fields = schema["$defs"]["FirewallConfig"]["properties"]
    assert all(field.get("description") for field in fields.values())
