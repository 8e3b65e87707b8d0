"""What an operator judges a call by: its preview is one bounded line, its digest pins the exact payload;
streamed output reaches a poller in order; cgroup usage is read from either layout, a process's start
time from its stat."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.firewall.approvals import PREVIEW_CHARS, digest, preview, unknown_advice
from sandboxd.sandbox.usage import container_usage, start_time
from sandboxd.streams import Streams

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=12)
arguments = st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=6)


@settings(max_examples=300, deadline=None)
@given(arguments)
def test_preview_is_one_bounded_line_without_the_target(args: dict[str, Any]) -> None:
    line = preview(args)
    assert "\n" not in line and "\r" not in line and len(line) <= PREVIEW_CHARS
    assert preview({**args, "to": ["a@b.c"], "url": "http://x/"}) == line


@settings(max_examples=300, deadline=None)
@given(arguments, arguments)
def test_digest_is_of_the_exact_payload(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert digest(a) == digest(dict(reversed(list(a.items()))))  # key order is not content
    assert (digest(a) == digest(b)) == (a == b)
    assert digest(a).startswith("sha256:") and len(digest(a)) == 7 + 64


def test_unknown_advice_names_the_call_and_both_outcomes() -> None:
    advice = unknown_advice("fx-1", "POST http://h/pay")
    assert "fx-1" in advice and "--outcome done" in advice and "--outcome failed" in advice
    assert "POST http://h/pay" in advice


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["out", "err"]), st.text(min_size=1, max_size=20)), max_size=30))
def test_a_poller_reads_each_stream_whole_and_in_order(chunks: list[tuple[str, str]]) -> None:
    streams = Streams()
    writer = streams.open("s", "c")

    def produce() -> None:
        for stream, text in chunks:
            writer.write(stream, text)
        streams.close("s", "c")

    thread = threading.Thread(target=produce)
    thread.start()
    out = err = ""
    while True:
        more_out, more_err, running = streams.read("s", "c", len(out), len(err), timeout_s=1.0)
        out, err = out + more_out, err + more_err
        if not running and not (more_out or more_err):
            break
    thread.join()
    assert out == "".join(t for s, t in chunks if s == "out") and err == "".join(t for s, t in chunks if s == "err")


def test_a_call_polled_before_it_starts_reads_as_running() -> None:
    assert Streams().read("s", "never", 0, 0, timeout_s=0.05) == ("", "", True)


def test_usage_from_cgroup_v1_and_v2_layouts(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    for controller, name, value in (("memory", "memory.usage_in_bytes", "1048576"),
                                    ("cpuacct", "cpuacct.usage", "2500000000"), ("pids", "pids.current", "3")):
        (v1 / controller / "docker" / "abc").mkdir(parents=True)
        (v1 / controller / "docker" / "abc" / name).write_text(value + "\n")
    assert container_usage("abc", v1) == {"memory_bytes": 1048576, "cpu_s": 2.5, "pids": 3}
    v2 = tmp_path / "v2" / "system.slice" / "docker-abc.scope"
    v2.mkdir(parents=True)
    for name, value in (("cgroup.controllers", "cpu memory pids"), ("memory.current", "4096"),
                        ("cpu.stat", "usage_usec 1500000\nuser_usec 1"), ("pids.current", "2")):
        (v2 / name).write_text(value + "\n")
    assert container_usage("abc", tmp_path / "v2") == {"memory_bytes": 4096, "cpu_s": 1.5, "pids": 2}
    assert container_usage("missing", v1) == {} and container_usage("../etc", v1) == {}
    assert container_usage(None, v1) == {}


def test_a_process_start_time_reads_past_a_name_with_parentheses(tmp_path: Path) -> None:
    # The command name is in parentheses and may hold ") " itself: fields are counted after the last ")".
    (tmp_path / "7").mkdir()
    fields = ["S", "1", "7", "7"] + [str(n) for n in range(15)] + ["424242", "0"]
    (tmp_path / "7" / "stat").write_text("7 (a) b (c) " + " ".join(fields) + "\n")
    assert start_time(7, tmp_path) == "424242"
    assert start_time(8, tmp_path) is None  # gone
    assert start_time(os.getpid()) == start_time(os.getpid()) is not None
