"""A fleet on tcp:// with CURVE throughout, on a 2-node Ray cluster: nodes with the fleet's key directory,
the door with its own [auth].

Both Ray nodes run on this machine, but the door reaches their daemons only as it would on other hosts:
on tcp://<the Ray node's IP>:<port>, presenting the fleet's door key. A client without an admitted key
gets nothing from a node's port. The door keeps who opened which session: an agent's key uses its own
sessions and nobody else's, as on one daemon. Forks through the door hold a
placement group on their parent's node, and are refused, before they exist, when that node has no room.
The nodes use the copy snapshot backend: a session lost with its node is re-created on the other from
its last export, whose unchanged files were hard links to the export before it.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxd import protocol as p
from sandboxd.auth import generate_keys, read_public_key, read_secret_key
from sandboxd.client import Client, DaemonUnreachable, RemoteError
from sandboxd.db import Database
from sandboxd.errors import ErrorCode
from sandboxd.fleet.export import last_exported
from tests.integration.test_fleet_ray import door_on

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.docker

#: two sandboxes fit a 1-CPU node, a third does not: four sessions fill both nodes, two each
SANDBOX_CPUS = 0.4


@pytest.fixture(scope="module")
def tcp_fleet(pg_server: Any) -> Iterator[dict[str, Any]]:
    from sandboxd.fleet.nodes import NodeSpec

    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": system})
    worker = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    root = Path(tempfile.mkdtemp(prefix="sandboxd-fleet-tcp-"))
    url = pg_server.fresh_url()
    config = root / "sandboxd.toml"
    config.write_text('snapshot_backend = "copy"\n')
    spec = NodeSpec(state=url, state_root=str(root / "nodes"), config=str(config), shared_dir=str(root / "shared"),
                    keys_dir=str(root / "keys"))
    for name in ("door-server", "operator"):
        generate_keys(root / "door-keys", name)
    for name in ("agent", "other-agent"):
        generate_keys(root / "door-keys" / "clients", name)
    door_config = root / "door.toml"
    door_config.write_text('[auth]\nserver_secret_key_file = "door-keys/door-server.key_secret"\n'
                           'client_keys_dir = "door-keys/clients"\noperator_keys = ["door-keys/operator.key"]\n')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    try:
        with door_on(cluster, spec, endpoint, root, cpus=SANDBOX_CPUS, memory_mb=64,
                     door_config=str(door_config)) as door:
            yield {"endpoint": endpoint, "url": url, "door": door, "keys": root / "keys",
                   "door_keys": root / "door-keys", "cluster": cluster, "worker": worker, "shared": root / "shared"}
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def operator(tcp_fleet: dict[str, Any]) -> Client:
    door_keys = tcp_fleet["door_keys"]
    return Client.with_key_files(tcp_fleet["endpoint"], door_keys / "door-server.key",
                                 door_keys / "operator.key_secret", timeout_s=120)


def answers_the_door_only(endpoint: str, keys: Path, rogue: str) -> set[str]:
    """A node's port gives no answer at all to no key or a key not in the allowlist (a CURVE refusal is
    silent); to the fleet's door key it answers as to an operator: the sessions it lists."""
    node_key = read_public_key(keys / "node.key")
    generate_keys(keys.parent / rogue, "rogue")
    rogue_public, rogue_secret = read_secret_key(keys.parent / rogue / "rogue.key_secret")
    for stranger in (Client(endpoint, timeout_s=3),
                     Client(endpoint, timeout_s=3, server_public_key=node_key, public_key=rogue_public,
                            secret_key=rogue_secret)):
        with pytest.raises(DaemonUnreachable), stranger:
            stranger.sessions()
    door_public, door_secret = read_secret_key(keys / "door.key_secret")
    with Client(endpoint, timeout_s=30, server_public_key=node_key, public_key=door_public,
                secret_key=door_secret) as as_door:
        return {s.session_id for s in as_door.sessions()}


def test_nodes_on_tcp_answer_the_door_only_and_forks_hold_their_node(tcp_fleet: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.util.placement_group import placement_group_table

    from sandboxd.fleet import placement

    door, keys = tcp_fleet["door"], tcp_fleet["keys"]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert len(door.nodes) == 2
    for node_id, endpoint in door.nodes.items():  # on the Ray node's own IP, each its own port
        assert endpoint.startswith(f"tcp://{ips[node_id]}:"), endpoint
    assert len(set(door.nodes.values())) == 2

    door_keys = tcp_fleet["door_keys"]
    agent, other = (Client.with_key_files(tcp_fleet["endpoint"], door_keys / "door-server.key",
                                          door_keys / "clients" / f"{name}.key_secret", timeout_s=60)
                    for name in ("agent", "other-agent"))
    client = operator(tcp_fleet)
    state = Database(tcp_fleet["url"])
    # Every session a node sees is the door's; the door answers for who opened it, by the daemon's own rule.
    with agent, other:
        mine = agent.open_session()
        assert mine.owner == read_public_key(door_keys / "clients" / "agent.key")
        agent.call(mine.session_id, "write_file", {"path": "a.txt", "content": "agent's"})
        assert agent.call(mine.session_id, "read_file", {"path": "a.txt"}).stdout == "agent's"
        for attempt in (lambda: other.call(mine.session_id, "read_file", {"path": "a.txt"}),
                        lambda: other.close_session(mine.session_id),
                        lambda: other.calls(mine.session_id),
                        lambda: agent.calls(None),  # every session's calls: an operator's view
                        lambda: agent.fork(mine.session_id, "cp-none")):  # operators only, as on one daemon
            with pytest.raises(RemoteError) as refused:
                attempt()
            assert refused.value.code == ErrorCode.UNAUTHORIZED
        assert [s.session_id for s in agent.sessions()] == [mine.session_id]
        assert other.sessions() == []
        assert mine.session_id in {s.session_id for s in client.sessions()}  # the operator sees every one
        agent.close_session(mine.session_id)  # and its placement group goes: the four below need the room
    sessions = [client.open_session().session_id for _ in range(4)]
    placed = {sid: state.value("SELECT node FROM sessions WHERE session_id = ?", [sid]) for sid in sessions}
    assert sorted(list(placed.values()).count(n) for n in door.nodes) == [2, 2], placed
    for sid in sessions:  # answered through the door, over tcp+CURVE, by the node it was placed on
        client.call(sid, "write_file", {"path": "where.txt", "content": sid})
        assert client.call(sid, "read_file", {"path": "where.txt"}).stdout == sid

    # A node's port admits the door's key and nothing else: no key, or a key not in the allowlist, gets no
    # answer at all (a CURVE refusal is silent), so the port is no way into its sandboxes.
    node, endpoint = next(iter(door.nodes.items()))
    # The same port, the right key: answered, as an operator (it lists sessions it did not open itself).
    assert answers_the_door_only(endpoint, keys, "rogue") == {sid for sid, at in placed.items() if at == node}

    # A fork holds a group on its parent's node; with no room there it is refused before it exists.
    parent = next(sid for sid in sessions if placed[sid] == node)
    client.checkpoint(parent, p.CheckpointRecord(checkpoint_id="cp-start", step=0, turn=0, token_offset=0,
                                                 cache_handle="local:0", reason="start"))
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 3.0)  # the node is full: no need to wait a minute
    with pytest.raises(RemoteError) as full:
        client.fork(parent, "cp-start")
    assert full.value.code == ErrorCode.SANDBOX_UNAVAILABLE and full.value.details["node"] == node
    assert state.value("SELECT COUNT(*) FROM sessions WHERE state != 'closed'") == 4  # no fork was made
    assert set(door.placements.groups) == set(sessions)
    neighbour = next(sid for sid in sessions if sid != parent and placed[sid] == node)
    client.close_session(neighbour)  # room on the parent's node
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 60.0)
    fork = client.fork(parent, "cp-start")["session_id"]
    assert state.value("SELECT node FROM sessions WHERE session_id = ?", [fork]) == node
    assert client.call(fork, "read_file", {"path": "where.txt"}).stdout == parent  # the parent's files, there
    held = placement_group_table(door.placements.groups[fork])
    assert held["state"] == "CREATED" and held["bundles_to_node_id"][0] == node
    assert held["bundles"][0]["CPU"] == SANDBOX_CPUS
    group = door.placements.groups[fork]
    client.close_session(fork)
    assert fork not in door.placements.groups and placement_group_table(group)["state"] == "REMOVED"
    state.close()
    client.close()


def test_a_copy_backend_session_lost_with_its_node_is_adopted_from_its_export(tcp_fleet: dict[str, Any]) -> None:
    client, state = operator(tcp_fleet), Database(tcp_fleet["url"])
    worker, shared = tcp_fleet["worker"], tcp_fleet["shared"]

    def open_on(node: str) -> list[str]:
        return [r["session_id"] for r in state.rows(
            "SELECT session_id FROM sessions WHERE node = ? AND state = 'open' ORDER BY created_at", [node])]

    while not open_on(worker.node_id):  # Ray places; open until one lands on the node about to go
        client.open_session()
    victim = open_on(worker.node_id)[0]
    client.call(victim, "write_file", {"path": "keep.txt", "content": "unchanged"})
    client.call(victim, "write_file", {"path": "change.txt", "content": "v1"})
    first = client.snapshot(victim, "first").snapshot_id
    client.call(victim, "write_file", {"path": "change.txt", "content": "version two"})
    second = client.snapshot(victim, "second").snapshot_id
    deadline = time.monotonic() + 60
    while last_exported(shared, victim) != second:
        assert time.monotonic() < deadline, "the snapshot was never exported"
        time.sleep(0.1)
    one, two = shared / victim / first, shared / victim / second
    assert (one / "keep.txt").stat().st_ino == (two / "keep.txt").stat().st_ino  # stored once
    assert (one / "change.txt").read_text() == "v1" and (two / "change.txt").read_text() == "version two"
    client.call(victim, "write_file", {"path": "after.txt", "content": "never snapshotted"})

    lost = open_on(worker.node_id)
    tcp_fleet["cluster"].remove_node(worker)
    deadline = time.monotonic() + 60
    while state.value("SELECT COUNT(*) FROM sessions WHERE node = ? AND state = 'lost'", [worker.node_id]) < len(lost):
        assert time.monotonic() < deadline, "the door never marked the lost node's sessions"
        time.sleep(0.2)
    head = next(node for node in tcp_fleet["door"].nodes if node != worker.node_id)
    for sid in open_on(head)[1:]:  # room on the surviving node
        client.close_session(sid)
    adopted = client.adopt_session(victim)
    assert adopted.snapshot_id == second
    assert state.value("SELECT node FROM sessions WHERE session_id = ?", [victim]) == head
    assert client.call(victim, "read_file", {"path": "change.txt"}).stdout == "version two"
    assert client.call(victim, "read_file", {"path": "keep.txt"}).stdout == "unchanged"
    with pytest.raises(RemoteError):
        client.call(victim, "read_file", {"path": "after.txt"})  # after the last snapshot: gone with the node
    state.close()
    client.close()


def test_a_node_that_joins_gets_a_daemon_on_tcp_that_answers_the_door_only(tcp_fleet: dict[str, Any]) -> None:
    client, state, door, keys = operator(tcp_fleet), Database(tcp_fleet["url"]), tcp_fleet["door"], tcp_fleet["keys"]
    for session in client.sessions():  # a clean slate: the sessions below fill every node
        client.close_session(session.session_id)
    joined = tcp_fleet["cluster"].add_node(num_cpus=1)
    deadline = time.monotonic() + 180
    while joined.node_id not in door.nodes:  # its daemon started, reached over tcp+CURVE, then placed on
        assert time.monotonic() < deadline, "the door never started a daemon on the node that joined"
        time.sleep(0.2)
    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == joined.node_id)
    endpoint = door.nodes[joined.node_id]
    assert endpoint.startswith(f"tcp://{ip}:")
    assert endpoint not in {at for node, at in door.nodes.items() if node != joined.node_id}
    live = set(door.nodes) - door.lost
    sessions = [client.open_session().session_id for _ in range(2 * len(live))]  # two a node: every live node fills
    placed = {sid: state.value("SELECT node FROM sessions WHERE session_id = ?", [sid]) for sid in sessions}
    assert list(placed.values()).count(joined.node_id) == 2, placed
    for sid in sessions:
        client.call(sid, "write_file", {"path": "where.txt", "content": sid})
        assert client.call(sid, "read_file", {"path": "where.txt"}).stdout == sid
    # Its port, like the first nodes', admits the fleet's door key alone: the joined node read the same keys.
    assert answers_the_door_only(endpoint, keys, "late-rogue") == {sid for sid, at in placed.items()
                                                                   if at == joined.node_id}
    for sid in sessions:
        client.close_session(sid)
    state.close()
    client.close()
