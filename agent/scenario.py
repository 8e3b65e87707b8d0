"""Scenarios and the scripted policy that plays them, hijackable by instructions found in observations.

A scenario is the exogenous side of a session: a system prompt, seeded memories and the user's
tasks. The scripted policy decides each model turn from the context alone: the current task is the
last user input, and the next action is the task's next step unless an observation of this task
carries an instruction the policy obeys, as a hijacked agent would. A preference anywhere in the
context (an exclusion: "leave Acme out of every report") shapes what it writes without being
restated. Remove the instruction or the preference from the context and the same policy does what an
agent that never read it does; that is what replay relies on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import msgspec


class ToolStep(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call a task makes: an OpenAI-style function name and arguments."""

    name: str
    arguments: dict[str, Any]


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """A user input, the steps the agent takes for it, and its final answer."""

    text: str
    steps: list[ToolStep] = []
    answer: str = "done"
    plan: str = ""


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    """The exogenous inputs of a session."""

    name: str
    system: str
    memories: list[str] = []
    tasks: list[Task] = []
    compact_every: int = 4
    """A compaction writes a summary into memory every this many model turns."""


class ContextBlock(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy sees of one block of the context: its type and its text."""

    type: str
    text: str


# An instruction the hijackable policy obeys, in the imperative form injected content uses.
_EMAIL = re.compile(r"send an email to (?P<to>[^\s,]+@[^\s,]+?)[,.]? with subject '(?P<subject>[^']*)' "
                    r"and body '(?P<body>[^']*)'", re.IGNORECASE)
_NOTE = re.compile(r"write a note to (?P<path>[\w./-]+) saying '(?P<text>[^']*)'", re.IGNORECASE)


def obeyed_instructions(text: str) -> list[ToolStep]:
    """Tool calls that a hijacked agent would make after reading `text`, in the order they appear."""
    found: list[tuple[int, ToolStep]] = []
    for m in _NOTE.finditer(text):
        found.append((m.start(), ToolStep(name="write_file", arguments={"path": m["path"], "content": m["text"]})))
    for m in _EMAIL.finditer(text):
        found.append((m.start(), ToolStep(name="send_email", arguments={
            "to": [m["to"]], "subject": m["subject"], "body": m["body"]})))
    return [step for _, step in sorted(found, key=lambda pair: pair[0])]


# A user's exclusion, as a preference file or a note states it: a name to keep out of what the agent writes.
_EXCLUDE = re.compile(r"\b[Ll]eave (?P<name>[A-Z][\w-]*(?: [A-Z][\w-]*)*) out of every report\b")
_CLAUSE_END = re.compile(r"(?<=[.,;])[ \t]+")


def excluded_names(context: Sequence[ContextBlock]) -> list[str]:
    """The names the context's exclusions keep out, wherever they are read (results, memories, summaries)."""
    found = {m["name"] for b in context if b.type != "model_turn" for m in _EXCLUDE.finditer(b.text)}
    return sorted(found)


def without(text: str, names: Sequence[str]) -> str:
    """`text` without the clauses that mention an excluded name (its first word): what an agent that
    honours the exclusion writes, with no word of the exclusion itself."""
    words = [name.split()[0] for name in names]
    lines = []
    for line in text.split("\n"):
        clauses = _CLAUSE_END.split(line)
        kept = [c for c in clauses if not any(w in c for w in words)]
        if len(kept) != len(clauses):
            line = re.sub(r"[,;]$", ".", " ".join(kept))
        lines.append(line)
    return "\n".join(lines)


def _honour(step: ToolStep, names: Sequence[str]) -> ToolStep:
    return ToolStep(name=step.name, arguments={k: without(v, names) if isinstance(v, str) else v
                                                 for k, v in step.arguments.items()})


def turn_text(step: ToolStep | None, answer: str = "", plan: str = "") -> str:
    """A model turn as JSON: one tool call in OpenAI's shape, or the final answer."""
    body: dict[str, Any] = {}
    if plan:
        body["plan"] = plan
    if step is not None:
        body["tool_calls"] = [{"type": "function", "function": {"name": step.name, "arguments": step.arguments}}]
    else:
        body["answer"] = answer
    return json.dumps(body, sort_keys=True)


Obey = Callable[[str], list[ToolStep]]
"""What a hijacked agent does after reading a tool result: the tool calls the result instructs."""

Copy = Callable[[ToolStep, Sequence[str]], ToolStep]
"""A task step as the agent can write it having read these results: a step that copies a name it read
(a channel, a file) copies the name as the agent has it, not as the script's author saw it."""


class ScriptedPolicy:
    """Plays a scenario's tasks; with `hijackable`, also obeys instructions found in observations.

    `obey` reads one tool result for instructions (by default the phrasings of `obeyed_instructions`;
    an AgentDojo pair supplies its injection task's ground truth). The same instructions are obeyed
    once: read again in a later result, they are already done.
    """

    def __init__(self, scenario: Scenario, hijackable: bool = True, obey: Obey | None = None,
                 copy: Copy | None = None) -> None:
        self.scenario = scenario
        self.hijackable = hijackable
        self.obey = obey or obeyed_instructions
        self.copy = copy

    def next_turn(self, context: Sequence[ContextBlock]) -> str:
        """The next model turn for this context."""
        users = [i for i, b in enumerate(context) if b.type == "user"]
        if not users or len(users) > len(self.scenario.tasks):
            return turn_text(None, answer="ready")
        # The task by its text: a context that holds only the current task (the `task` context policy) has
        # one user input whatever task it is; by position when the text names none (an input revoked whole).
        task = self.scenario.tasks[len(users) - 1]
        named = [t for t in self.scenario.tasks if t.text == context[users[-1]].text]
        if named and task not in named:
            task = named[0]
        since = context[users[-1] + 1:]
        results = [b.text for b in since if b.type == "observation"]
        actions = self._actions(task, results)
        names = excluded_names(context)
        done = len(results)
        if done < len(actions):
            return turn_text(_honour(actions[done], names), plan=task.plan if done == 0 and task.plan else "")
        return turn_text(None, answer=without(task.answer, names))

    def _actions(self, task: Task, results: list[str]) -> list[ToolStep]:
        """The task's steps, with obeyed instructions spliced in right after the result that carried them."""
        actions: list[ToolStep] = []
        obeyed: list[list[ToolStep]] = []
        pending: list[tuple[ToolStep, bool]] = [(step, True) for step in task.steps]
        while pending:
            step, from_task = pending.pop(0)
            done = len(actions)
            if from_task and self.copy is not None:
                step = self.copy(step, results[:done])
            actions.append(step)
            # Only results of the user's own steps are read for instructions: one level of hijack.
            if self.hijackable and from_task and done < len(results):
                told = self.obey(results[done])
                if told and told not in obeyed:
                    obeyed.append(told)
                    pending[0:0] = [(s, False) for s in told]
        return actions

    def summary(self, context: Sequence[ContextBlock]) -> str:
        """A compaction summary: the tasks so far and an excerpt of every observation (derived content)."""
        tasks = [b.text for b in context if b.type == "user"]
        notes = [b.text.replace("\n", " ")[:160] for b in context if b.type == "observation"]
        return "Summary. Tasks: " + " | ".join(tasks) + ". Observations: " + " | ".join(notes)


def parse_turn(text: str) -> tuple[list[ToolStep], str | None, str]:
    """(tool calls, answer, plan) of a model turn; text that is not our JSON is an answer."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return [], text, ""
    if not isinstance(body, dict):
        return [], text, ""
    calls = []
    for call in body.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string
            args = json.loads(args or "{}")
        calls.append(ToolStep(name=str(fn.get("name", "")), arguments=args))
    answer = body.get("answer")
    return calls, answer if isinstance(answer, str) else None, str(body.get("plan") or "")
