"""`sandboxd mcp` driven by the MCP SDK's own client, over stdio and streamable HTTP, against a real daemon,
the Docker engine, and real SMTP and HTTP sinks that count what actually arrived.

Why one module of this size: the MCP server's tests share one world (daemon, sinks, server process)
that is costly to build; splitting them would build it once per file.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta, TextContent

from sandboxd.client import Client as DaemonClient
from sandboxd.launcher import DaemonProcess
from tests.sinks import HttpSink, MailSink, free_port

pytestmark = pytest.mark.docker

TOKEN = "test-token-" + "x" * 24


class FirstSlowSmtpSink(MailSink):
    """An SMTP sink that takes `delay` seconds to accept the next message after `arm()`, then is quick again."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0

    def arm(self, delay: float) -> None:
        self.delay = delay

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        reply = await super().handle_DATA(server, session, envelope)
        delay, self.delay = self.delay, 0.0
        await anyio.sleep(delay)  # accepted and counted, but the 250 comes late: the client's call times out
        return reply


class World:
    """One daemon with the firewall on (mail, HTTP, a webhook held for approval) and the sinks behind it."""

    def __init__(self, root: Path) -> None:
        self.smtp = FirstSlowSmtpSink()
        self.http = HttpSink()
        config = root / "sandboxd.toml"
        config.write_text("\n".join([
            "[firewall]", "adapter_timeout_s = 10.0",
            "[firewall.smtp]", 'host = "127.0.0.1"', f"port = {self.smtp.port}",
            "[firewall.http]", f'allowlist = ["127.0.0.1:{self.http.port}"]',
            "[firewall.webhook]", f'url = "{self.http.url("/hook")}"',
            "[firewall.release]", 'webhook = "manual"',
        ]) + "\n")
        self.daemon = DaemonProcess(root / "state", ["--config", str(config)])
        self.daemon.start()
        self.ops = DaemonClient(self.daemon.endpoint, timeout_s=60)

    def close(self) -> None:
        self.ops.close()
        self.daemon.shutdown()
        self.smtp.close()
        self.http.close()


@pytest.fixture(scope="module")
def world(engine: Any) -> Iterator[World]:
    root = Path(tempfile.mkdtemp(prefix="sandboxd-mcp-"))
    made = World(root)
    yield made
    made.close()
    shutil.rmtree(root, ignore_errors=True)


def mcp_args(world: World, *extra: str) -> list[str]:
    return ["-m", "sandboxd.cli", "mcp", "--endpoint", world.daemon.endpoint, "--hold-poll", "2", *extra]


@asynccontextmanager
async def stdio_client(world: World, *extra: str, **kwargs: Any) -> AsyncIterator[Client]:
    params = StdioServerParameters(command=sys.executable, args=mcp_args(world, *extra), cwd=os.getcwd())
    async with Client(params, **kwargs) as client:
        yield client


class HttpServer:
    """`sandboxd mcp --transport http` as a child process on a free loopback port."""

    def __init__(self, world: World, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc = subprocess.Popen([sys.executable, *mcp_args(world, "--transport", "http", "--port",
                                                                 str(self.port), "--token", TOKEN, *extra)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode() if self.proc.stderr else ""
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("sandboxd mcp did not listen in time")

    def stop(self) -> str:
        """SIGTERM, as a supervisor would; returns what the server said on stderr."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return err.decode()


@asynccontextmanager
async def http_client(server: HttpServer, token: str = TOKEN, **kwargs: Any) -> AsyncIterator[Client]:
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http:
        async with Client(streamable_http_client(server.url, http_client=http), **kwargs) as client:
            yield client


@asynccontextmanager
async def connect(world: World, transport: str, *extra: str, **kwargs: Any) -> AsyncIterator[Client]:
    if transport == "stdio":
        async with stdio_client(world, *extra, **kwargs) as client:
            yield client
        return
    server = HttpServer(world, *extra)
    try:
        async with http_client(server, **kwargs) as client:
            yield client
    finally:
        server.stop()


def text(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def error_code(result: CallToolResult) -> str:
    assert result.is_error, text(result)
    return str(result.structured_content["error"]["code"])


def key_meta(key: object) -> RequestParamsMeta:
    return cast(RequestParamsMeta, {"sandboxd/idempotencyKey": key})


def session_of(result: CallToolResult) -> str:
    assert result.meta is not None
    return str(result.meta["sandboxd/session"])


TRANSPORTS = ["stdio", "http"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tools_are_listed_with_annotations_and_each_builtin_runs(world: World, transport: str) -> None:
    async def main() -> None:
        async with connect(world, transport) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            daemon = {m.name: m for m in world.ops.tools()}
            assert set(listed) == set(daemon)
            for name, tool in listed.items():
                assert tool.input_schema == daemon[name].parameters
                hints = tool.annotations
                assert hints is not None
                effect = daemon[name].effect
                if effect == "read":
                    assert hints.read_only_hint is True
                    assert hints.open_world_hint is (name == "http_get")
                elif effect == "write":
                    assert hints.read_only_hint is False and hints.open_world_hint is False
                else:
                    assert hints.read_only_hint is False and hints.open_world_hint is True
                    assert hints.idempotent_hint is False
                    assert hints.destructive_hint is (name != "send_email")

            wrote = await client.call_tool("write_file", {"path": "notes/a.txt", "content": "alpha\n"})
            assert not wrote.is_error, text(wrote)
            assert text(await client.call_tool("read_file", {"path": "notes/a.txt"})) == "alpha\n"
            listing = await client.call_tool("list_dir", {"path": "notes"})
            assert '"notes/a.txt"' in text(listing) or "a.txt" in text(listing)
            shell = await client.call_tool("shell", {"command": "wc -c < notes/a.txt; exit 3"})
            assert not shell.is_error and text(shell).startswith("exit 3") and "6" in text(shell)
            assert text(await client.call_tool("python", {"code": "print(6 * 7)"})).strip() == "42"
            got = await client.call_tool("http_get", {"url": world.http.url("/page")})
            assert not got.is_error and got.structured_content["data"]["status"] == 200
            before = world.smtp.count
            sent = await client.call_tool("send_email", {"to": ["a@example.com"], "subject": "hi", "body": "b"})
            assert not sent.is_error and world.smtp.count == before + 1
            posted = await client.call_tool("http_request", {"method": "POST", "url": world.http.url("/p"),
                                                              "body": "x"})
            assert not posted.is_error and posted.structured_content["data"]["status"] == 200

            sid = session_of(wrote)
            graph = world.ops.graph(sid)
            kinds = [(a.artifact_id, a.type) for a in graph.artifacts]
            assert kinds[:2] == [("mcp-call-1", "tool_call"), ("mcp-obs-1", "observation")]
            assert len(kinds) == 16 and wrote.meta is not None and wrote.meta["sandboxd/observation"] == "mcp-obs-1"
            assert len(graph.checkpoints) >= 8  # one before every observation, one more before each external call

    anyio.run(main)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_calls_come_back_as_tool_errors_and_change_nothing(world: World, transport: str) -> None:
    async def main() -> None:
        async with connect(world, transport) as client:
            for path in ("../etc/passwd", "/etc/passwd", "a/../../x", "/workspace/../root"):
                assert error_code(await client.call_tool("read_file", {"path": path})) == "path_escape"
            assert error_code(await client.call_tool("write_file", {"path": "x"})) == "invalid_arguments"
            assert error_code(await client.call_tool("shell", {"command": "true", "bogus": 1})) == "invalid_arguments"
            assert error_code(await client.call_tool("no_such_tool", {})) == "unknown_tool"
            assert error_code(await client.call_tool("send_email", {"to": ["not an address"], "subject": "s",
                                                                    "body": "b"})) == "invalid_arguments"
            assert error_code(await client.call_tool("http_get", {"url": "http://203.0.113.9/"})) == "host_not_allowed"
            bad_key = await client.call_tool("read_file", {"path": "x"}, meta=key_meta(7))
            assert error_code(bad_key) == "invalid_arguments"
            # The session still serves, and none of the refused calls ran.
            listing = await client.call_tool("list_dir", {})
            assert not listing.is_error and text(listing).strip() == ""

    anyio.run(main)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_retried_send_after_a_client_timeout_is_delivered_once(world: World, transport: str) -> None:
    mail = {"to": ["ops@example.com"], "subject": f"report over {transport}", "body": "the numbers"}

    async def main() -> None:
        async with connect(world, transport) as client:
            before = world.smtp.count
            world.smtp.arm(3.0)
            with pytest.raises(MCPError):
                await client.call_tool("send_email", mail, read_timeout_seconds=1.0)
            retried = await client.call_tool("send_email", mail, read_timeout_seconds=30.0)
            assert not retried.is_error, text(retried)
            # Within the window the same call has the same answer: the ledger's one message.
            respelled = {"body": "the  numbers", "subject": mail["subject"], "to": mail["to"]}  # whitespace, key order
            again = await client.call_tool("send_email", respelled)
            assert again.structured_content == retried.structured_content
            await anyio.sleep(0.5)
            assert world.smtp.count == before + 1
            # A distinct idempotency key says "send it again": a second message, once.
            for _ in range(2):
                await client.call_tool("send_email", mail, meta=key_meta("second"))
            assert world.smtp.count == before + 2
            sent = [c for c in world.ops.calls(session_of(retried)) if c.tool == "send_email"]
            assert [c.state for c in sent] == ["done", "done"] and sent[0].occurrence == 0 and sent[1].occurrence == 1

    anyio.run(main)


def operator_decides(world: World, release: bool, found: list[str]) -> threading.Thread:
    """An operator who waits for the held webhook to reach the outbox, then releases or drops it."""
    def act() -> None:
        with DaemonClient(world.daemon.endpoint, timeout_s=30) as ops:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                held = [h for h in ops.outbox(None) if h.tool == "webhook"]
                if held:
                    found.append(held[0].call_id)
                    time.sleep(1.0)  # the client is in its waiting rounds by now
                    ops.release(held[0].call_id) if release else ops.drop(held[0].call_id)
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("transport", "mode"), [("stdio", "auto"), ("http", "auto"), ("stdio", "legacy")])
def test_a_held_webhook_completes_when_the_operator_releases_it(world: World, transport: str, mode: str) -> None:
    async def main() -> None:
        async with connect(world, transport, mode=mode) as client:
            assert client.protocol_version == ("2026-07-28" if mode == "auto" else "2025-11-25")
            before = world.http.count
            found: list[str] = []
            operator = operator_decides(world, True, found)
            reports: list[str | None] = []

            async def seen(progress: float, total: float | None, message: str | None) -> None:
                reports.append(message)

            result = await client.call_tool("webhook", {"body": {"event": mode, "n": 1}}, progress_callback=seen)
            operator.join()
            assert not result.is_error, text(result)
            assert result.structured_content["data"]["status"] == 200 and world.http.count == before + 1
            assert result.structured_content["call_id"] == found[0]
            if mode == "legacy":  # the handshake era has no input-required result: the call waits, reporting
                assert reports and "held" in str(reports[0])

            found.clear()
            operator = operator_decides(world, False, found)
            dropped = await client.call_tool("webhook", {"body": {"event": mode, "n": 2}})
            operator.join()
            assert error_code(dropped) == "dropped" and world.http.count == before + 1

    anyio.run(main)


def test_a_revoked_tool_result_rolls_the_sandbox_back(world: World) -> None:
    async def main() -> None:
        async with stdio_client(world) as client:
            await client.call_tool("write_file", {"path": "page.txt", "content": "a page"})
            # The target enters through this result only: the command that prints it does not spell it.
            source = await client.call_tool("shell", {"command": "printf 'the code word is sword%sfish' ''"})
            assert source.meta is not None and source.meta["sandboxd/observation"] == "mcp-obs-2"
            after = await client.call_tool("write_file", {"path": "acted.txt", "content": "swordfish"})
            sid = session_of(after)
            before = world.http.count
            results: list[CallToolResult] = []

            async with anyio.create_task_group() as tg:
                async def held_webhook() -> None:  # an effect of the suffix, still held when the revocation comes
                    results.append(await client.call_tool("webhook", {"body": {"acted": True}}))

                tg.start_soon(held_webhook)
                while not [h for h in world.ops.outbox(sid) if h.tool == "webhook"]:
                    await anyio.sleep(0.1)
                raised = world.ops.revoke(sid, "mcp-obs-2", "swordfish")
                deadline = time.monotonic() + 30
                report = None
                while report is None and time.monotonic() < deadline:
                    report = world.ops.revocation_status(raised.revocation.revocation_id).report
                    await anyio.sleep(0.2)
            assert report is not None, "the MCP server did not take the revocation"
            assert report.leak_scan["hits"] == 0, report.leak_scan
            assert any("mcp-obs-3" in note and "mcp-call-4" in note for note in report.not_erased)
            assert error_code(results[0]) == "dropped" and world.http.count == before

            listing = await client.call_tool("list_dir", {})
            assert "page.txt" in text(listing) and "acted.txt" not in text(listing)
            noticed = [r for r in (results[0], listing) if r.meta and "sandboxd/revocations" in r.meta]
            assert len(noticed) == 1
            notice = noticed[0].meta["sandboxd/revocations"][0]  # type: ignore[index]
            assert notice["source"] == "mcp-obs-2"
            assert {"mcp-call-3", "mcp-obs-3", "mcp-call-4"} <= set(notice["forget"])
            assert "Revocation" in text(noticed[0]) and "swordfish" not in text(noticed[0])
            graph = world.ops.graph(sid)
            contents = {a.artifact_id: a.content for a in graph.artifacts}
            assert "swordfish" not in contents["mcp-obs-2"] and "acted.txt" not in contents.get("mcp-call-3", "")
            assert all(c.state == "dropped" for c in world.ops.calls(sid) if c.tool == "webhook")

    anyio.run(main)


def test_http_needs_the_bearer_token_and_close_on_exit_closes_the_session(world: World) -> None:
    server = HttpServer(world)
    try:
        async def refused() -> None:
            async with http_client(server, token="wrong-" + "y" * 20) as client:
                await client.list_tools()

        with pytest.raises(BaseException):  # noqa: B017  the SDK wraps the 401 in its own error group
            anyio.run(refused)

        async def works() -> str:
            async with http_client(server) as client:
                return session_of(await client.call_tool("list_dir", {}))

        sid = anyio.run(works)
        assert sid in {s.session_id for s in world.ops.sessions()}
    finally:
        err = server.stop()
    assert f"session {sid} closed" in err
    assert sid not in {s.session_id for s in world.ops.sessions()}


def test_a_retry_after_the_mcp_server_restarted_is_still_delivered_once(world: World) -> None:
    """The first server goes away with the send in flight; a new one attached to the session takes the retry."""
    sid = world.ops.open_session().session_id
    mail = {"to": ["ops@example.com"], "subject": "across a restart", "body": "once"}

    async def first() -> None:
        async with stdio_client(world, "--session", sid) as client:
            await client.call_tool("shell", {"command": "echo hi > log.txt"})
            world.smtp.arm(2.0)
            with pytest.raises(MCPError):
                await client.call_tool("send_email", mail, read_timeout_seconds=0.5)

    async def second() -> CallToolResult:
        async with stdio_client(world, "--session", sid) as client:
            result = await client.call_tool("send_email", mail)
            listing = await client.call_tool("read_file", {"path": "log.txt"})
            assert text(listing) == "hi\n" and listing.meta is not None
            assert listing.meta["sandboxd/observation"] == "mcp-obs-3"  # the record goes on where it stopped
            return result

    try:
        before = world.smtp.count
        anyio.run(first)
        retried = anyio.run(second)
        assert not retried.is_error, text(retried)
        time.sleep(0.5)
        assert world.smtp.count == before + 1
        assert sid in {s.session_id for s in world.ops.sessions()}  # attached, so never closed on exit
    finally:
        world.ops.close_session(sid)


def test_the_idle_timeout_closes_the_session_and_stops_the_server(world: World) -> None:
    server = HttpServer(world, "--idle-timeout", "1")

    async def one_call() -> str:
        async with http_client(server) as client:
            return session_of(await client.call_tool("list_dir", {}))

    try:
        sid = anyio.run(one_call)
        server.proc.wait(timeout=30)  # it stops by itself
        assert sid not in {s.session_id for s in world.ops.sessions()}
    finally:
        err = server.stop() if server.proc.poll() is None else (server.proc.stderr.read().decode()
                                                                 if server.proc.stderr else "")
    assert "idle" in err


def test_a_session_that_cannot_be_served_is_a_clear_error(world: World) -> None:
    done = subprocess.run([sys.executable, *mcp_args(world, "--session", "s-000000000000")], capture_output=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode != 0 and b"sandboxd mcp: " in done.stderr and b"Traceback" not in done.stderr
