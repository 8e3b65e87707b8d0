"""Who the console lets in: its token, or the secret of one of the operators' CURVE keys it was given.

The public key alone (which may be handed out), another key's secret, and anything else are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.auth import generate_keys, read_public_key, read_secret_key
from sandboxd.client import Client
from sandboxd.console.app import Console


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    ops_public, ops_secret = generate_keys(root, "ops")
    other_public, other_secret = generate_keys(root, "other")
    return {"ops.key": ops_public, "ops.key_secret": ops_secret, "other.key": other_public,
            "other.key_secret": other_secret}


def console(keys: dict[str, Path], operators: bool = True) -> Console:
    def no_daemon() -> Client:
        raise AssertionError("logging in never asks the daemon")

    return Console(no_daemon, token="the-token",
                   operator_keys=frozenset({read_public_key(keys["ops.key"])}) if operators else frozenset())


def test_the_token_and_an_operators_secret_log_in(keys: dict[str, Path]) -> None:
    app = console(keys)
    public, secret = read_secret_key(keys["ops.key_secret"])
    file_text = keys["ops.key_secret"].read_text()
    assert app.admits("the-token")
    assert app.admits(secret) and app.admits(f"  {secret}\n")
    assert app.admits(file_text) and app.admits(file_text.replace("\n", ""))  # the file, as pasted
    assert not app.admits(public)  # the public key is no credential
    assert not app.admits(read_secret_key(keys["other.key_secret"])[1])
    assert not app.admits(keys["other.key_secret"].read_text())
    # Without operator keys only the token logs in.
    assert not console(keys, operators=False).admits(secret)


@settings(max_examples=300, deadline=None)
@given(given_text=st.text(max_size=120) | st.text(alphabet="0123456789abcdefABCDEF.-:+=^!/*?&<>()[]{}@%$#",
                                                   min_size=40, max_size=40))
def test_nothing_else_logs_in(keys: dict[str, Path], given_text: str) -> None:
    app = console(keys)
    assert app.admits(given_text) == (given_text == "the-token")
