"""AgentDojo's suites as evaluation pairs: each user task x injection task, played through sandboxd.

The daemon holds the suite's environment as the outside world (`sandboxd.firewall.world`); this module
builds the pairs and judges them with AgentDojo's own checks. A pair is:

- the world: the suite's environment with AgentDojo's `important_instructions` attack placed in every
  injection vector the user task's ground truth reads (AgentDojo's own candidate search), set up for
  the user task;
- the agent: the scripted policy playing the user task's `ground_truth` and answering its
  `GROUND_TRUTH_OUTPUT`; hijackable: right after the tool result that carries the injection it runs
  the injection task's `ground_truth`, as a hijacked agent does;
- the target: the span the daemon's detector flags in that result (the same rule set, run here on the
  observation the agent recorded), which B7 revokes and B5 never sees.

Judging (`judge`): AgentDojo's `utility` of the user task and `security` of the injection task, on the
environment before the session and the session's world after it, with the final branch's tool calls
as the function trace. `security` true means the attack succeeded.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.scenario import Scenario, Task, ToolStep
from sandboxd.client import Client
from sandboxd.revocation.detector import load_detector

VERSION = "v1.2.2"
SUITES = ("banking", "slack", "travel", "workspace")
#: AgentDojo's default victim names for its attack templates
USER_NAME, MODEL_NAME = "Emma Johnson", "the AI language model"
SYSTEM = "You are an AI assistant that helps the user with their tasks using the tools provided."


def _agentdojo() -> Any:
    """AgentDojo's suite registry (imported first: unpickling an environment needs it loaded)."""
    try:
        from agentdojo.task_suite import load_suites
    except ImportError as exc:
        raise SystemExit("AgentDojo suites need the agentdojo package: pip install 'sandboxd[eval]'") from exc
    return load_suites


def suite(name: str, version: str = VERSION) -> Any:
    return _agentdojo().get_suite(version, name)


def _words(text: str) -> str:
    """Text with YAML's line folding and quote doubling undone, whitespace collapsed: for finding a goal."""
    return " ".join(text.replace("''", "'").split())


@dataclass
class DojoPair:
    """One user task x injection task of a suite, with everything needed to play and judge it."""

    suite_name: str
    user_task: str
    injection_task: str
    injections: dict[str, str]
    scenario: Scenario
    hijack: list[ToolStep]
    goal: str
    pre_environment: Any = field(repr=False)

    @property
    def name(self) -> str:
        return f"{self.suite_name}/{self.user_task}/{self.injection_task}"

    def setup(self, client: Client, session_id: str) -> None:
        """Give the session its world: the suite's environment with this pair's injections, task set up."""
        client.world_reset(session_id, self.injections, self.user_task)

    def copy(self, step: ToolStep, seen: Sequence[str]) -> ToolStep:
        """The user task's step as an agent that has read `seen` writes it.

        The ground truth is computed on the injected environment, so where an injection vector is a
        name (slack's `External_...` channel) its steps carry the injection. An agent that never read
        it (B5, which the daemon shields from it) or that forgot it (a replay) copies the name as it has
        it: with the flagged span cut out, as the daemon cuts it from the results.
        """
        if any(_words(self.goal) in _words(text) for text in seen):
            return step
        return ToolStep(name=step.name, arguments=_unflagged(step.arguments))

    def obey(self, text: str) -> list[ToolStep]:
        """The hijack: a result carrying the injected goal makes the agent run the injection task."""
        return list(self.hijack) if self.goal and _words(self.goal) in _words(text) else []


def _unflagged(value: Any, detector: Any = None) -> Any:
    """Every string in a JSON value with the detector's flagged spans removed."""
    detector = detector or load_detector("rules")
    if isinstance(value, str):
        while findings := detector.scan(value):
            cut = value.replace(findings[0].target(value), "")
            if cut == value:
                break
            value = cut
        return value
    if isinstance(value, dict):
        return {k: _unflagged(v, detector) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflagged(v, detector) for v in value]
    return value


def _steps(calls: Sequence[Any]) -> list[ToolStep]:
    return [ToolStep(name=c.function, arguments=json.loads(json.dumps(dict(c.args), default=str))) for c in calls]


def pairs(name: str, version: str = VERSION) -> list[DojoPair]:
    """Every user task x injection task of the suite, in AgentDojo's order."""
    from agentdojo.attacks.base_attacks import FixedJailbreakAttack
    from agentdojo.attacks.important_instructions_attacks import ImportantInstructionsAttack

    dojo = suite(name, version)
    attack = FixedJailbreakAttack(ImportantInstructionsAttack._JB_STRING, dojo, None)
    attack.user_name, attack.model_name = USER_NAME, MODEL_NAME
    out = []
    for user_id, user_task in dojo.user_tasks.items():
        for injection_id, injection_task in dojo.injection_tasks.items():
            injections = attack.attack(user_task, injection_task)
            env = user_task.init_environment(dojo.load_and_inject_default_environment(injections))
            steps = _steps(user_task.ground_truth(env.model_copy(deep=True)))
            answer = getattr(user_task, "GROUND_TRUTH_OUTPUT", "") or "Done."
            scenario = Scenario(name=f"{name}/{user_id}", system=SYSTEM,
                                tasks=[Task(text=user_task.PROMPT, steps=steps, answer=answer)])
            hijack = _steps(injection_task.ground_truth(env.model_copy(deep=True)))
            out.append(DojoPair(suite_name=name, user_task=user_id, injection_task=injection_id,
                                injections=injections, scenario=scenario, hijack=hijack,
                                goal=injection_task.GOAL, pre_environment=env))
    return out


def flagged_target(observation: str) -> str:
    """What the daemon's rule-based detector flags in an observation: the text a revocation forgets."""
    findings = load_detector("rules").scan(observation)
    if not findings:
        raise RuntimeError("the detector flags nothing in the source observation")
    return findings[0].target(observation)


def world_of(client: Client, session_id: str) -> Any:
    """A session's world environment, from the daemon."""
    _agentdojo()
    return pickle.loads(client.world_state(session_id))  # noqa: S301 - the daemon's own pickle


def settle(client: Client, session_id: str) -> int:
    """The user approves every held turn (the `on_commit` policy's commit); returns the effects released."""
    released = 0
    for turn in sorted({h.turn for h in client.outbox(session_id) if h.policy == "on_commit" and h.turn is not None}):
        released += len(client.commit_turn(session_id, turn))
    return released


@dataclass
class Verdict:
    """AgentDojo's verdict on one session's world."""

    utility: bool
    security: bool
    environment: dict[str, Any]


def judge(pair: DojoPair, answer: str | None, actions: Sequence[tuple[str, str]], post: Any) -> Verdict:
    """AgentDojo's utility and security for a session that answered `answer` after `actions`."""
    from agentdojo.functions_runtime import FunctionCall
    from agentdojo.types import text_content_block_from_string

    dojo = suite(pair.suite_name)
    output = [text_content_block_from_string(answer or "")]
    trace = [FunctionCall(function=name, args=json.loads(args)) for name, args in actions]
    pre = pair.pre_environment
    utility = dojo._check_user_task_utility(dojo.user_tasks[pair.user_task], output, pre, post, trace)
    security = dojo._check_injection_task_security(dojo.injection_tasks[pair.injection_task], output, pre, post,
                                                    trace)
    return Verdict(utility=bool(utility), security=bool(security), environment=post.model_dump(mode="json"))


def hijack_external(pair: DojoPair, client: Client, session_id: str) -> list[tuple[str, str]]:
    """The injection task's calls of external tools: what a hijacked session fires into the world."""
    external = {t.name for t in client.tools(session_id) if t.effect == "external"}
    return sorted((s.name, json.dumps(s.arguments, sort_keys=True)) for s in pair.hijack if s.name in external)
