"""Snapshots through the daemon, call-id records, and a daemon that is killed and started again."""

from __future__ import annotations

import json

import pytest

from sandboxd.client import Client, RemoteError
from tests.integration.conftest import DaemonProcess, both_runtimes, tree_listing_code

pytestmark = [pytest.mark.docker, both_runtimes]

BUILD_TREE = """
set -e
mkdir -p src/pkg empty deep/a/b/c
printf 'print(1)\\n' > src/main.py
printf 'x = 2\\n' > src/pkg/mod.py
head -c 200000 /dev/urandom > blob.bin
echo secret > private.txt && chmod 600 private.txt
echo run > tool.sh && chmod 755 tool.sh
echo ro > readonly.txt && chmod 444 readonly.txt
ln -s src/main.py link-to-main
chmod 700 deep/a
echo leaf > deep/a/b/c/leaf
"""

MUTATE_TREE = """
set -e
rm -rf src/pkg private.txt empty
echo changed >> src/main.py
chmod 644 tool.sh
head -c 1000 /dev/urandom > blob.bin
mkdir -p new/dir && echo n > new/dir/file
rm link-to-main && ln -s blob.bin link-to-main
chmod 755 deep/a
"""


def tree(client: Client, session: str) -> list[list[object]]:
    return json.loads(client.call(session, "python", {"code": tree_listing_code()}).stdout)  # type: ignore[no-any-return]


def run(client: Client, session: str, script: str) -> None:
    result = client.call(session, "shell", {"command": script})
    assert result.exit_code == 0, result.stderr


def test_snapshot_change_restore_gives_back_the_exact_tree(client: Client, session: str) -> None:
    run(client, session, BUILD_TREE)
    before = tree(client, session)
    assert len(before) == 15
    snap = client.snapshot(session, label="built")
    run(client, session, MUTATE_TREE)
    changed = tree(client, session)
    assert changed != before
    client.restore(session, snap.snapshot_id)
    assert tree(client, session) == before
    # Restoring is repeatable, and later snapshots stack on earlier ones.
    run(client, session, "echo later > later.txt")
    later = client.snapshot(session)
    run(client, session, "rm -rf ./* && echo wiped > w")
    client.restore(session, later.snapshot_id)
    after_later = tree(client, session)
    assert [row for row in after_later if row[0] != "later.txt"] == before
    client.restore(session, snap.snapshot_id)
    assert tree(client, session) == before


def test_snapshot_listing_and_deletion(client: Client, session: str) -> None:
    first = client.snapshot(session, label="one")
    run(client, session, "echo 2 > two")
    second = client.snapshot(session, label="two")
    listed = client.snapshots(session)
    assert [(s.snapshot_id, s.label) for s in listed] == [(first.snapshot_id, "one"), (second.snapshot_id, "two")]
    client.delete_snapshot(session, first.snapshot_id)
    assert [s.snapshot_id for s in client.snapshots(session)] == [second.snapshot_id]
    with pytest.raises(RemoteError) as err:
        client.restore(session, first.snapshot_id)
    assert err.value.wire_code == "snapshot_not_found"
    # The surviving snapshot still restores, though it was layered on the deleted one.
    run(client, session, "rm two")
    client.restore(session, second.snapshot_id)
    assert client.call(session, "read_file", {"path": "two"}).stdout == "2\n"


def test_a_snapshot_of_another_session_is_refused(client: Client) -> None:
    a = client.open_session().session_id
    b = client.open_session().session_id
    snap = client.snapshot(a)
    with pytest.raises(RemoteError) as err:
        client.restore(b, snap.snapshot_id)
    assert err.value.wire_code == "snapshot_not_found"


def test_repeated_call_id_is_answered_from_the_record(client: Client, session: str) -> None:
    args = {"command": "echo tick >> counter; wc -l < counter"}
    first = client.call(session, "shell", args, call_id="call-1")
    again = client.call(session, "shell", args, call_id="call-1")
    assert (first.stdout, first.replayed) == ("1\n", False)
    assert (again.stdout, again.replayed, again.call_id) == ("1\n", True, "call-1")
    assert client.call(session, "read_file", {"path": "counter"}).stdout == "tick\n"
    with pytest.raises(RemoteError) as err:
        client.call(session, "shell", {"command": "echo other"}, call_id="call-1")
    assert err.value.wire_code == "call_id_conflict"
    # A recorded failure is replayed as the same failure, not run again.
    with pytest.raises(RemoteError) as err:
        client.call(session, "shell", {"command": "echo t >> counter; sleep 30", "timeout_s": 0.5}, call_id="slow")
    with pytest.raises(RemoteError) as again_err:
        client.call(session, "shell", {"command": "echo t >> counter; sleep 30", "timeout_s": 0.5}, call_id="slow")
    assert err.value.wire_code == again_err.value.wire_code == "tool_timeout"
    assert client.call(session, "read_file", {"path": "counter"}).stdout == "tick\nt\n"


def test_restart_keeps_sessions_usable(daemon: DaemonProcess) -> None:
    client = daemon.client()
    sid = client.open_session().session_id
    run(client, sid, "echo kept > kept.txt")
    snap = client.snapshot(sid)
    run(client, sid, "echo after > after.txt")
    client.call(sid, "shell", {"command": "echo once"}, call_id="before-crash")
    daemon.restart()  # SIGKILL, then a new process on the same state
    client = daemon.client()
    assert [s.session_id for s in client.sessions()] == [sid]
    assert client.call(sid, "read_file", {"path": "after.txt"}).stdout == "after\n"
    assert client.call(sid, "shell", {"command": "echo once"}, call_id="before-crash").replayed
    client.restore(sid, snap.snapshot_id)
    listing = client.call(sid, "list_dir", {}).stdout
    assert "kept.txt" in listing and "after.txt" not in listing
    assert [s.snapshot_id for s in client.snapshots(sid)] == [snap.snapshot_id]


def test_restart_recreates_a_container_that_vanished(daemon: DaemonProcess, engine) -> None:  # type: ignore[no-untyped-def]
    client = daemon.client()
    sid = client.open_session().session_id
    run(client, sid, "echo survives > f")
    daemon.kill()
    info = [c for c in engine.containers.list(all=True, filters={"label": f"sandboxd.session={sid}"})]
    assert len(info) == 1
    info[0].remove(force=True)
    daemon.start()
    client = daemon.client()
    assert client.call(sid, "read_file", {"path": "f"}).stdout == "survives\n"
