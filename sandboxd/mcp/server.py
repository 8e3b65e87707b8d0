"""`sandboxd mcp`: one sandboxd session's tools over MCP, on stdio or streamable HTTP.

Built on the low-level `Server` of the official SDK: the daemon's JSON schemas go out exactly as the
daemon has them, and every failure of a call becomes a tool result with `isError` and the daemon's
code, never a protocol error the model cannot read. The SDK negotiates the revision: 2026-07-28
(`server/discover`, no handshake) for clients that probe for it, the `initialize` handshake
(up to 2025-11-25) for the others.

A held effect is answered as each revision allows waiting on a person. At 2026-07-28 the call returns
`InputRequiredResult` with only a `requestState` (sealed by the SDK's `RequestStateBoundary`): the
client retries the call, and each retry waits up to `hold_poll_s` for the operator before answering
again, so the client's own loop is the wait. Before 2026-07-28 there is no such result, so the call
itself waits, up to `hold_wait_s`, sending progress notifications while it does. Either way the
operator's `sandboxd outbox release` (or `drop`) ends it, and the call completes with the real result.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import anyio
import anyio.abc
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.server.stdio import stdio_server
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from sandboxd import __version__
from sandboxd.client import Client
from sandboxd.errors import SandboxdError
from sandboxd.mcp.options import McpOptions
from sandboxd.mcp.retries import idempotency_key
from sandboxd.mcp.session import McpSession, PendingCall
from sandboxd.mcp.tools import CLOSE_TOOL, Outcome, close_tool, error_outcome, mcp_tool, to_call_tool_result

log = logging.getLogger("sandboxd.mcp")

INSTRUCTIONS = (
    "Tools of one sandboxd session. read/write tools run in an isolated container under /workspace; external "
    "tools (mail, HTTP) go through a firewall that never sends one call twice: retrying a call with the same "
    "arguments is safe. An external call may be held for an operator's approval; waiting on it is safe. To send "
    "the same message twice on purpose within a minute, give each call its own _meta "
    "'sandboxd/idempotencyKey'. A result that starts with [sandboxd] Revocation tells you which earlier "
    "results to forget."
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def build_server(session: McpSession, options: McpOptions) -> Server[Any]:
    """The MCP server for one bridged session."""

    async def list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        session.touch()
        tools = [mcp_tool(m) for m in await session.refresh_tools()]
        return types.ListToolsResult(tools=tools + ([close_tool()] if options.close_tool else []))

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
                        ) -> types.CallToolResult | types.InputRequiredResult:
        session.touch()
        if options.close_tool and params.name == CLOSE_TOOL:
            await session.close_session()
            return to_call_tool_result(Outcome(text=f"session {session.session_id} closed", is_error=False,
                                               structured={"session_id": session.session_id, "state": "closed"}))
        try:
            key = idempotency_key(ctx.meta)
        except ValueError as exc:
            return to_call_tool_result(error_outcome("invalid_arguments", str(exc)))
        args = params.arguments or {}
        call = _resumed(session, params.request_state)
        if call is None:
            submitted = await session.submit(params.name, args, key)
            if isinstance(submitted, Outcome):
                return to_call_tool_result(submitted, session.take_notices(), session.session_id)
            call = submitted
        await call.settled.wait()
        if call.outcome is None:
            if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
                if params.request_state is not None:
                    with anyio.move_on_after(options.hold_poll_s):
                        await call.done.wait()
                if call.outcome is None:
                    return _input_required(call)
            else:
                await _wait_with_progress(ctx, call, options.hold_wait_s)
                if call.outcome is None:
                    return to_call_tool_result(_still_held(call), session_id=session.session_id)
        call.entry.delivered = True  # a request that gets this far answers; a cancelled one never does
        return to_call_tool_result(call.outcome, session.take_notices(), session.session_id)

    server: Server[Any] = Server("sandboxd", version=__version__, instructions=INSTRUCTIONS,
                                 on_list_tools=list_tools, on_call_tool=call_tool)
    server.middleware.append(RequestStateBoundary(RequestStateSecurity.ephemeral(ttl=max(600.0, options.hold_wait_s)),
                                                  default_audience="sandboxd"))
    return server


def _resumed(session: McpSession, request_state: str | None) -> PendingCall | None:
    """The held call a 2026-07-28 retry round names (the SDK has verified the state is ours and unaltered)."""
    if request_state is None:
        return None
    try:
        agent_call_id = json.loads(request_state)["agent_call_id"]
    except (ValueError, KeyError, TypeError):
        return None
    return session.pending.get(agent_call_id)


def _input_required(call: PendingCall) -> types.InputRequiredResult:
    assert call.hold is not None
    state = json.dumps({"agent_call_id": call.entry.agent_call_id, "call_id": call.hold.call_id})
    return types.InputRequiredResult(request_state=state, _meta={"sandboxd/held": call.hold.describe(),
                                                                 "sandboxd/session": call.hold.session_id})


def _still_held(call: PendingCall) -> Outcome:
    assert call.hold is not None
    return Outcome(text=call.hold.text(), is_error=False, structured={"held": call.hold.describe()})


async def _wait_with_progress(ctx: ServerRequestContext[Any], call: PendingCall, limit: float) -> None:
    """Wait for a held call's decision, telling the client every few seconds what it waits for."""
    assert call.hold is not None
    deadline = anyio.current_time() + limit
    reports = 0
    while not call.done.is_set() and anyio.current_time() < deadline:
        reports += 1
        await ctx.session.report_progress(reports, None, call.hold.text())
        with anyio.move_on_after(min(5.0, max(0.0, deadline - anyio.current_time()))):
            await call.done.wait()


class BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer TOKEN` (compared in constant time)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps({"error": "unauthorized", "message": "a bearer token is required"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b'Bearer realm="sandboxd"'),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def client_factory(options: McpOptions) -> Callable[[], Client]:
    """How each worker thread connects to the daemon (CURVE keys for a tcp:// daemon)."""
    if options.server_key is not None and options.client_key is not None:
        server_key, client_key = options.server_key, options.client_key
        return lambda: Client.with_key_files(options.endpoint, server_key, client_key, timeout_s=options.wait_s)
    return lambda: Client(options.endpoint, timeout_s=options.wait_s)


async def serve(options: McpOptions, announce: Callable[[str], None] | None = None) -> None:
    """Serve until the client goes away (stdio), a signal, or the idle timeout."""
    say = announce or (lambda text: print(text, file=sys.stderr, flush=True))
    session = McpSession(client_factory(options), options.session, image=options.image,
                         window_s=options.retry_window_s, in_flight_wait_s=options.wait_s)
    token = options.token or secrets.token_urlsafe(32)
    try:
        async with anyio.create_task_group() as tg:
            await session.start(tg)
            server = build_server(session, options)
            stop = anyio.Event()
            tg.start_soon(_watch_revocations, session, options.revocation_poll_s)
            if options.idle_timeout_s:
                tg.start_soon(_watch_idle, session, options.idle_timeout_s, stop)
            tg.start_soon(_watch_signals, stop)
            if options.transport == "stdio":
                say(f"sandboxd mcp: session {session.session_id} on stdio")
                tg.start_soon(_serve_stdio, server, stop)
            else:
                url = f"http://{options.host}:{options.port}{options.path}"
                say(f"sandboxd mcp: session {session.session_id} at {url}")
                if options.token is None:
                    say(f"sandboxd mcp: bearer token {token}")
                tg.start_soon(_serve_http, server, options, token, stop)
            await stop.wait()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            if options.closes_on_exit:
                await session.close_session()
                say(f"sandboxd mcp: session {session.session_id} closed")
            session.clients.close()


async def _serve_stdio(server: Server[Any], stop: anyio.Event) -> None:
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        stop.set()  # the client closed its end: the server's work is over


async def _serve_http(server: Server[Any], options: McpOptions, token: str, stop: anyio.Event) -> None:
    import uvicorn

    _QuietUvicorn = _quiet_uvicorn()
    app = BearerAuth(server.streamable_http_app(streamable_http_path=options.path, host=options.host), token)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", lifespan="on")
    http = _QuietUvicorn(config)

    async def shutdown() -> None:
        await stop.wait()
        http.should_exit = True

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(shutdown)
            await http.serve()
            tg.cancel_scope.cancel()
    finally:
        stop.set()


def _quiet_uvicorn() -> type[Any]:
    import uvicorn

    class Quiet(uvicorn.Server):
        """uvicorn without its signal handlers: ours stop the whole server (it would re-raise the signal
        after serving, killing the process before the session is closed)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Quiet


async def _watch_revocations(session: McpSession, every_s: float) -> None:
    """Take revocations while the client is idle too, so `sandboxd revoke --wait-done` gets its report."""
    while True:
        await anyio.sleep(every_s)
        try:
            await session.apply_revocations()
        except Exception as exc:  # the daemon may be restarting; the next round tries again
            log.warning("checking revocations of %s: %s", session.session_id, exc)


async def _watch_idle(session: McpSession, idle_s: float, stop: anyio.Event) -> None:
    """Close the session after `idle_s` without an MCP request and nothing running (a held call may wait)."""
    while True:
        idle = time.monotonic() - session.last_activity
        running = any(not c.settled.is_set() for c in session.pending.values())
        if idle >= idle_s and not running:
            log.warning("session %s idle for %.0f s: closing it", session.session_id, idle)
            await session.close_session()
            stop.set()
            return
        await anyio.sleep(max(0.1, idle_s - idle))


async def _watch_signals(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return


def run(options: McpOptions) -> None:
    """Blocking entry point of `sandboxd mcp`."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="sandboxd mcp: %(message)s")
    try:
        anyio.run(serve, options)
    except (SandboxdError, BaseExceptionGroup) as exc:
        cause = _first_sandboxd_error(exc)
        if cause is None:
            raise
        raise SystemExit(f"sandboxd mcp: {cause}") from exc


def _first_sandboxd_error(exc: BaseException) -> SandboxdError | None:
    """The daemon's refusal inside whatever task groups wrapped it (no session, no daemon, a closed session)."""
    if isinstance(exc, SandboxdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _first_sandboxd_error(inner)) is not None:
                return found
    return None
