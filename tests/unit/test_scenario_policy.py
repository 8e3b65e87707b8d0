"""The scripted scenario policy: a user's exclusion read anywhere in the context shapes what it writes."""

from __future__ import annotations

import json

import pytest

from agent.eval.runner import main
from agent.scenario import ContextBlock, ScriptedPolicy, excluded_names, without
from agent.scenarios import EXCLUSION, NOTES, NOTES_FILE, finance

REPORT_TASK = 4  # list files, read preferences, revenue, vendor page, then the report


def context_at(scenario_task: int, observations: dict[int, str]) -> list[ContextBlock]:
    """The context just after the user gives task `scenario_task`, with one observation per earlier task."""
    scenario = finance("http://127.0.0.1:1/vendors/clean", notes=True)
    blocks = [ContextBlock(type="system", text=scenario.system)]
    for i, task in enumerate(scenario.tasks[:scenario_task + 1]):
        blocks.append(ContextBlock(type="user", text=task.text))
        if i < scenario_task:
            blocks.append(ContextBlock(type="observation", text=observations.get(i, "ok")))
    return blocks


def next_call(context: list[ContextBlock]) -> dict[str, object]:
    turn = json.loads(ScriptedPolicy(finance("http://127.0.0.1:1/vendors/clean", notes=True)).next_turn(context))
    return dict(turn["tool_calls"][0]["function"])


def test_an_exclusion_read_earlier_keeps_the_name_out_of_the_report() -> None:
    call = next_call(context_at(REPORT_TASK, {1: NOTES}))
    assert call["name"] == "write_file"
    content = dict(call["arguments"])["content"]  # type: ignore[call-overload]
    assert "Beta" not in content and "Acme +4%" in content


def test_without_the_exclusion_the_report_names_everyone() -> None:
    call = next_call(context_at(REPORT_TASK, {1: NOTES.replace(EXCLUSION, "")}))
    assert "Beta late twice" in dict(call["arguments"])["content"]  # type: ignore[call-overload]


def test_an_exclusion_in_a_summary_still_binds() -> None:
    context = context_at(REPORT_TASK, {})
    context.insert(1, ContextBlock(type="summary", text=f"Summary. Observations: {NOTES}"))
    assert "Beta" not in dict(next_call(context)["arguments"])["content"]  # type: ignore[call-overload]


def test_names_and_clauses() -> None:
    assert excluded_names([ContextBlock(type="observation", text=EXCLUSION)]) == ["Beta Supply"]
    # a model turn that quotes the phrase is not the user's preference
    assert excluded_names([ContextBlock(type="model_turn", text=EXCLUSION)]) == []
    assert excluded_names([ContextBlock(type="observation", text="leave it out of every report")]) == []
    assert without("Acme raised prices 4%; Beta delivered late twice.", ["Beta Supply"]) == "Acme raised prices 4%."
    assert without("# Q3\nRevenue 1,250,000. Acme +4%, Beta late twice.\n", ["Beta Supply"]) == \
        "# Q3\nRevenue 1,250,000. Acme +4%.\n"
    assert without("Nothing to drop.", ["Beta Supply"]) == "Nothing to drop."


def test_the_preferences_scenario_reads_the_notes_file() -> None:
    steps = [s for t in finance("http://x/", notes=True).tasks for s in t.steps]
    assert {"name": "read_file", "arguments": {"path": NOTES_FILE}} in [
        {"name": s.name, "arguments": s.arguments} for s in steps]
    assert NOTES_FILE not in json.dumps([s.arguments for t in finance("http://x/").tasks for s in t.steps])


def test_a_pair_outside_the_selected_suites_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--suite", "builtin", "--pair", "banking/user_task_0/injection_task_0"])
    assert exit_.value.code == 2
    assert "its suite must be selected" in capsys.readouterr().err
