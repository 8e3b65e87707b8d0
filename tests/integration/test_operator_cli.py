"""The operator's CLI against a live daemon, real SMTP and HTTP sinks counting what actually arrived.

Approvals an operator can judge (target, preview, digest, age, state, who decided and why, unknown calls
with advice, a closed session's holds), a CLI that is complete (turns, arguments from files and stdin,
call ids minted and retried by, cp, streaming, sessions with their use and their timeouts), and failures
that say what happened (truncation with the full size, binary files, a timed-out call's output, frames
refused by the client, a daemon that is not there, timeouts that say whether the request had left).
Every bad input gets its clear error, and the daemon goes on serving.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from sandboxd import protocol as p
from sandboxd.client import Client, DaemonUnreachable, FrameTooLarge, RemoteError
from sandboxd.launcher import DaemonProcess
from tests.sinks import HttpSink, SmtpSink

pytestmark = pytest.mark.docker


@dataclass
class Cli:
    """`sandboxd` run as a command against one daemon, as an operator types it."""

    endpoint: str

    def __call__(self, *argv: str, stdin: bytes | None = None, ok: bool = True,
                 timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        command, rest = argv[0], list(argv[1:])
        done = subprocess.run([sys.executable, "-m", "sandboxd.cli", command, "--endpoint", self.endpoint, *rest],
                              input=stdin.decode() if stdin is not None else None, capture_output=True, text=True,
                              timeout=timeout)
        if ok:
            assert done.returncode == 0, f"{argv}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def json(self, *argv: str) -> Any:
        return json.loads(self(*argv, "--json").stdout)

    def fails(self, *argv: str, code: str, stdin: bytes | None = None) -> str:
        """Run a command that must fail with `code`; returns what it printed on stderr."""
        done = self(*argv, ok=False, stdin=stdin)
        assert done.returncode != 0, f"{argv} succeeded: {done.stdout}"
        assert code in done.stderr, f"{argv}: wanted {code}, got {done.stderr}"
        return done.stderr


def minted(stderr: str) -> str:
    """The call id the CLI printed for an effectful call."""
    line = next(line for line in stderr.splitlines() if line.startswith("sandboxd: call id "))
    return line.split()[3].rstrip(";")


@pytest.fixture
def smtp() -> Iterator[SmtpSink]:
    sink = SmtpSink()
    controller = Controller(sink, hostname="127.0.0.1", port=sink.port)
    controller.start()
    yield sink
    controller.stop()


@pytest.fixture
def http() -> Iterator[HttpSink]:
    sink = HttpSink(delay=3.0)
    yield sink
    sink.close()


@pytest.fixture
def firewalled(daemon_factory: Callable[..., DaemonProcess], smtp: SmtpSink, http: HttpSink,
               tmp_path: Path) -> DaemonProcess:
    """A daemon whose mail and webhooks are held (manual, on_commit) and whose HTTP requests fire at once."""
    path = tmp_path / "sandboxd.toml"
    path.write_text("\n".join([
        "[firewall]", "adapter_timeout_s = 1.0",
        "[firewall.smtp]", 'host = "127.0.0.1"', f"port = {smtp.port}",
        "[firewall.http]", f'allowlist = ["127.0.0.1:{http.port}"]',
        "[firewall.webhook]", f'url = "{http.url("/hook")}"',
        "[firewall.release]", 'send_email = "manual"', 'webhook = "on_commit"',
    ]) + "\n")
    return daemon_factory(["--config", str(path)])


def mail(to: str, subject: str, body: str) -> str:
    return json.dumps({"to": [to], "subject": subject, "body": body})


def test_approvals_an_operator_can_judge(firewalled: DaemonProcess, smtp: SmtpSink, http: HttpSink) -> None:
    cli = Cli(firewalled.endpoint)
    a, b = cli("session", "open").stdout.strip(), cli("session", "open").stdout.strip()
    sent = cli("call", a, "send_email", "--args", mail("cfo@example.test", "Q3 wire", "pay 10k to acct 42"))
    held = minted(sent.stderr)
    assert "is held" in sent.stderr and smtp.count == 0
    other = minted(cli("call", b, "send_email", "--args", mail("x@example.test", "hi", "later")).stderr)

    # The table shows what is being approved: recipient, payload, digest, age, state.
    table = cli("outbox", a).stdout
    row = next(line for line in table.splitlines() if "cfo@example.test" in line)
    assert "send_email" in row and "staged" in row and "manual" in row
    # Its age, in seconds (a few: every CLI run starts a Python on a machine that may be busy).
    assert "subject=Q3 wire" in row and "body=pay 10k" in row and re.search(r"  \d{1,2}s  ", row), row
    box = cli.json("outbox", a)
    [entry] = box["held"]
    assert entry["target"] == "cfo@example.test" and entry["digest"].startswith("sha256:")
    assert entry["digest"][7:19] in row and entry["agent_call_ids"] == [held]
    assert {c["session_id"] for c in cli.json("outbox", "all")["held"]} == {a, b}

    # A mistyped session is an error, not an empty outbox; so are calls of one.
    for command in (("outbox", "s-doesnotexist"), ("calls", "s-doesnotexist")):
        assert "no session 's-doesnotexist'" in cli.fails(*command, code="unknown_session")

    # Dropped and released with reasons, recorded with who decided.
    cli("outbox", "drop", entry["call_id"], "--reason", "not approved by finance")
    calls = {c["call_id"]: c for c in cli.json("calls", a)}
    decided = calls[entry["call_id"]]
    assert decided["state"] == "dropped" and decided["decided_by"] == "local"
    assert decided["reason"] == "not approved by finance" and smtp.count == 0
    assert "local: not approved by finance" in cli("calls", a).stdout

    # calls all: every session's, with its session named.
    every = cli("calls", "all")
    assert "SESSION" in every.stdout and a in every.stdout and b in every.stdout

    # A closed session's held call needs --force.
    cli("session", "close", b)
    [closed] = [h for h in cli.json("outbox", "all")["held"] if h["session_id"] == b]
    assert closed["session_state"] == "closed" and "needs --force" in cli("outbox", "all").stdout
    assert "--force" in cli.fails("outbox", "release", closed["call_id"], code="session_closed")
    assert smtp.count == 0
    cli("outbox", "release", closed["call_id"], "--force", "--reason", "promised to the customer")
    assert smtp.count == 1 and smtp.messages[0][1] == ["x@example.test"]
    assert other in [i for c in cli.json("calls", "all") for i in c["agent_call_ids"]]

    # Bad decisions are refused with their reason, and nothing fires.
    cli.fails("outbox", "release", "no-such-call", code="invalid_state")
    cli.fails("outbox", "release", closed["call_id"], code="invalid_state")  # already released
    cli.fails("outbox", "drop", entry["call_id"], code="invalid_state")  # already dropped
    assert "--force is for release" in cli.fails("outbox", "drop", entry["call_id"], "--force", code="--force")
    assert smtp.count == 1 and cli("health").returncode == 0


def test_unknown_effect_is_listed_with_advice_and_a_retry_never_fires_it_again(firewalled: DaemonProcess,
                                                                               http: HttpSink) -> None:
    cli = Cli(firewalled.endpoint)
    sid = cli("session", "open").stdout.strip()
    post = json.dumps({"method": "POST", "url": http.url("/slow/pay"), "body": "amount=10"})
    first = cli("call", sid, "http_request", "--args", post, ok=False)
    call_id = minted(first.stderr)
    assert "adapter_timeout" in first.stderr and "after the request was sent" in first.stderr
    assert http.count == 1

    # The outbox lists it, with what to do.
    box = cli.json("outbox", sid)
    [unknown] = box["unknown"]
    assert unknown["state"] == "unknown" and unknown["target"] == f"POST {http.url('/slow/pay')}"
    assert "calls resolve" in unknown["advice"] and call_id in unknown["agent_call_ids"]
    text = cli("outbox", sid).stdout
    assert "outcome unknown" in text and f"calls resolve {unknown['call_id']} --outcome done" in text

    # Retried by its printed id, twice: never fired again.
    for _ in range(2):
        cli.fails("call", sid, "http_request", "--args", post, "--retry", call_id, code="call_unknown")
    time.sleep(0.5)
    assert http.count == 1
    # Retrying an id that never was is refused before anything is sent.
    assert "no call never-made" in cli.fails("call", sid, "http_request", "--args", post, "--retry", "never-made",
                                             code="to retry")
    assert http.count == 1

    resolved = cli("calls", "resolve", unknown["call_id"], "--outcome", "done", "--reason", "sink log shows it")
    assert "done" in resolved.stdout and "local" in resolved.stdout
    again = cli.json("call", sid, "http_request", "--args", post, "--retry", call_id)
    assert again["deduplicated"] and http.count == 1
    [call] = [c for c in cli.json("calls", sid) if c["call_id"] == unknown["call_id"]]
    assert call["decided_by"] == "local" and call["reason"] == "sink log shows it" and call["advice"] is None


def test_turns_argument_files_and_call_ids(firewalled: DaemonProcess, http: HttpSink, tmp_path: Path) -> None:
    cli = Cli(firewalled.endpoint)
    sid = cli("session", "open").stdout.strip()
    # An on_commit tool needs its turn; with one it waits for the commit.
    assert "turn" in cli.fails("call", sid, "webhook", "--args", '{"body": 1}', code="invalid_arguments")
    cli("call", sid, "webhook", "--args", '{"body": {"n": 1}}', "--turn", "3")
    assert http.count == 0
    assert "done" in cli("commit", sid, "3").stdout and http.count == 1

    # Arguments over the command line's 128 KiB, from a file and from stdin.
    big = {"body": {"blob": "x" * 300_000}}
    (tmp_path / "args.json").write_text(json.dumps(big))
    cli("call", sid, "webhook", "--args", f"@{tmp_path / 'args.json'}", "--turn", "4")
    cli("call", sid, "shell", "--args", "-", stdin=json.dumps({"command": "cat > big.txt", "stdin": "y" * 200_000})
        .encode())
    assert cli("call", sid, "shell", "--args", '{"command": "wc -c < big.txt"}').stdout.strip() == "200000"
    # A shell command itself over Linux's 128 KiB per exec argument, up to near the 8 MiB frame limit.
    for size in (200_000, 7_000_000):
        (tmp_path / "cmd.json").write_text(json.dumps({"command": f"x={'a' * size}; echo ${{#x}}"}))
        assert cli("call", sid, "shell", "--args", f"@{tmp_path / 'cmd.json'}").stdout.strip() == str(size)
    cli("commit", sid, "4")
    assert http.count == 2 and len(http.requests[1]["body"]) > 300_000

    # The user's own id is kept and shown.
    cli("call", sid, "webhook", "--args", '{"body": 2}', "--turn", "5", "--call-id", "my-hook-1")
    table = cli("calls", sid).stdout
    assert "my-hook-1" in next(line for line in table.splitlines() if "webhook" in line and "staged" in line)
    # A sandbox call retried by its minted id is answered from its record, not run again.
    appended = cli("call", sid, "shell", "--args", '{"command": "echo once >> log.txt"}')
    cli("call", sid, "shell", "--args", '{"command": "echo once >> log.txt"}', "--retry", minted(appended.stderr))
    assert cli("call", sid, "read_file", "--args", '{"path": "log.txt"}').stdout == "once\n"

    # Bad arguments: each its own clear message, nothing sent.
    assert "cannot read" in cli.fails("call", sid, "webhook", "--args", "@/nonexistent.json", code="--args")
    assert "not valid JSON" in cli.fails("call", sid, "webhook", "--args", "-", code="--args", stdin=b"{nope")
    assert "JSON object" in cli.fails("call", sid, "webhook", "--args", "[1]", code="--args")
    assert "different calls" in cli.fails("call", sid, "webhook", "--args", "{}", "--retry", "a", "--call-id", "b",
                                          code="--retry")
    assert http.count == 2 and cli("health").returncode == 0


def test_cp_is_byte_exact_both_ways(daemon: DaemonProcess, tmp_path: Path) -> None:
    cli = Cli(daemon.endpoint)
    sid = cli("session", "open").stdout.strip()
    rng = random.Random(16)
    # Every byte value, NULs and invalid UTF-8, empty, and sizes around the CLI's 2 MiB chunk.
    cases = {"empty": b"", "nul": b"\x00", "all": bytes(range(256)) * 3,
             "chunk": rng.randbytes(2 * 1024 * 1024), "chunk+1": rng.randbytes(2 * 1024 * 1024 + 1),
             "many": rng.randbytes(5 * 1024 * 1024 + 17)}
    for name, data in cases.items():
        local = tmp_path / f"{name}.bin"
        local.write_bytes(data)
        assert f"copied {len(data)} bytes" in cli("cp", str(local), f"{sid}:in/{name}.bin").stdout
        back = tmp_path / f"{name}.back"
        cli("cp", f"{sid}:in/{name}.bin", str(back))
        assert back.read_bytes() == data, name
    # What the sandbox sees is the same bytes.
    digest = cli("call", sid, "shell", "--args", '{"command": "sha256sum in/all.bin"}').stdout.split()[0]
    assert digest == hashlib.sha256(cases["all"]).hexdigest()
    # Out to stdout; into a directory keeps the name.
    assert cli("cp", f"{sid}:in/nul.bin", "-").stdout == "\x00"
    cli("cp", f"{sid}:in/all.bin", str(tmp_path))
    assert (tmp_path / "all.bin").read_bytes() == cases["all"]
    # Binary files read as text are not mangled: the read says so and names cp.
    read = cli("call", sid, "read_file", "--args", '{"path": "in/all.bin"}', ok=False)
    assert read.returncode == 1 and read.stdout == "" and "binary file (768 bytes)" in read.stderr
    assert "sandboxd cp" in read.stderr

    # Every chunk is among the session's calls, with its size and digest (never its bytes), failures too.
    copies = [c for c in cli.json("calls", sid) if c["tool"] in ("cp_in", "cp_out")]
    into = [c for c in copies if c["tool"] == "cp_in" and c["args"]["path"] == "in/all.bin"]
    assert [(c["state"], c["args"]["sha256"], c["args"]["bytes"]) for c in into] == [
        ("done", hashlib.sha256(cases["all"]).hexdigest(), 768)]
    assert sum(c["args"]["bytes"] for c in copies if c["args"]["path"] == "in/many.bin" and c["tool"] == "cp_in") \
        == len(cases["many"])
    out = [c for c in copies if c["tool"] == "cp_out" and c["args"]["path"] == "in/chunk.bin"]
    assert out and all(c["state"] == "done" for c in out)
    assert sum(c["result"]["bytes"] for c in out) == len(cases["chunk"])
    assert all(len(json.dumps(c)) < 2000 for c in copies)

    # Bad input: escapes, missing files, directories, two local paths.
    cli.fails("cp", str(tmp_path / "all.bin"), f"{sid}:../../etc/evil", code="path_escape")
    cli.fails("cp", f"{sid}:/etc/passwd", str(tmp_path / "x"), code="path_escape")
    cli.fails("cp", f"{sid}:nothing-here", str(tmp_path / "x"), code="not_found")
    cli.fails("cp", f"{sid}:in", str(tmp_path / "x"), code="invalid_arguments")
    cli.fails("cp", str(tmp_path / "all.bin"), str(tmp_path / "y"), code="exactly one")
    cli.fails("cp", str(tmp_path / "absent"), f"{sid}:a", code="cannot read")
    cli.fails("cp", str(tmp_path / "all.bin"), "s-doesnotexist:a", code="unknown_session")
    assert not (tmp_path / "x").exists() and cli("health").returncode == 0
    failed = [c for c in cli.json("calls", sid) if c["tool"] == "cp_out" and c["args"]["path"] == "nothing-here"]
    assert [c["state"] for c in failed] == ["error"] and "not_found" in failed[0]["error"]


def test_streamed_output_comes_as_it_is_written(daemon: DaemonProcess) -> None:
    cli = Cli(daemon.endpoint)
    sid = cli("session", "open").stdout.strip()
    command = json.dumps({"command": "for i in 1 2 3 4; do echo line $i; sleep 1; done; echo done >&2"})
    proc = subprocess.Popen([sys.executable, "-m", "sandboxd.cli", "call", "--endpoint", daemon.endpoint, sid,
                             "shell", "--stream", "--args", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append((time.monotonic(), line))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and [line for _, line in seen] == [f"line {i}\n" for i in range(1, 5)]
    # Printed as written: a second apart, not all at the end.
    assert seen[-1][0] - seen[0][0] > 2.0
    assert "done" in err and "call id cli-" in err


def test_sessions_show_age_idle_use_and_close_by_timeout(daemon: DaemonProcess) -> None:
    cli = Cli(daemon.endpoint)
    # Opened last, with room for the listings below: each CLI run starts a Python, seconds on a busy machine.
    kept = cli("session", "open").stdout.strip()
    ttl = cli("session", "open", "--ttl", "15").stdout.strip()
    idle = cli("session", "open", "--idle-timeout", "10").stdout.strip()
    listed = {s["session_id"]: s for s in cli.json("session", "list")}
    assert listed[idle]["idle_timeout_s"] == 10 and listed[ttl]["ttl_s"] == 15
    assert listed[kept]["usage"].get("memory_bytes", 0) > 0 and listed[kept]["usage"].get("pids", 0) >= 1
    table = cli("session", "list").stdout
    assert "IDLE" in table and "MEMORY" in table and "DISK" in table and "idle 10s" in table and "never" in table
    # The ttl session is kept busy: it closes at its time to live all the same; the idle one, idle, closes.
    started = time.monotonic()
    while True:
        cli("call", ttl, "shell", "--args", '{"command": "true"}', ok=False)
        states = {s["session_id"]: s["state"] for s in cli.json("session", "list", "--all")}
        if states[idle] == states[ttl] == "closed" or time.monotonic() - started > 40:
            break
    assert states[idle] == "closed" and states[ttl] == "closed" and states[kept] == "open"
    cli.fails("call", idle, "shell", "--args", '{"command": "true"}', code="session_closed")
    # Bad timeouts are refused by the CLI and, sent raw, by the daemon.
    cli.fails("session", "open", "--ttl", "-1", code="positive")
    client = daemon.client()
    for bad in ({"ttl_s": 0.0}, {"idle_timeout_s": -5.0}, {"ttl_s": float("nan")}):
        reply = client.send_raw(p.encode(p.OpenSessionRequest(request_id="bad", **bad)))  # type: ignore[arg-type]
        assert isinstance(reply, p.ErrorResponse) and reply.code == "invalid_field"
    assert client.health().open_sessions == 1
    # Disk use is the workspace and its snapshots on the host: 4 MB written shows.
    empty = listed[kept]["usage"]["disk_bytes"]
    cli("call", kept, "shell", "--args", '{"command": "head -c 4000000 /dev/urandom > blob; sync"}')
    deadline = time.monotonic() + 20
    while (grown := disk_of(cli, kept)) < empty + 3_900_000:
        assert time.monotonic() < deadline, (empty, grown)
        time.sleep(0.5)


def disk_of(cli: Cli, sid: str) -> int:
    return int(next(s for s in cli.json("session", "list") if s["session_id"] == sid)["usage"]["disk_bytes"])


def test_clear_failures(firewalled: DaemonProcess, http: HttpSink, tmp_path: Path) -> None:
    cli = Cli(firewalled.endpoint)
    sid = cli("session", "open").stdout.strip()
    # Truncation is announced with the full size, in plain output.
    flood = cli("call", sid, "shell", "--args", '{"command": "head -c 100000 /dev/zero | tr \'\\\\0\' a"}')
    assert len(flood.stdout) == 65536 and "stdout truncated: 65536 bytes shown of 100000 bytes" in flood.stderr
    cli("call", sid, "shell", "--args", '{"command": "head -c 3000000 /dev/zero | tr \'\\\\0\' b > big.txt"}')
    read = cli("call", sid, "read_file", "--args", '{"path": "big.txt"}')
    assert "shown of 3000000 bytes" in read.stderr and "sandboxd cp" in read.stderr
    assert cli.json("call", sid, "read_file", "--args", '{"path": "big.txt"}')["stdout_size"] == 3000000

    # A timed-out call's output so far is shown in plain output.
    slow = cli("call", sid, "shell", "--call-timeout", "1", "--args", '{"command": "echo before; sleep 10"}', ok=False)
    assert slow.returncode == 2 and slow.stdout == "before\n" and "tool_timeout" in slow.stderr
    assert "before it was stopped" in slow.stderr

    # An oversized frame is refused by the client at once, and the daemon is none the worse.
    client = firewalled.client()
    started = time.monotonic()
    with pytest.raises(FrameTooLarge) as err:
        client.call(sid, "shell", {"command": "x" * (50 * 1024 * 1024)})
    assert err.value.code.value == "frame_too_large" and time.monotonic() - started < 5
    (tmp_path / "huge.json").write_text(json.dumps({"command": "y" * (50 * 1024 * 1024)}))
    started = time.monotonic()
    cli.fails("call", sid, "shell", "--args", f"@{tmp_path / 'huge.json'}", code="frame_too_large")
    assert time.monotonic() - started < 20 and client.health().open_sessions == 1

    # A daemon that is not there: daemon_unreachable after the short wait, not 120 s of sandbox_unavailable.
    gone = Cli(f"ipc://{tmp_path / 'nobody.sock'}")
    started = time.monotonic()
    assert "is `sandboxd serve` running" in gone.fails("session", "list", "--connect-wait", "1",
                                                         code="daemon_unreachable")
    assert time.monotonic() - started < 10
    with pytest.raises(DaemonUnreachable) as unreachable:
        Client(gone.endpoint, connect_timeout_s=0.5).health()
    assert unreachable.value.code.value == "daemon_unreachable"

    # A read that timed out after its request left says so (the sink has it), not "before anything was sent".
    with pytest.raises(RemoteError) as timeout:
        client.call(sid, "http_get", {"url": http.url("/slow/page")})
    assert timeout.value.wire_code == "adapter_timeout" and timeout.value.details["sent"] is True
    assert "after the request was sent" in timeout.value.message and "before anything" not in timeout.value.message
    assert http.count == 1 and client.health().open_sessions == 1


def test_timeout_partial_output_is_filtered_of_forgotten_values(daemon: DaemonProcess) -> None:
    client = daemon.client()
    sid = client.open_session(forget=["hunter2-secret"]).session_id
    with pytest.raises(RemoteError) as err:
        client.call(sid, "shell", {"command": "echo pw=hunter2-secret; sleep 10"}, timeout_s=1)
    assert err.value.wire_code == "tool_timeout" and "hunter2-secret" not in json.dumps(err.value.details)
    assert "pw=" in err.value.details["stdout"]
