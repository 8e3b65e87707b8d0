"""A fleet on a 3-node Ray cluster (`ray.cluster_utils.Cluster`, one machine, one Docker engine), its
state on a real PostgreSQL server, external effects to a real SMTP sink.

One module-wide cluster and door (starting them is most of the cost): sessions opened through the door
are placed by Ray over all three nodes and served by their node's daemon; a node removed mid-send takes
its daemon with it, its sessions are marked lost, the survivors keep serving, and the send that was in
flight is neither lost from the ledger nor sent again.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import Client, RemoteError
from sandboxd.db import Database
from sandboxd.errors import ErrorCode
from sandboxd.fleet.export import last_exported
from sandboxd.launcher import DaemonProcess
from tests.integration.test_firewall_daemon import SlowSmtpSink, mail

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def smtp() -> Iterator[SlowSmtpSink]:
    sink = SlowSmtpSink()
    yield sink
    sink.close()


@contextmanager
def door_on(cluster: Any, spec: Any, endpoint: str, root: Path, **options: Any) -> Iterator[Any]:
    """The door of `spec` on `cluster`, serving `endpoint` from a thread; after: the door stopped, and every
    node's daemon and sandboxes gone (the lost nodes' too: they outlived them on the shared engine)."""
    from sandboxd.fleet.door import Fleet, serve

    started: list[Fleet] = []
    ready = threading.Event()
    ray.init(address=cluster.address, log_to_driver=False)
    door = threading.Thread(target=serve, args=(cluster.address, spec, endpoint, str(root / "door")),
                            kwargs={**options, "ready": lambda f: (started.append(f), ready.set())}, daemon=True)
    door.start()
    try:
        assert ready.wait(300), "the fleet did not start"
        yield started[0]
    finally:
        if started:
            started[0].server.stop()
        door.join(180)
        for state_dir in Path(spec.state_root).iterdir() if Path(spec.state_root).exists() else []:
            if state_dir.is_dir():
                DaemonProcess(state_dir).shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def fleet(pg_server: Any, smtp: SlowSmtpSink) -> Iterator[dict[str, Any]]:
    from sandboxd.fleet.nodes import NodeSpec

    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": system})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    root = Path(tempfile.mkdtemp(prefix="sandboxd-fleet-"))
    config = root / "sandboxd.toml"
    config.write_text(f'[firewall]\nadapter_timeout_s = 20.0\n'
                      f'[firewall.smtp]\nhost = "127.0.0.1"\nport = {smtp.port}\n')
    url = pg_server.fresh_url()
    spec = NodeSpec(state=url, state_root=str(root / "nodes"), config=str(config), shared_dir=str(root / "shared"))
    endpoint = f"ipc://{root / 'door.sock'}"
    try:
        with door_on(cluster, spec, endpoint, root, cpus=0.5, memory_mb=64) as door:
            yield {"cluster": cluster, "workers": workers, "endpoint": endpoint, "url": url, "door": door,
                   "shared": root / "shared"}
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def test_sessions_spread_a_lost_node_is_recovered_elsewhere_and_nothing_fires_twice(fleet: dict[str, Any],
                                                                            smtp: SlowSmtpSink) -> None:
    client = Client(fleet["endpoint"], timeout_s=120)
    state = Database(fleet["url"])
    sessions = [client.open_session().session_id for _ in range(6)]  # 3 nodes x 1 CPU, 0.5 CPU a sandbox
    placed = {sid: state.value("SELECT node FROM sessions WHERE session_id = ?", [sid]) for sid in sessions}
    assert len(set(placed.values())) == 3, placed
    for sid in sessions:  # each session's sandbox answers through the door, on its own node
        client.call(sid, "write_file", {"path": "where.txt", "content": sid})
        assert client.call(sid, "read_file", {"path": "where.txt"}).stdout == sid
    assert {s.session_id for s in client.sessions()} == set(sessions)
    seen = client.wait_events(sessions[0], timeout_s=0)  # its node's events, through the door
    assert seen.events, "the calls above were announced"
    other = Client(fleet["endpoint"], timeout_s=120)
    later = threading.Timer(1.0, lambda: other.call(sessions[0], "read_file", {"path": "where.txt"}))
    later.start()
    woken = client.wait_events(sessions[0], after=seen.events[-1].seq, epoch=seen.epoch, timeout_s=30)
    later.join()
    other.close()
    assert woken.events and woken.events[-1].seq > seen.events[-1].seq  # a parked wait, answered by the call

    doomed = fleet["workers"][0]
    victims = [sid for sid, node in placed.items() if node == doomed.node_id]
    survivors = [sid for sid in sessions if sid not in victims]
    assert client.call(victims[0], "send_email", mail(1), call_id="m1").state == "done"  # acknowledged
    client.call(victims[0], "write_file", {"path": "kept.txt", "content": "in the snapshot"})
    snapshot = client.snapshot(victims[0], "before the loss").snapshot_id
    deadline = time.monotonic() + 60
    while last_exported(fleet["shared"], victims[0]) != snapshot:  # exported by its node, incrementally
        assert time.monotonic() < deadline, "the snapshot was never exported"
        time.sleep(0.1)
    client.call(victims[0], "write_file", {"path": "after.txt", "content": "never snapshotted"})
    smtp.delay = 10.0
    errors: list[BaseException] = []

    def send() -> None:
        try:
            Client(fleet["endpoint"], timeout_s=120).call(victims[0], "send_email", mail(2), call_id="m2")
        except RemoteError as exc:
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 60
    while not smtp.in_data.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert smtp.in_data.is_set()
    fleet["cluster"].remove_node(doomed)  # mid-send
    sender.join(120)
    assert len(errors) == 1 and errors[0].code == ErrorCode.SANDBOX_UNAVAILABLE  # type: ignore[attr-defined]

    deadline = time.monotonic() + 60
    while state.value("SELECT COUNT(*) FROM sessions WHERE state = 'lost'") < len(victims):
        assert time.monotonic() < deadline, "the door never marked the lost node's sessions"
        time.sleep(0.2)
    with pytest.raises(RemoteError) as refused:
        client.call(victims[0], "send_email", mail(2), call_id="m2")  # the agent's retry
    assert refused.value.code == ErrorCode.SANDBOX_UNAVAILABLE and refused.value.details["state"] == "lost"
    for sid in survivors:  # the other nodes never noticed
        assert client.call(sid, "read_file", {"path": "where.txt"}).stdout == sid
    assert {s.session_id for s in client.sessions()} == set(survivors)

    smtp.delay = 0.0
    assert smtp.count == 2  # m1, and m2 once (it reached the relay before the node went)
    ledger = {r["call_id"]: r["state"] for r in state.rows(
        "SELECT a.agent_call_id AS call_id, c.state FROM ledger_aliases a JOIN ledger_calls c "
        "ON c.call_id = a.call_id WHERE c.session_id = ?", [victims[0]])}
    assert ledger["m1"] == "done"  # acknowledged before the loss: still there
    assert ledger["m2"] in ("intent", "fired")  # in flight with no live owner

    client.close_session(survivors[0])  # the cluster was full: room for the lost session
    adopted = client.adopt_session(victims[0])  # re-created where Ray finds room, from the last export
    assert adopted.snapshot_id == snapshot
    node = state.value("SELECT node FROM sessions WHERE session_id = ?", [victims[0]])
    assert node != doomed.node_id and node in set(placed.values())
    assert client.call(victims[0], "read_file", {"path": "kept.txt"}).stdout == "in the snapshot"
    with pytest.raises(RemoteError):
        client.call(victims[0], "read_file", {"path": "after.txt"})  # after the last snapshot: gone with the node
    assert client.call(victims[0], "send_email", mail(1), call_id="m1").state == "done"  # answered, not resent
    with pytest.raises(RemoteError) as unknown:
        client.call(victims[0], "send_email", mail(2), call_id="m2")  # may have gone out: never sent again
    assert unknown.value.code == ErrorCode.CALL_UNKNOWN
    assert smtp.count == 2
    state.close()
    client.close()
