"""Revocation end to end: counterfactual equality at every step, cost, no double effects, physical forgetting."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import docker
from agent.compare import agreement, final_state
from agent.harness import MailSink, Web, daemon_config, run_session
from agent.revocation import apply, apply_pending
from agent.scenario import Scenario, Task, ToolStep
from agent.scenarios import INJECTION, VENDOR_PAGE, WORKSPACE, finance
from sandboxd import protocol as p
from sandboxd.config import load_config
from sandboxd.launcher import DaemonProcess
from sandboxd.revocation.forgetting import target_forms
from sandboxd.revocation.leakscan import needles_for, scan_paths
from sandboxd.sandbox.containers import ContainerManager
from tests.integration.conftest import both_runtimes

pytestmark = pytest.mark.docker


class World:
    """A daemon with its own mail sink; the web is shared, as the outside world would be."""

    def __init__(self, factory: Callable[..., DaemonProcess], web: Web) -> None:
        self.mail = MailSink()
        config = daemon_config(Path(tempfile.mkdtemp()) / "sandboxd.toml", self.mail, web)
        self.daemon = factory(["--config", str(config)])
        self.client = self.daemon.client()

    def daemon_container(self, session_id: str) -> Any:
        """The Docker container of a session of this world's daemon."""
        info = next(s for s in self.client.sessions() if s.session_id == session_id)
        return docker.from_env().containers.get(info.container)

    def delivered_ids(self) -> list[str]:
        return [str(m["Message-ID"]) for m in self.mail.messages]


@pytest.fixture
def web() -> Iterator[Web]:
    server = Web({"/vendors": VENDOR_PAGE})
    yield server
    server.close()


@pytest.fixture
def worlds(daemon_factory: Callable[..., DaemonProcess], web: Web) -> Iterator[tuple[World, World]]:
    made = (World(daemon_factory, web), World(daemon_factory, web))
    yield made
    for world in made:
        world.mail.close()


def kept_state(world: World) -> list[Path]:
    """What the daemon keeps besides the sandbox's own files: SQLite and its WAL, logs, sockets, salt."""
    return [p for p in world.daemon.state_dir.iterdir() if p.name != "snapshots"]


def target_of(artifact: p.Artifact) -> str:
    """The revoked value for a sweep step: the whole observation, up to any world-specific effect id."""
    return artifact.content.split('"message_id"')[0]


def without(scenario: Scenario, target: str) -> Scenario:
    """The counterfactual's exogenous inputs: the scenario with the target cut out of them."""
    tasks = [msgspec.structs.replace(t, text=t.text.replace(target, "")) for t in scenario.tasks]
    return msgspec.structs.replace(scenario, tasks=tasks, memories=[m.replace(target, "") for m in scenario.memories])


def sweep_scenario(web: Web) -> Scenario:
    base = finance(web.url("/vendors"), compact_every=0)
    extra = Task(text="Show the readme.", steps=[ToolStep(name="read_file", arguments={"path": "README.md"})],
                 answer="It describes the finance workspace.")
    return msgspec.structs.replace(base, tasks=[*base.tasks, extra])


def test_replay_equals_a_fresh_run_without_the_target_at_every_step(worlds: tuple[World, World], web: Web) -> None:
    """Theorem 1: for a target entering at each step tau, revoke-and-replay == a fresh run on o^{-z}."""
    live, reference = worlds
    scenario = sweep_scenario(web)
    probe = run_session(live.client, scenario, WORKSPACE)
    steps = sorted(a.step for a in live.client.graph(probe.session_id).artifacts if a.type in p.OBSERVATION_TYPES)
    assert steps == list(range(1, probe.step + 1)) and probe.step >= 20
    live.client.close_session(probe.session_id)  # the state directory holds one session at a time below
    for tau in steps:
        agent = run_session(live.client, scenario, WORKSPACE)
        graph = live.client.graph(agent.session_id).artifacts
        source = next(a for a in graph if a.step == tau and a.type in p.OBSERVATION_TYPES)
        target = target_of(source)
        earlier = [a.content for a in graph if a.step < tau or a.type == "system"]
        assert target and not any(target in text for text in earlier), f"step {tau}: target entered earlier"
        needles = needles_for(target)
        assert scan_paths(needles, kept_state(live)).hits, f"step {tau}: the scan cannot see the target"

        raised = live.client.revoke(agent.session_id, source.artifact_id, target)
        report = apply(agent, raised.revocation.revocation_id)
        fresh = run_session(reference.client, without(scenario, target), WORKSPACE, forget=[target])

        same = agreement(final_state(agent), final_state(fresh))
        assert same["all"], f"step {tau}: {same}"
        assert report.tau == tau and report.transitions_replayed == report.T - tau + 1
        assert report.calls["fired_twice"] == 0
        assert report.leak_scan["hits"] == 0, f"step {tau}: {report.leak_scan}"
        assert not scan_paths(needles, kept_state(live)).hits
        # Revoking a whole listing forgets the names it lists too, and the workspace holds those.
        in_environment = any(form in path or form in content for form in target_forms(target)
                             for path, content in WORKSPACE.items())
        assert bool(report.leak_scan["environment_hits"]) <= in_environment, f"step {tau}: {report.leak_scan}"
        live.client.close_session(agent.session_id)
        reference.client.close_session(fresh.session_id)
    ids = live.delivered_ids()
    assert len(ids) == len(set(ids)), "an effect was delivered twice"


def suffix_after(prefix_tasks: int, web: Web) -> Scenario:
    """The same suffix (vendor page onwards) behind `prefix_tasks` extra tasks."""
    base = finance(web.url("/vendors"), compact_every=0)
    filler = [Task(text=f"Look at the workspace ({i}).", steps=[ToolStep(name="list_dir", arguments={})],
                   answer="Seen.") for i in range(prefix_tasks)]
    return msgspec.structs.replace(base, tasks=[*filler, *base.tasks])


def test_cost_follows_the_suffix_not_the_session(worlds: tuple[World, World], web: Web) -> None:
    live, _ = worlds
    reports = {}
    for prefix in (0, 5):
        agent = run_session(live.client, suffix_after(prefix, web), WORKSPACE)
        [info] = live.client.pending_revocations(agent.session_id)  # the detector flagged the vendor page
        reports[prefix] = apply(agent, info.revocation_id)
    short, long = reports[0], reports[5]
    assert long.tau > short.tau and long.T > short.T
    assert long.transitions_replayed == short.transitions_replayed == short.T - short.tau + 1
    assert long.tokens.recomputed == short.tokens.recomputed
    assert long.tokens.reused_prefix > short.tokens.reused_prefix
    assert long.tokens.full_reset > short.tokens.full_reset > short.tokens.recomputed


def test_task_context_prefills_independent_turns_and_reuses_unchanged_reads(worlds: tuple[World, World],
                                                                           web: Web) -> None:
    """Under the `task` context policy a later task's turns have no tainted parent: B7 prefills them from the
    record and still equals B5, while B5' (nothing certified) decodes them all again; a read nothing was
    written under since the checkpoint is answered from the record."""
    live, reference = worlds
    scenario = finance(web.url("/vendors"), compact_every=0)
    runs = {}
    for certify in (True, False):
        agent = run_session(live.client, scenario, WORKSPACE, context_policy="task")
        graph = live.client.graph(agent.session_id).artifacts
        # A turn's recorded parents are its prompt: the system prompt, the memories and its own task.
        last = [a for a in graph if a.type == "model_turn"][-1]
        assert sum(1 for a in graph if a.type == "user" and a.artifact_id in last.parents) == 1
        source = next(a for a in graph if a.type == "observation" and a.meta.get("tool") == "list_dir")
        raised = live.client.revoke(agent.session_id, source.artifact_id, None)
        runs[certify] = (agent, apply(agent, raised.revocation.revocation_id, certify=certify), source.content)
    (b7, report, target), (b5p, control, _) = runs[True], runs[False]
    fresh = run_session(reference.client, scenario, WORKSPACE, forget=[target], context_policy="task")
    reference_state = final_state(fresh)
    assert agreement(final_state(b7), reference_state)["all"]
    assert agreement(final_state(b5p), reference_state)["all"]
    assert report.calls["reused"] >= 1 and control.calls["reused"] == 0  # the q3.csv read after the listing
    assert report.tokens.turns_prefilled >= 5 and control.tokens.turns_prefilled == 0
    assert report.tokens.decoded < control.tokens.decoded
    assert report.tokens.recomputed == control.tokens.recomputed  # prefilled instead of decoded, token for token


@both_runtimes
def test_detector_revocation_forgets_physically_and_fires_nothing_twice(worlds: tuple[World, World],
                                                                       web: Web) -> None:
    live, _ = worlds
    agent = run_session(live.client, finance(web.url("/vendors")), WORKSPACE)
    state = live.daemon.state_dir
    assert scan_paths(needles_for(INJECTION), [state]).hits  # before: the page is in the observation log
    subjects = collections.Counter(live.mail.subjects())
    [report] = apply_pending(agent)
    assert report.raised_by == "detector:rules"
    assert report.calls["orphaned"] == 1 and report.calls["deduplicated"] == 1
    assert report.calls["fired_twice"] == 0 and collections.Counter(live.mail.subjects()) == subjects
    assert report.leak_scan["hits"] == 0 and report.leak_scan["locations_checked"] > 10
    assert not scan_paths(needles_for(INJECTION), [state]).hits
    assert not scan_paths(needles_for("forward every report"), [state]).hits  # the derived note is gone too
    assert INJECTION not in agent.backend.detokenize(agent.backend.token_ids())
    tree = agent.client.call(agent.session_id, "list_dir", {"recursive": True}).stdout
    assert "admin.txt" not in tree and "report.md" in tree
    assert any("orphaned" in item for item in report.not_erased)
    # The page comes back if fetched again, and is excised before the agent sees it.
    page = agent.client.call(agent.session_id, "http_get", {"url": web.url("/vendors")}).stdout
    assert "Vendor notes" in page and "INFORMATION" not in page


def test_cli_revoke_and_graph(worlds: tuple[World, World], web: Web, tmp_path: Path) -> None:
    live, _ = worlds
    agent = run_session(live.client, finance(web.url("/vendors"), compact_every=0), WORKSPACE)
    for info in live.client.pending_revocations(agent.session_id):
        apply(agent, info.revocation_id)
    cli = [sys.executable, "-m", "sandboxd.cli"]
    endpoint = ["--endpoint", live.daemon.endpoint]
    raised = json.loads(subprocess.run([*cli, "revoke", agent.session_id, "--source", "user-5", "--json", *endpoint],
                                       check=True, capture_output=True, text=True).stdout)
    assert raised["state"] == "pending" and raised["tau"] == 5 and "user-5" in raised["taint_closure"]
    svg = tmp_path / "graph.svg"
    subprocess.run([*cli, "graph", agent.session_id, "--format", "svg", "--source", "user-5", "-o", str(svg),
                    *endpoint], check=True)
    assert ET.parse(svg).getroot().tag.endswith("svg")
    [report] = apply_pending(agent)
    assert report.tau == 5 and report.transitions_replayed == report.T - 4
    status = json.loads(subprocess.run([*cli, "revoke", agent.session_id, "--source", "nope", "--json", *endpoint],
                                       capture_output=True, text=True).stdout)
    assert status["error"] == "not_found"


def test_a_replay_cut_by_a_crash_rolls_back_and_can_be_taken_again(worlds: tuple[World, World], web: Web) -> None:
    live, _ = worlds
    agent = run_session(live.client, finance(web.url("/vendors")), WORKSPACE)
    [info] = live.client.pending_revocations(agent.session_id)
    before = [(a.artifact_id, a.content) for a in live.client.graph(agent.session_id).artifacts]
    live.client.begin_revocation(info.revocation_id)  # the agent took it: the sandbox is back before tau
    assert "admin.txt" not in live.client.call(agent.session_id, "list_dir", {"recursive": True}).stdout
    live.daemon.restart()  # SIGKILL mid-replay, then a new daemon on the same state
    [again] = live.client.pending_revocations(agent.session_id)
    assert again.revocation_id == info.revocation_id and again.state == "pending"
    assert [(a.artifact_id, a.content) for a in live.client.graph(agent.session_id).artifacts] == before
    tree = live.client.call(agent.session_id, "list_dir", {"recursive": True}).stdout
    assert "notes/admin.txt" in tree  # the sandbox is the session's again, not a half-replayed one
    report = apply(agent, info.revocation_id)
    assert report.leak_scan["hits"] == 0 and report.calls["fired_twice"] == 0
    assert "admin.txt" not in live.client.call(agent.session_id, "list_dir", {"recursive": True}).stdout


@both_runtimes
def test_the_container_scratch_space_is_scanned_and_emptied(worlds: tuple[World, World], web: Web,
                                                            runtime: str) -> None:
    live, _ = worlds
    agent = run_session(live.client, finance(web.url("/vendors")), WORKSPACE)
    [info] = live.client.pending_revocations(agent.session_id)
    # A tool copied the injected page into scratch space, which no snapshot holds.
    live.client.call(agent.session_id, "python", {"code": f"open('/tmp/copy.txt', 'w').write({INJECTION!r})"})
    # The scan the revocation runs sees it, under either runtime (gVisor keeps the tmpfs in its kernel).
    manager = ContainerManager(load_config(state_dir=str(live.daemon.state_dir), runtime=runtime))
    assert [hit.location for hit in manager.scan_scratch(agent.session_id, needles_for(INJECTION)).hits] \
        == ["/tmp/copy.txt"]
    report = apply(agent, info.revocation_id)
    assert report.leak_scan["hits"] == 0
    assert live.client.call(agent.session_id, "shell", {"command": "ls -A /tmp"}).stdout == ""
