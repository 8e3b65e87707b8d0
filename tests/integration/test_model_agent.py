"""A model decides: the fixture model, generating freely through its own chat template, runs the built-in
scenario in a sandbox, is hijacked by the page, and the revocation replays the suffix with free generation;
the SGLang backend runs the same loop against the stand-in server."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.backends import run_agent
from agent.compare import agreement, final_state
from agent.harness import MailSink, Web, daemon_config, run_model_session
from agent.models.fixture_data import FIXTURE_PORT
from agent.revocation import apply_pending
from agent.scenarios import INJECTION, VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess
from tests.standins.sglang_standin import SGLangStandIn

pytestmark = pytest.mark.docker
FIXTURE = Path(__file__).resolve().parents[2] / "agent" / "models" / "fixture"


@pytest.fixture
def world() -> Iterator[tuple[MailSink, MailSink, Web]]:
    mail, ref_mail, web = MailSink(), MailSink(), Web({"/vendors": VENDOR_PAGE}, port=FIXTURE_PORT)
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
