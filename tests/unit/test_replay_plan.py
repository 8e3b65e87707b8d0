"""What a replay may take from the record (agent.replay), over generated sessions: a read only when nothing was
written since the splice checkpoint, in either world; a model turn only when the graph shows no tainted parent
and its context is the same."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.replay import DIGEST, ReplayPlan, call_key
from sandboxd import protocol as p

EFFECTS = {"read_file": "read", "list_dir": "read", "write_file": "write", "shell": "write", "send_email": "external",
           "http_get": "read"}
REUSABLE = ("read_file", "list_dir")  # http_get reads the open world: never taken from the record

calls = st.lists(st.tuples(st.sampled_from(sorted(EFFECTS)), st.sampled_from(["a.txt", "b.txt"]), st.booleans()),
                 min_size=1, max_size=12)


def _plan(checkpoint_step: int, recorded: list[p.RecordedResult], closure: list[str] = (),  # type: ignore[assignment]
          source_call: str | None = None) -> p.BeginRevocationResponse:
    cp = p.CheckpointRecord(checkpoint_id="cp", step=checkpoint_step, turn=0, token_offset=0, cache_handle="h",
                            reason="turn", manifest=[])
    return p.BeginRevocationResponse(request_id="r", revocation_id="rev", branch="b", checkpoint=cp, inputs=[],
                                     recorded=recorded, closure=list(closure), source_call=source_call)


def _session(made: list[tuple[str, str, bool]]) -> list[p.Artifact]:
    out = []
    for i, (tool, path, invalid) in enumerate(made, 1):
        meta = {"tool": tool, **({"error": "bad"} if invalid else {})}
        out.append(p.Artifact(artifact_id=f"call-{i}", type="tool_call", step=i - 1, meta=meta,
                              content=json.dumps({"name": tool, "arguments": {"path": path}})))
        out.append(p.Artifact(artifact_id=f"obs-{i}", type="observation", parents=[f"call-{i}"], step=i,
                              content=f"result {i}"))
    return out


@settings(max_examples=200, deadline=None)
@given(calls, st.integers(min_value=0, max_value=12), st.booleans())
def test_a_read_is_reused_only_if_nothing_was_written_since_the_checkpoint(made: list[tuple[str, str, bool]],
                                                                            checkpoint: int, wrote: bool) -> None:
    artifacts = _session(made)
    recorded = [p.RecordedResult(observation=a.artifact_id, call=a.parents[0], content=a.content + " (sanitized)")
                for a in artifacts if a.type == "observation" and a.step > checkpoint]
    plan = ReplayPlan(artifacts, _plan(checkpoint, recorded), EFFECTS, REUSABLE)
    plan.wrote = wrote
    expected: dict[str, str] = {}
    written = False
    for i, (tool, path, invalid) in enumerate(made, 1):
        if i <= checkpoint or invalid:
            continue
        written = written or EFFECTS[tool] == "write"
        if tool in REUSABLE and not written:
            expected.setdefault(call_key(tool, {"path": path}), f"result {i} (sanitized)")
    for tool in EFFECTS:
        for path in ("a.txt", "b.txt"):
            got = plan.read(tool, {"path": path})
            assert got == (None if wrote else expected.get(call_key(tool, {"path": path})))
            if got is not None:
                assert got.endswith("(sanitized)")  # the daemon's sanitized copy, never the raw record


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=4, unique=True), min_size=1,
                max_size=5),
       st.sets(st.integers(min_value=0, max_value=5)), st.booleans())
def test_a_turn_is_prefilled_only_without_a_tainted_parent(turn_parents: list[list[int]], tainted: set[int],
                                                           digested: bool) -> None:
    blocks = [p.Artifact(artifact_id=f"obs-{i}", type="observation", step=i, content=f"text {i}") for i in range(6)]
    turns = [p.Artifact(artifact_id=f"turn-{k}", type="model_turn", parents=[f"obs-{i}" for i in parents],
                        content=f"turn {k}", meta={DIGEST: f"d{k}"} if digested else {})
             for k, parents in enumerate(turn_parents)]
    closure = [f"obs-{i}" for i in sorted(tainted)]
    plan = ReplayPlan(blocks + turns, _plan(0, [], closure), EFFECTS, REUSABLE)
    for parents in turn_parents:
        context = [("observation", f"text {i}") for i in parents]
        found = plan.turn_for(context)
        if not digested or tainted & set(parents):
            assert found is None  # a turn with the same context has the same parents, so the same taint
        else:
            assert found is not None and found.digest.startswith("d")
            same = [t for t, ps in zip(turns, turn_parents, strict=True) if ps == parents]
            assert found.text in {t.content for t in same}
        # One word more or less in the context and nothing is offered.
        assert plan.turn_for([*context, ("user", "more")]) is None
