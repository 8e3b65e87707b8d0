"""Property tests of tool-argument validation: random JSON-like arguments to every built-in and firewall
tool never crash it; they pass, or raise one of the documented `SandboxdError` subclasses.

The firewall runs for real against loopback ports that refuse connections, so a call whose arguments
pass validation goes as far as firing and fails cleanly (`effect_failed`) without reaching anything.
"""

from __future__ import annotations

import json
import math
import posixpath
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.calls import canonical_args
from sandboxd.db import Database
from sandboxd.errors import ErrorCode, SandboxdError
from sandboxd.firewall import Firewall, parse_config
from sandboxd.tools.builtin import BUILTIN_TOOLS, PATH_ARGUMENTS, executor_request
from sandboxd.tools.registry import WORKSPACE, ToolRegistry, check_workspace_path

REGISTRY = ToolRegistry(BUILTIN_TOOLS)
BUILTIN_NAMES = sorted(m.name for m in BUILTIN_TOOLS)
FIREWALL_NAMES = ["http_get", "http_request", "send_email", "webhook"]
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

#: what validating a call may raise (README "Errors")
VALIDATION_CODES = {ErrorCode.UNKNOWN_TOOL, ErrorCode.INVALID_ARGUMENTS, ErrorCode.PATH_ESCAPE}
#: what a firewall call may end in when nothing answers on the other side
FIREWALL_CODES = VALIDATION_CODES | {ErrorCode.HOST_NOT_ALLOWED, ErrorCode.EFFECT_FAILED, ErrorCode.ADAPTER_TIMEOUT,
                                     ErrorCode.CALL_ID_CONFLICT, ErrorCode.CALL_UNKNOWN, ErrorCode.INVALID_STATE}

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30)
           | st.binary(max_size=8))
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15,
)
#: the names every tool's schema knows, so generated arguments land near the valid ones
known_keys = st.sampled_from(sorted({key for m in BUILTIN_TOOLS for key in m.parameters["properties"]}
                                    | {"to", "subject", "body", "method", "url"}))
paths = st.text(max_size=40) | st.lists(st.sampled_from(["..", ".", "", "a", "/workspace", "/etc", "b\x00", "//"]),
                                        max_size=6).map("/".join)
urls = st.builds(
    lambda scheme, host, port, rest: f"{scheme}{host}{port}{rest}",
    st.sampled_from(["http://", "https://", "ftp://", "", "http:/", "HTTP://"]),
    st.sampled_from(["127.0.0.1", "localhost", "[::1]", "127.0.0.1.", "example.com", "", "[::1", "a b", "\u00e9.test"]),
    st.sampled_from(["", ":0", ":80", ":99999", ":-1", ":x"]) | st.integers(1, 65535).map(lambda n: f":{n}"),
    st.text(max_size=10),
)
args_strategy = st.dictionaries(known_keys | st.text(max_size=8), json_like | paths | urls, max_size=5)


def assert_documented(exc: BaseException, codes: set[ErrorCode]) -> None:
    assert isinstance(exc, SandboxdError), f"{type(exc).__name__}: {exc}"
    assert exc.code in codes, exc
    json.dumps(exc.details, default=repr)  # details travel in the error reply


# Built-in tools --------------------------------------------------------------------------------


@FUZZ
@given(st.sampled_from(BUILTIN_NAMES) | st.text(max_size=10), args_strategy)
def test_builtin_validation_never_crashes(tool: str, args: dict[str, Any]) -> None:
    try:
        manifest = REGISTRY.validate(tool, args)
    except Exception as exc:
        assert_documented(exc, VALIDATION_CODES)
        return
    # Accepted: the call can be recorded, turned into an executor request, and its paths stay inside.
    assert manifest.name == tool
    canonical_args(args)
    request = executor_request(tool, args)
    assert request["op"] in ("run", "read_file", "write_file", "list_dir")
    for key in PATH_ARGUMENTS.get(tool, ()):
        if key in args:
            normal = check_workspace_path(args[key])
            assert normal == WORKSPACE or normal.startswith(WORKSPACE + "/")
    for value in _leaves(args):
        assert not (isinstance(value, float) and not math.isfinite(value)), args


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


seconds = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)
VALID_ARGS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "shell": st.fixed_dictionaries({"command": st.text(min_size=1)},
                                   optional={"stdin": st.text(), "timeout_s": seconds}),
    "python": st.fixed_dictionaries({"code": st.text(min_size=1)}, optional={"timeout_s": seconds}),
    "read_file": st.fixed_dictionaries({"path": st.text(min_size=1, max_size=50)}),
    "write_file": st.fixed_dictionaries({"path": st.text(min_size=1, max_size=50), "content": st.text()},
                                        optional={"append": st.booleans()}),
    "list_dir": st.fixed_dictionaries({}, optional={"path": st.text(min_size=1, max_size=50),
                                                    "recursive": st.booleans()}),
}


@FUZZ
@given(st.sampled_from(BUILTIN_NAMES).flatmap(lambda tool: st.tuples(st.just(tool), VALID_ARGS[tool])))
def test_schema_valid_arguments_are_accepted_unless_a_path_escapes(case: tuple[str, dict[str, Any]]) -> None:
    tool, args = case
    escapes = False
    for key in PATH_ARGUMENTS.get(tool, ()):
        if key in args:
            path = args[key]
            normal = posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKSPACE, path))
            escapes |= "\x00" in path or not (normal == WORKSPACE or normal.startswith(WORKSPACE + "/"))
    try:
        REGISTRY.validate(tool, args)
    except SandboxdError as exc:
        assert escapes and exc.code == ErrorCode.PATH_ESCAPE, (args, exc)
    else:
        assert not escapes, args


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(value: float) -> None:
    # Found while fuzzing a live daemon: jsonschema's bounds let NaN through (every comparison is false), and
    # {"timeout_s": NaN} reached the executor channel, which failed as sandbox_unavailable.
    for tool, args in [("shell", {"command": "ls", "timeout_s": value}), ("python", {"code": "1", "timeout_s": value})]:
        with pytest.raises(SandboxdError) as err:
            REGISTRY.validate(tool, args)
        assert err.value.code == ErrorCode.INVALID_ARGUMENTS


# Firewall tools ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refusing_port() -> Iterator[int]:
    """A loopback port that is bound but never listens: every connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def firewall(refusing_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Firewall]:
    config = parse_config({
        "smtp": {"port": refusing_port, "sender": "agent@sandboxd.test"},
        "http": {"allowlist": [f"127.0.0.1:{refusing_port}"]},
        "webhook": {"url": f"http://127.0.0.1:{refusing_port}/hook"},
        "adapter_timeout_s": 2.0,
    })
    db = Database(str(tmp_path_factory.mktemp("ledger") / "ledger.db"))
    made = Firewall(config, db)
    yield made
    made.close()
    db.close()


def test_the_firewall_serves_every_external_tool(firewall: Firewall) -> None:
    assert sorted(m.name for m in firewall.manifests()) == FIREWALL_NAMES


emails = st.emails() | st.text(max_size=20)
firewall_args = st.one_of(
    args_strategy,
    st.fixed_dictionaries({"to": st.lists(emails, min_size=1, max_size=3), "subject": st.text(max_size=30),
                           "body": st.text(max_size=30)}),
    st.fixed_dictionaries({"method": st.sampled_from(["POST", "PUT", "DELETE", "GET", "post"]), "url": urls},
                          optional={"body": st.text(max_size=20) | json_like}),
    st.fixed_dictionaries({"url": urls}),
    st.fixed_dictionaries({"body": json_like}),
)


@FUZZ
@given(
    st.sampled_from(FIREWALL_NAMES) | st.text(max_size=10),
    firewall_args,
    st.none() | st.text(max_size=6),
    st.sampled_from(["live", "shadow", "fire"]),
    st.none() | st.integers(-3, 3),
    st.none() | st.text(max_size=12),
)
def test_firewall_calls_never_crash(firewall: Firewall, refusing_port: int, tool: str, args: dict[str, Any],
                                    call_id: str | None, mode: str, turn: int | None, aim: str | None) -> None:
    if aim is not None and "url" in args:  # aim at the allowlisted (refusing) port, so the call gets to fire
        args["url"] = f"http://127.0.0.1:{refusing_port}/{aim}"
    combined = ToolRegistry([*BUILTIN_TOOLS, *firewall.manifests()])
    try:
        combined.validate(tool, args)  # what the daemon checks before handing a call to the firewall
    except Exception as exc:
        assert_documented(exc, VALIDATION_CODES)
    try:
        result = firewall.call("s-fuzz", "s-fuzz", tool, args, call_id=call_id, mode=mode, turn=turn)  # type: ignore[arg-type]
    except Exception as exc:
        assert_documented(exc, FIREWALL_CODES)
        return
    # Only a refused port is configured, so nothing can have been delivered.
    assert result.state != "done" or result.deduplicated, result
