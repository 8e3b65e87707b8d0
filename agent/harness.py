"""Running scripted sessions end to end: the outside world (a mail sink and a web server) and the agent.

Used by `make demo`, the tests and the benchmarks. The world is local: an aiosmtpd sink on loopback
that counts what it receives, and a web server on loopback that serves the pages a scenario reads.
"""

from __future__ import annotations

import email
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller

from agent.chat import ChatRenderer
from agent.context import SeededContext
from agent.models.local import LocalBackend
from agent.runtime import AgentSession, Exogenous, exogenous_inputs
from agent.scenario import Copy, Obey, Scenario, ScriptedPolicy
from sandboxd.client import Client


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MailSink:
    """An SMTP server on loopback (aiosmtpd) that keeps every message it accepted: the one mail sink of the
    demo, the tests and the benchmarks (a test that needs a slow relay overrides `handle_DATA`)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.messages: list[email.message.Message] = []
        self.envelopes: list[tuple[str, list[str], bytes]] = []
        """(sender, recipients, raw message) of each accepted message, as the relay saw them."""
        self._lock = threading.Lock()
        self._controller = Controller(self, hostname="127.0.0.1", port=self.port)
        self._controller.start()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self._lock:
            self.messages.append(email.message_from_bytes(envelope.content))
            self.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
        return "250 OK"

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.messages)

    def subjects(self) -> list[str]:
        with self._lock:
            return [str(m["Subject"]) for m in self.messages]

    def close(self) -> None:
        self._controller.stop()


class Web:
    """A web server on loopback serving fixed pages (the outside world a read tool fetches).

    With `name`, its URLs are `http://NAME/...` and `daemon_config` has the daemon's firewall resolve the
    name to this server's port (the fixture model was trained on one name; the port is any free one).
    """

    def __init__(self, pages: dict[str, str], port: int = 0, name: str | None = None) -> None:
        self.pages = pages
        self.name = name
        web = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = web.pages.get(self.path, "not found").encode()
                self.send_response(200 if self.path in web.pages else 404)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{self.name}{path}" if self.name else f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def daemon_config(path: Path, mail: MailSink, web: Web, release: str = "immediate") -> Path:
    """A daemon configuration whose firewall reaches this world."""
    hosts = [f"127.0.0.1:{web.port}", *([web.name] if web.name else [])]
    named = web.name if web.name is None or ":" in web.name else f"{web.name}:80"
    resolve = f"resolve = {{ \"{named}\" = \"127.0.0.1:{web.port}\" }}\n" if web.name else ""
    path.write_text(
        "[firewall]\nadapter_timeout_s = 5.0\n"
        f"[firewall.smtp]\nhost = \"127.0.0.1\"\nport = {mail.port}\n"
        f"[firewall.http]\nallowlist = {json.dumps(hosts)}\n{resolve}"
        f"[firewall.release]\nsend_email = \"{release}\"\n"
    )
    return path


def seed_workspace(client: Client, session_id: str, files: dict[str, str]) -> None:
    """Put the scenario's starting files in the sandbox (set-up, not part of the agent's session)."""
    for path, content in files.items():
        client.call(session_id, "write_file", {"path": path, "content": content}, call_id=f"seed/{path}")


def run_session(client: Client, scenario: Scenario, files: dict[str, str], *, seed: int = 0,
                forget: list[str] | None = None, hijackable: bool = True,
                engine: LocalBackend | None = None, setup: Callable[[Client, str], object] | None = None,
                obey: Obey | None = None, copy: Copy | None = None, context_policy: str = "session",
                inputs: list[Exogenous] | None = None) -> AgentSession:
    """Open a sandbox session, seed it, and run the scenario with the scripted policy on the local engine.

    `setup` prepares the session's outside world (an AgentDojo environment) before the agent starts;
    `context_policy` is the runtime's (`session`: every block so far; `task`: each task on its own).
    `inputs` replaces the scenario's exogenous stream (a counterfactual o^{-z} fed to the same scripted agent).
    """
    session_id = client.open_session(forget=forget).session_id
    seed_workspace(client, session_id, files)
    if setup is not None:
        setup(client, session_id)
    engine = engine or LocalBackend.tiny(seed=seed, max_positions=65536)
    agent = AgentSession(client, session_id, engine, ScriptedPolicy(scenario, hijackable=hijackable, obey=obey,
                                                                            copy=copy),
                         SeededContext(seed=seed), context_policy=context_policy)
    agent.start(exogenous_inputs(scenario) if inputs is None else inputs)
    agent.run()
    return agent


#: The fixture model: a small Llama trained by agent/models/train_fixture.py on the built-in scenarios
FIXTURE = Path(__file__).resolve().parent / "models" / "fixture"


def run_model_session(client: Client, scenario: Scenario, files: dict[str, str], *, model: Path = FIXTURE,
                      forget: list[str] | None = None, backend: Any = None, echo: Any = None,
                      setup: Callable[[Client, str], object] | None = None) -> AgentSession:
    """Open a sandbox session, seed it, and let a model play the scenario's inputs (free generation, greedy).

    A scenario that compacts (`compact_every` > 0) is refused before any session opens: see
    `agent.runtime.COMPACTION_REFUSED`.

    The model directory is loaded as a user's would be (`from_pretrained` on its path), its own chat
    template lays the context out, and its turns are read in the Qwen2.5 / Hermes tool-call format.
    `setup` prepares the session's outside world (an AgentDojo environment) before the model starts.
    """
    if scenario.compact_every:
        from agent.runtime import COMPACTION_REFUSED

        raise ValueError(COMPACTION_REFUSED)
    session_id = client.open_session(forget=forget).session_id
    seed_workspace(client, session_id, files)
    if setup is not None:
        setup(client, session_id)
    engine = backend or LocalBackend.from_pretrained(model)
    agent = AgentSession(client, session_id, engine, system=scenario.system,
                         chat=lambda tools: ChatRenderer.from_dir(model, tools), toolcall_format="hermes",
                         max_turn_tokens=384, echo=echo, compact_every=scenario.compact_every)
    agent.start(exogenous_inputs(scenario))
    agent.run()
    return agent
