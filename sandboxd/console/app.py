"""The console's web application: Starlette routes over `sandboxd.client`, no other path into the state.

Every page is behind a login with a random token printed at start (as Jupyter does), or with the secret
of an operator's CURVE key (`operator_keys`: the public keys it may be the secret of; the console checks
the pair and keeps no secret); either sets a session cookie. Every POST carries a CSRF token derived
from the login token, checked before anything is done. The client is not thread-safe, so each worker
thread keeps its own (`_client`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from sandboxd.client import Client
from sandboxd.console.views import approvals, decisions, plots, revoked, session_rows, timeline
from sandboxd.revocation.graph_render import render

COOKIE = "sandboxd_console"
TEMPLATES = Path(__file__).with_name("templates")


class Console:
    """The console's state: how to reach the daemon and the login token; nothing of the daemon's."""

    def __init__(self, make_client: Callable[[], Client], token: str | None = None,
                 operator_keys: frozenset[str] = frozenset()) -> None:
        self.make_client = make_client
        self.token = token or secrets.token_urlsafe(24)
        self.operator_keys = operator_keys
        """z85 public keys whose secret logs in, as the token does."""
        self.csrf = hmac.new(self.token.encode(), b"csrf", hashlib.sha256).hexdigest()
        self._local = threading.local()
        self.env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))

    def client(self) -> Client:
        if getattr(self._local, "client", None) is None:
            self._local.client = self.make_client()
        return self._local.client

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await run_in_threadpool(fn, *args, **kwargs)

    def admits(self, given: str) -> bool:
        """The token, or the secret key of an operator (z85, or the whole `NAME.key_secret` file pasted)."""
        if hmac.compare_digest(given.encode(), self.token.encode()):
            return True
        if not self.operator_keys:
            return False
        secret = operator_secret(given)
        if secret is None:
            return False
        try:
            public = zmq.curve_public(secret.encode()).decode()
        except zmq.ZMQError:  # 40 characters of the alphabet that still decode to no key
            return False
        return any(hmac.compare_digest(public, key) for key in self.operator_keys)

    def logged_in(self, request: Request) -> bool:
        return hmac.compare_digest(request.cookies.get(COOKIE, ""), self.token)

    def page(self, name: str, **context: Any) -> HTMLResponse:
        return HTMLResponse(self.env.get_template(name).render(csrf=self.csrf, **context))


def build_app(console: Console) -> Starlette:
    """The ASGI application."""

    def guarded(handler: Callable[[Request], Any], post: bool = False) -> Callable[[Request], Any]:
        async def wrapped(request: Request) -> Response:
            if not console.logged_in(request):
                if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
                return PlainTextResponse("log in with the console's token", status_code=401)
            if post:
                form = await request.form()
                if not hmac.compare_digest(str(form.get("csrf", "")), console.csrf):
                    return PlainTextResponse("missing or wrong CSRF token", status_code=403)
                request.state.form = form
            result: Response = await handler(request)
            return result
        return wrapped

    async def login(request: Request) -> Response:
        if request.method == "POST":
            form = await request.form()
            given = str(form.get("token", ""))
            if not console.admits(given):
                keys = bool(console.operator_keys)
                return console.page("login.html", error="wrong token or key" if keys else "wrong token", keys=keys)
            target = str(form.get("next") or "/")
            response = RedirectResponse(target if target.startswith("/") else "/", status_code=303)
            response.set_cookie(COOKIE, console.token, httponly=True, samesite="strict")
            return response
        token = request.query_params.get("token")
        if token is not None and hmac.compare_digest(token, console.token):
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, console.token, httponly=True, samesite="strict")
            return response
        return console.page("login.html", error=None, next=request.query_params.get("next", "/"),
                            keys=bool(console.operator_keys))

    async def index(request: Request) -> Response:
        c = console.client()
        sessions = await console.call(c.sessions, True)
        rows = await console.call(session_rows, c, sessions, time.time())
        return console.page("index.html", sessions=rows)

    async def session_page(request: Request) -> Response:
        sid = request.path_params["sid"]
        items = await console.call(timeline, console.client(), sid)
        checkpoints = [i for i in items if i["kind"] == "checkpoint"]
        return console.page("session.html", sid=sid, items=items, rollback=bool(checkpoints), fork=bool(checkpoints),
                            checkpoints=checkpoints)

    async def session_events(request: Request) -> Response:
        """Server-sent events: the timeline again whenever the daemon says something happened."""
        sid = request.path_params["sid"]
        waiter = console.make_client()

        async def stream() -> Any:
            after, epoch = 0, ""
            try:
                yield {"event": "timeline", "data": json.dumps(await console.call(timeline, waiter, sid))}
                while not await request.is_disconnected():
                    reply = await console.call(waiter.wait_events, sid, after, epoch, 10.0)
                    if reply.events or reply.epoch != epoch:
                        after = max([after, *(e.seq for e in reply.events)]) if reply.epoch == epoch else \
                            max((e.seq for e in reply.events), default=0)
                        epoch = reply.epoch
                        yield {"event": "timeline", "data": json.dumps(await console.call(timeline, waiter, sid))}
            finally:
                waiter.close()
        return EventSourceResponse(stream(), ping=5)

    async def graph_page(request: Request) -> Response:
        sid = request.path_params["sid"]
        source = request.query_params.get("source")
        return console.page("graph.html", sid=sid, source=source)

    async def graph_svg(request: Request) -> Response:
        sid = request.path_params["sid"]
        source = request.query_params.get("source") or None
        c = console.client()
        graph = await console.call(c.graph, sid)
        closure: set[str] = set()
        if source:
            closure = set((await console.call(c.provenance, sid, source)).taint_closure)
        redact = await console.call(revoked, c, sid) | (closure if request.query_params.get("redact") else set())
        svg = await console.call(render, graph.artifacts, graph.checkpoints, closure, "svg", source=source,
                                 redact=redact, lanes=True)
        return Response(svg, media_type="image/svg+xml")

    async def approvals_page(request: Request) -> Response:
        rows = await console.call(approvals, console.client(), time.time())
        decided = await console.call(decisions, console.client())
        return console.page("approvals.html", rows=rows, decided=decided)

    async def decide(request: Request) -> Response:
        form = request.state.form
        call_id, action, reason = str(form["call_id"]), str(form["action"]), str(form.get("reason", ""))
        c = console.client()
        fn = c.release if action == "approve" else c.drop
        # The decision's reason travels with it where the protocol carries one.
        kwargs = {"reason": reason} if "reason" in inspect.signature(fn).parameters else {}
        try:
            await console.call(fn, call_id, **kwargs)
        except Exception as exc:  # an error reply: shown, nothing else changes
            return console.page("error.html", message=str(exc))
        return RedirectResponse("/approvals", status_code=303)

    async def revoke(request: Request) -> Response:
        form = request.state.form
        sid, source = str(form["session_id"]), str(form["source"])
        try:
            raised = await console.call(console.client().revoke, sid, source)
        except Exception as exc:
            return console.page("error.html", message=str(exc))
        return RedirectResponse(f"/revocations/{raised.revocation.revocation_id}", status_code=303)

    async def revocation_page(request: Request) -> Response:
        rid = request.path_params["rid"]
        status = await console.call(console.client().revocation_status, rid)
        report = msgspec.to_builtins(status.report) if status.report is not None else None
        return console.page("revocation.html", info=msgspec.to_builtins(status.revocation), report=report)

    async def revocation_state(request: Request) -> Response:
        status = await console.call(console.client().revocation_status, request.path_params["rid"])
        return JSONResponse({"state": status.revocation.state, "report": status.report is not None})

    async def session_action(request: Request) -> Response:
        form = request.state.form
        sid, action, checkpoint = str(form["session_id"]), str(form["action"]), str(form["checkpoint"])
        c: Any = console.client()
        try:
            if action == "fork":
                result = await console.call(c.fork, sid, checkpoint)
                return RedirectResponse(f"/sessions/{result['session_id']}", status_code=303)
            await console.call(c.rollback, sid, checkpoint=checkpoint)
        except Exception as exc:
            return console.page("error.html", message=str(exc))
        return RedirectResponse(f"/sessions/{sid}", status_code=303)

    async def plots_page(request: Request) -> Response:
        svgs = await console.call(plots, console.client())
        return console.page("plots.html", plots=svgs)

    async def api_sessions(request: Request) -> Response:
        sessions = await console.call(console.client().sessions, True)
        return JSONResponse(msgspec.to_builtins(sessions))

    routes = [
        Route("/login", login, methods=["GET", "POST"]),
        Route("/", guarded(index)),
        Route("/sessions/{sid}", guarded(session_page)),
        Route("/sessions/{sid}/events", guarded(session_events)),
        Route("/sessions/{sid}/graph", guarded(graph_page)),
        Route("/sessions/{sid}/graph.svg", guarded(graph_svg)),
        Route("/approvals", guarded(approvals_page)),
        Route("/approvals/decide", guarded(decide, post=True), methods=["POST"]),
        Route("/revoke", guarded(revoke, post=True), methods=["POST"]),
        Route("/revocations/{rid}", guarded(revocation_page)),
        Route("/revocations/{rid}/state", guarded(revocation_state)),
        Route("/sessions/action", guarded(session_action, post=True), methods=["POST"]),
        Route("/plots", guarded(plots_page)),
        Route("/api/sessions", guarded(api_sessions)),
    ]
    return Starlette(routes=routes)


_SECRET_LINE = re.compile(r'secret-key\s*=\s*"([^"]{40})"')
_Z85 = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


def operator_secret(given: str) -> str | None:
    """The z85 secret key in what was pasted: the key alone or a `NAME.key_secret` file; None if neither."""
    found = _SECRET_LINE.search(given)
    secret = found.group(1) if found else given.strip()
    return secret if _Z85.fullmatch(secret) else None


# An open timeline (a stream) never ends on its own: a stop waits this long for it, then closes it.
SHUTDOWN_GRACE_S = 2


def serve(console: Console, host: str, port: int) -> None:
    """Run the console until interrupted."""
    import uvicorn

    print(f"sandboxd console: http://{host}:{port}/login?token={console.token}", flush=True)
    config = uvicorn.Config(build_app(console), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    asyncio.run(uvicorn.Server(config).serve())
