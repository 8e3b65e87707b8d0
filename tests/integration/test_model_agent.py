"""A model decides: the fixture model, generating freely through its own chat template, runs the built-in
scenario in a sandbox, is hijacked by the page, and the revocation replays the suffix with free generation;
the SGLang backend runs the same loop against the stand-in server."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.backends import run_agent
from agent.compare import agreement, final_state
from agent.harness import MailSink, Web, daemon_config, run_model_session
from agent.models.fixture_data import FIXTURE_HOST
from agent.revocation import apply, apply_pending
from agent.scenarios import INJECTION, VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess
from tests.standins.sglang_standin import SGLangStandIn

pytestmark = pytest.mark.docker
FIXTURE = Path(__file__).resolve().parents[2] / "agent" / "models" / "fixture"


@pytest.fixture
def world() -> Iterator[tuple[MailSink, MailSink, Web]]:
    mail, ref_mail, web = MailSink(), MailSink(), Web({"/vendors": VENDOR_PAGE}, name=FIXTURE_HOST)
    yield mail, ref_mail, web
    for server in (mail, ref_mail, web):
        server.close()


def test_free_generation_is_hijacked_and_the_revocation_replays_it_away(
        daemon_factory: Callable[..., DaemonProcess], world: tuple[MailSink, MailSink, Web]) -> None:
    mail, ref_mail, web = world
    tmp = Path(tempfile.mkdtemp())
    a = daemon_factory(["--config", str(daemon_config(tmp / "a.toml", mail, web))])
    b = daemon_factory(["--config", str(daemon_config(tmp / "b.toml", ref_mail, web))])
    scenario = finance(web.url("/vendors"), compact_every=0)
    agent = run_model_session(a.client(), scenario, WORKSPACE)
    # No script picked a turn: the model wrote them, and followed the page it read.
    assert agent.policy is None and agent.turn >= 10
    assert "q3 figures" in mail.subjects()
    [report] = apply_pending(agent)
    assert not report.leak_scan.get("hits") and report.calls.get("fired_twice", 0) == 0
    assert all(INJECTION not in b.text for b in agent.blocks)
    assert report.tokens.reused_prefix > 0
    reference = run_model_session(b.client(), scenario, WORKSPACE, forget=[INJECTION])
    assert "q3 figures" not in ref_mail.subjects()
    same = agreement(final_state(agent), final_state(reference))
    assert same["answer"] and same["tree"], same


def test_the_sglang_backend_runs_the_loop_on_the_standin(daemon: DaemonProcess) -> None:
    with SGLangStandIn() as server:
        agent = run_agent(daemon.client(), backend="sglang", model=str(FIXTURE), url=server.url,
                          tasks=["List the project files."], max_turns=2)
        bodies = server.generate_bodies
    assert bodies and all(body["input_ids"] for body in bodies)
    # A random cache_salt per session by default: no shared radix namespace with other tenants.
    salts = {body.get("cache_salt") for body in bodies}
    assert len(salts) == 1 and None not in salts
    assert agent.conversation is not None and agent.conversation.meter.decoded > 0
    assert agent.turn >= 1
    # The stand-in has no /get_server_info: whether it ran deterministic inference is unknown, and said so.
    assert agent.backend.deterministic_inference() is None


@pytest.fixture
def transformers_serve() -> Iterator[str]:
    """A real OpenAI-compatible server: `transformers serve` on the fixture model, on a free port."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = Path(sys.executable).with_name("transformers")
    proc = subprocess.Popen([str(serve), "serve", "--host", "127.0.0.1", "--port", str(port), str(FIXTURE)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # loading torch and the model on a busy machine
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not come up within 300 s")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_openai_backend_against_transformers_serve(
        daemon_factory: Callable[..., DaemonProcess], world: tuple[MailSink, MailSink, Web],
        transformers_serve: str) -> None:
    from agent.models.openai import OpenAIBackend

    mail, local_mail, web = world
    tmp = Path(tempfile.mkdtemp())
    a = daemon_factory(["--config", str(daemon_config(tmp / "a.toml", mail, web))])
    b = daemon_factory(["--config", str(daemon_config(tmp / "b.toml", local_mail, web))])
    scenario = finance(web.url("/vendors"), compact_every=0)
    backend = OpenAIBackend(transformers_serve, str(FIXTURE))
    agent = run_model_session(a.client(), scenario, WORKSPACE, backend=backend)
    local = run_model_session(b.client(), scenario, WORKSPACE)
    # The same trajectory as the local backend's: the server renders the messages with the fixture's template and
    # decodes greedily; turns whose calls it left in its content go back as the model wrote them (plan included).
    turns = [blk.text for blk in agent.blocks if blk.type == "model_turn"]
    assert turns == [blk.text for blk in local.blocks if blk.type == "model_turn"]
    assert "q3 figures" in mail.subjects() and "q3 figures" in local_mail.subjects()
    # The server returned the calls in its text (special tokens stripped, markers kept); the runtime read them.
    assert any(b.calls and not any(b.errors) for b in agent.blocks if b.type == "model_turn")
    assert agent.conversation is not None and agent.conversation.meter.decoded > 0
    assert agent.conversation.meter.prefilled > 0
    # Message-level checkpoints: offsets are message counts, handles a digest of the messages.
    checkpoints = a.client().graph(agent.session_id).checkpoints
    assert checkpoints and all(c.cache_handle.startswith(f"openai:{c.token_offset}:") for c in checkpoints)
    # A revocation replays over messages: the conversation is cut back to the checkpoint's message count.
    source = next(b for b in agent.blocks if b.type == "observation")
    revocation = a.client().revoke(agent.session_id, source.artifact_id).revocation
    report = apply(agent, revocation.revocation_id)
    assert report.tokens.reused_prefix == revocation_offset(a, agent.session_id, source.artifact_id)


def revocation_offset(daemon: DaemonProcess, session_id: str, source: str) -> int:
    checkpoint = daemon.client().provenance(session_id, source).checkpoint
    assert checkpoint is not None
    return checkpoint.token_offset


def test_a_revocation_is_taken_between_turns_when_the_daemon_announces_it(
        daemon_factory: Callable[..., DaemonProcess], world: tuple[MailSink, MailSink, Web]) -> None:
    from agent.backends import EventWatcher, take_revocations
    from agent.chat import ChatRenderer
    from agent.harness import seed_workspace
    from agent.models.local import LocalBackend
    from agent.runtime import AgentSession, exogenous_inputs

    mail, _, web = world
    daemon = daemon_factory(["--config", str(daemon_config(Path(tempfile.mkdtemp()) / "a.toml", mail, web))])
    client = daemon.client()
    scenario = finance(web.url("/vendors"), compact_every=0)
    sid = client.open_session().session_id
    seed_workspace(client, sid, WORKSPACE)
    agent = AgentSession(client, sid, LocalBackend.from_pretrained(FIXTURE), system=scenario.system,
                         chat=lambda tools: ChatRenderer.from_dir(FIXTURE, tools), max_turn_tokens=384)
    reports: list[Any] = []
    watcher = EventWatcher(client.endpoint, sid).start()
    taken = take_revocations(watcher, reports.append)

    def slow_hook(session: AgentSession) -> None:
        # The detector's event arrives over the long-poll; give it a moment, as a turn of a real model would.
        watcher.events.not_empty.acquire()
        watcher.events.not_empty.wait(0.05)
        watcher.events.not_empty.release()
        taken(session)

    agent.between_turns = slow_hook
    try:
        agent.start(exogenous_inputs(scenario))
        agent.run()
    finally:
        watcher.stop()
    # Taken during the session, right after the page was read, and the tasks went on after it.
    [report] = reports
    assert report.T == report.tau < agent.step
    assert all(INJECTION not in b.text for b in agent.blocks)
    assert agent.answer() == "Archived projects/q3.csv."
