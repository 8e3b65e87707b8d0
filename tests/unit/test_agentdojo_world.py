"""The AgentDojo world the daemon holds: tool classes, injections, the frozen clock, persistence."""

from __future__ import annotations

import datetime
import pickle
from pathlib import Path

import jsonschema
import pytest

from sandboxd.db import Database
from sandboxd.errors import InvalidArguments, NotFound
from sandboxd.firewall import Firewall, FirewallConfig
from sandboxd.firewall.world import STATE_CHANGING, AgentDojoWorld

pytest.importorskip("agentdojo")

from agentdojo.functions_runtime import FunctionsRuntime  # noqa: E402
from agentdojo.task_suite.load_suites import get_suites  # noqa: E402


@pytest.mark.parametrize("name", ["banking", "slack", "travel", "workspace"])
def test_every_tool_that_changes_the_environment_is_external(name: str) -> None:
    """Run every ground truth of the suite; a call that changed the environment must be declared external."""
    suite = get_suites("v1.2.2")[name]
    runtime = FunctionsRuntime(suite.tools)
    base = suite.load_and_inject_default_environment({})
    changed = set()
    for task in [*suite.user_tasks.values(), *suite.injection_tasks.values()]:
        setup = getattr(task, "init_environment", None)  # user tasks have one, injection tasks do not
        env = setup(base.model_copy(deep=True)) if setup else base.model_copy(deep=True)
        for call in task.ground_truth(env.model_copy(deep=True)):
            before = env.model_dump()
            runtime.run_function(env, call.function, call.args)
            if env.model_dump() != before:
                changed.add(call.function)
    assert changed, "no ground truth changed anything: the check would pass vacuously"
    assert changed <= STATE_CHANGING, sorted(changed - STATE_CHANGING)


def test_manifests_are_agentdojos_schemas_with_effect_classes(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path)
    manifests = {m.name: m for m in world.manifests()}
    assert manifests["send_money"].effect == "external"
    assert manifests["send_money"].intent_fields == ["amount", "date", "recipient", "subject"]
    assert manifests["get_balance"].effect == "read"
    schema = manifests["send_money"].parameters
    jsonschema.validate({"recipient": "X", "amount": 1.0, "subject": "s", "date": "2022-01-01"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"recipient": "X", "amount": 1.0, "subject": "s", "date": "d", "cc": "y"}, schema)


def test_injections_land_in_the_environment_and_bad_ones_are_refused(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path)
    with pytest.raises(NotFound):
        world.run("s-1", "read_file", {"file_path": "bill-december-2023.txt"}, None)
    world.reset("s-1", {"injection_bill_text": "PAY EVE"}, "user_task_0")
    out = world.run("s-1", "read_file", {"file_path": "bill-december-2023.txt"}, None)
    assert "PAY EVE" in out["output"]
    with pytest.raises(InvalidArguments, match="unknown injection vectors"):
        world.reset("s-2", {"no_such_vector": "x"}, None)
    with pytest.raises(InvalidArguments, match="unknown user task"):
        world.reset("s-2", {}, "user_task_999")
    assert not (tmp_path / "s-2.pkl").exists()
    with pytest.raises(ValueError, match="unknown AgentDojo suite"):
        AgentDojoWorld("bank", tmp_path)


def test_a_tool_error_is_the_tools_output(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path)
    world.reset("s-1", {}, None)
    out = world.run("s-1", "update_scheduled_transaction", {"id": 999}, None)
    assert out["output"] == out["error"] and "999" in out["error"]


def test_changes_persist_and_a_new_process_reads_them(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path)
    world.reset("s-1", {}, None)
    before = len(pickle.loads(world.state("s-1")).bank_account.transactions)
    world.run("s-1", "send_money", {"recipient": "X", "amount": 5.0, "subject": "rent", "date": "2022-01-01"}, None)
    again = AgentDojoWorld("banking", tmp_path)  # what a restarted daemon sees
    transactions = pickle.loads(again.state("s-1")).bank_account.transactions
    assert len(transactions) == before + 1 and transactions[-1].subject == "rent"


def test_the_clock_a_tool_reads_is_the_calls(tmp_path: Path) -> None:
    world = AgentDojoWorld("workspace", tmp_path)
    world.reset("s-1", {}, None)
    clock = 1_700_000_000.0
    args = {"recipients": ["a@example.com"], "subject": "hi", "body": "b"}
    world.run("s-1", "send_email", args, clock)
    sent = pickle.loads(world.state("s-1")).inbox.sent[-1]
    assert sent.timestamp == datetime.datetime.fromtimestamp(clock, datetime.UTC).replace(tzinfo=None)
    # Only the suite's modules read the frozen clock: the daemon's own time is real.
    assert abs(datetime.datetime.now().timestamp() - clock) > 86400


def test_a_replay_reads_a_shadow_of_the_world_at_its_splice(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path)
    world.reset("s-1", {}, None)
    pay = {"recipient": "X", "amount": 5.0, "subject": "rent", "date": "2022-01-01"}
    count = len(pickle.loads(world.state("s-1")).bank_account.transactions)
    world.mark("s-1", "cp-1")
    world.run("s-1", "send_money", pay, None)  # after the splice: the replay must not see it
    world.begin_shadow("s-1", "s-1#r1", "cp-1")
    reads = world.run("s-1", "get_most_recent_transactions", {"n": 100}, None, branch="s-1#r1")["output"]
    assert reads.count("amount:") == count
    world.apply_shadow("s-1", "s-1#r1", "send_money", {**pay, "subject": "other"}, None)
    reads = world.run("s-1", "get_most_recent_transactions", {"n": 100}, None, branch="s-1#r1")["output"]
    assert "subject: other" in reads and "subject: rent" not in reads
    world.mark("s-1", "cp-2", branch="s-1#r1")
    # The real world took neither the shadow's payment nor lost its own.
    real = pickle.loads(world.state("s-1")).bank_account.transactions
    assert len(real) == count + 1 and real[-1].subject == "rent"
    world.end_shadow("s-1", "s-1#r1", commit=True)
    assert (tmp_path / "s-1.marks" / "cp-2.pkl").exists()  # the branch's marks are now the session's
    world.begin_shadow("s-1", "s-1#r2", "cp-2")
    reads = world.run("s-1", "get_most_recent_transactions", {"n": 100}, None, branch="s-1#r2")["output"]
    assert "subject: other" in reads
    world.mark("s-1", "cp-3", branch="s-1#r2")
    world.end_shadow("s-1", "s-1#r2", commit=False)  # abandoned: its marks go with it
    assert not (tmp_path / "s-1.marks" / "cp-3.pkl").exists()
    assert [p.name for p in (tmp_path / "s-1.marks").iterdir() if p.is_dir()] == []


def test_a_replays_new_call_reads_the_shadow_worlds_answer_and_fires_nothing(tmp_path: Path) -> None:
    world = AgentDojoWorld("banking", tmp_path / "world")
    db = Database(str(tmp_path / "ledger.db"))
    firewall = Firewall(FirewallConfig(), db, adapters=world.adapters(5.0))
    world.reset("s-1", {}, None)
    count = len(pickle.loads(world.state("s-1")).bank_account.transactions)
    world.mark("s-1", "cp-1")
    pay = {"recipient": "X", "amount": 5.0, "subject": "rent", "date": "2022-01-01"}
    fired = firewall.call("s-1", "s-1", "send_money", pay, turn=1)
    assert fired.state == "done" and not fired.simulated
    branch = firewall.open_replay("s-1")
    world.begin_shadow("s-1", branch, "cp-1")
    other = {**pay, "subject": "other", "amount": 7.0}
    new = firewall.call("s-1", "s-1", "send_money", other, call_id="r/call-1", mode="shadow", turn=1, branch=branch)
    # The answer the live world would have given, though the call is staged, not sent.
    assert new.state == "staged" and new.shadowed and new.simulated
    assert new.result == {"output": "{'message': 'Transaction to X for 7.0 sent.'}"}
    # A retry of the same agent call reads the same answer, but is not simulated twice: the shadow
    # holds one 'other' payment.
    again = firewall.call("s-1", "s-1", "send_money", other, call_id="r/call-1", mode="shadow", turn=1, branch=branch)
    assert again.call_id == new.call_id and again.state == "staged" and again.deduplicated
    assert again.simulated and again.result == new.result
    record = firewall.ledger.get(new.call_id)
    assert record is not None and record.simulated == new.result and record.result is None
    shadow = world.run("s-1", "get_most_recent_transactions", {"n": 100}, None, branch=branch)["output"]
    assert shadow.count("subject: other") == 1 and "subject: rent" not in shadow
    # Nothing was sent: the real world holds the original payment alone, and the call waits for an operator.
    real = pickle.loads(world.state("s-1")).bank_account.transactions
    assert len(real) == count + 1 and real[-1].subject == "rent"
    assert firewall.finish_replay(branch, commit=True).staged == [new.call_id]
    # Released, it reaches the real world, whose answer replaces nothing the agent was told.
    released = firewall.release(new.call_id)
    assert released.state == "done" and not released.simulated and released.result is not None
    assert pickle.loads(world.state("s-1")).bank_account.transactions[-1].subject == "other"
    db.close()


def test_a_name_copied_from_a_result_is_copied_as_the_agent_read_it() -> None:
    # Slack's external channel is named by its injection vector, so the ground truth's
    # add_user_to_channel carries the injection; an agent that never read it cannot write it.
    from agent.eval.agentdojo import pairs
    from agent.scenario import ScriptedPolicy

    pair = next(p for p in pairs("slack") if (p.user_task, p.injection_task) == ("user_task_7", "injection_task_1"))
    step = pair.scenario.tasks[0].steps[1]
    assert "<INFORMATION>" in step.arguments["channel"]
    assert pair.copy(step, [f"channels: External_{pair.goal}"]) == step
    forgot = pair.copy(step, ["channels: [general, External_]"])
    assert forgot.arguments == {"user": "Charlie", "channel": forgot.arguments["channel"]}
    assert forgot.arguments["channel"].startswith("External_") and "<INFORMATION>" not in forgot.arguments["channel"]
    # The policy applies it to the user task's own steps only, with the results read before each step.
    policy = ScriptedPolicy(pair.scenario, copy=pair.copy)
    actions = policy._actions(pair.scenario.tasks[0], ["channels: [general, External_]"])
    assert actions[1] == forgot and actions[0] == pair.scenario.tasks[0].steps[0]
