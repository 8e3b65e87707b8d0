"""The /metrics endpoint of a real daemon, and the ids in its JSON log lines."""

from __future__ import annotations

import json
import math
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from sandboxd import protocol as p
from sandboxd.client import RemoteError
from sandboxd.config import load_config
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.docker

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_prometheus(text: str) -> Series:
    """A strict little parser of the text format: every sample belongs to a family typed before it."""
    types: dict[str, str] = {}
    series: Series = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert name not in types, f"family {name} typed twice"
            types[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, raw_labels, raw_value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample {name} before its # TYPE"
        labels = _labels(raw_labels or "")
        if name.endswith("_bucket"):
            assert types[family] == "histogram" and "le" in dict(labels), line
        key = (name, labels)
        assert key not in series, f"duplicate series {line!r}"
        series[key] = float(raw_value)  # float() reads +Inf and NaN as Prometheus writes them
    return series


def _labels(raw: str) -> frozenset[tuple[str, str]]:
    pairs, pos = [], 0
    while pos < len(raw):
        match = _LABEL.match(raw, pos)
        assert match, f"bad labels {raw!r} at {pos}"
        pairs.append((match.group(1), match.group(2)))
        pos = match.end()
    return frozenset(pairs)


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(reply.read().decode())


@pytest.fixture
def metered(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> tuple[DaemonProcess, int]:
    port = free_port()
    config = tmp_path / "sandboxd.toml"
    config.write_text(f'metrics_address = "127.0.0.1:{port}"\n')
    return daemon_factory(["--config", str(config)]), port


def test_counters_move_by_exactly_what_was_done(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    client = daemon.client()
    session = client.open_session().session_id
    before = scrape(port)
    for _ in range(3):
        assert client.call(session, "shell", {"command": "echo hi"}).stdout == "hi\n"
    client.call(session, "write_file", {"path": "a.txt", "content": "A"})
    with pytest.raises(RemoteError) as missing:
        client.call(session, "read_file", {"path": "nope.txt"})
    assert missing.value.wire_code == "not_found"
    with pytest.raises(RemoteError):
        client.call(session, "no_such_tool", {})
    snap = client.snapshot(session)
    client.restore(session, snap.snapshot_id)
    after = scrape(port)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("sandboxd_requests_total", type="CallRequest", outcome="ok") == 4
    assert moved("sandboxd_requests_total", type="CallRequest", outcome="error") == 2
    assert moved("sandboxd_requests_total", type="SnapshotRequest", outcome="ok") == 1
    assert moved("sandboxd_requests_total", type="RestoreRequest", outcome="ok") == 1
    assert moved("sandboxd_errors_total", code="not_found") == 1
    assert moved("sandboxd_errors_total", code="unknown_tool") == 1
    assert moved("sandboxd_tool_calls_total", tool="shell", effect="write", outcome="ok") == 3
    assert moved("sandboxd_tool_calls_total", tool="write_file", effect="write", outcome="ok") == 1
    assert moved("sandboxd_tool_calls_total", tool="read_file", effect="read", outcome="error") == 1
    # A made-up tool name never becomes a label value.
    assert moved("sandboxd_tool_calls_total", tool="(unknown)", effect="none", outcome="error") == 1
    assert all(v != "no_such_tool" for _, labels in after for _, v in labels)
    assert moved("sandboxd_tool_call_seconds_count", effect="write") == 4
    assert moved("sandboxd_snapshot_operations_total", op="snapshot", outcome="ok") == 1
    assert moved("sandboxd_snapshot_operations_total", op="restore", outcome="ok") == 1
    assert moved("sandboxd_snapshot_operation_seconds_count", op="restore") == 1
    assert value(after, "sandboxd_open_sessions") == 1
    assert value(after, "sandboxd_firewall_events_total", event="fired") == 0
    assert ("sandboxd_firewall_events_total", frozenset({("event", "deduplicated")})) in after
    assert_histograms_are_cumulative(after)


def assert_histograms_are_cumulative(series: Series) -> None:
    """Buckets never decrease as `le` grows, and the +Inf bucket equals `_count`."""
    buckets: dict[tuple[str, frozenset[tuple[str, str]]], list[tuple[float, float]]] = {}
    for (name, labels), count in series.items():
        if name.endswith("_bucket"):
            rest = frozenset(kv for kv in labels if kv[0] != "le")
            buckets.setdefault((name[:-len("_bucket")], rest), []).append((float(dict(labels)["le"]), count))
    assert buckets
    for (family, rest), points in buckets.items():
        counts = [c for _, c in sorted(points)]
        assert counts == sorted(counts), family
        assert sorted(points)[-1][0] == math.inf
        assert counts[-1] == series[(f"{family}_count", rest)]


def test_failed_call_logs_its_ids_as_json_fields(metered: tuple[DaemonProcess, int]) -> None:
    daemon, _ = metered
    client = daemon.client()
    session = client.open_session().session_id
    request = p.CallRequest(request_id="r-logged-1", session_id=session, tool="read_file",
                            args={"path": "missing.txt"}, call_id="c-logged-1")
    with pytest.raises(RemoteError):
        client.request(request, p.CallResponse)
    lines = [json.loads(line) for line in (daemon.state_dir / "sandboxd.log").read_text().splitlines()]
    failed = [e for e in lines if e.get("request_id") == "r-logged-1" and "failed" in e["msg"]]
    assert len(failed) == 1, lines[-5:]
    assert failed[0]["session_id"] == session
    assert failed[0]["call_id"] == "c-logged-1"
    assert failed[0]["peer_key"] == "local"
    record = [e for e in lines if e.get("call_id") == "c-logged-1" and e is not failed[0]]
    assert record and record[0]["session_id"] == session


def test_only_metrics_is_served(metered: tuple[DaemonProcess, int]) -> None:
    _, port = metered
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    assert refused.value.code == 404


def test_a_non_loopback_metrics_address_needs_the_explicit_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no authentication"):
        load_config(state_dir=str(tmp_path), metrics_address="0.0.0.0:9464")
    with pytest.raises(ValueError, match="HOST:PORT"):
        load_config(state_dir=str(tmp_path), metrics_address="9464")
    assert load_config(state_dir=str(tmp_path), metrics_address="[::1]:9464").metrics_address == "[::1]:9464"
    allowed = load_config(state_dir=str(tmp_path), metrics_address="0.0.0.0:9464", metrics_allow_remote=True)
    assert allowed.metrics_allow_remote



def test_undecodable_frames_are_counted_by_code(metered: tuple[DaemonProcess, int]) -> None:
    daemon, port = metered
    client = daemon.client()
    before = scrape(port)
    client.send_raw(b"\xc1")
    client.send_raw(p.encode(p.HealthRequest(request_id="ok"))[:-3])
    client.send_raw(msgspec.msgpack.encode({"type": "Bogus", "request_id": "r"}))
    after = scrape(port)
    for code in ("bad_frame", "unknown_type"):
        moved = value(after, "sandboxd_errors_total", code=code) - value(before, "sandboxd_errors_total", code=code)
        assert moved >= 1, code
    assert value(after, "sandboxd_errors_total", code="unknown_type") - value(
        before, "sandboxd_errors_total", code="unknown_type") == 1
