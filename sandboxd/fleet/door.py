"""The front door (`sandboxd fleet serve`): one endpoint, the daemon's protocol, sessions on many nodes.

It is a `Handler` for the daemon's own `Server`, so clients, `sandboxd agent run` and the CLI talk to
it as to one daemon. Each request is forwarded to the node its session lives on:

- OpenSession: Ray's scheduler places the session, a placement group of one bundle holding the
  sandbox's CPU and memory (`[sandbox]` cpus and memory_mb), kept until the session closes; the
  session is opened by the daemon of the node Ray chose.
- Fork: the fork's sandbox runs on its parent's node, so its bundle is reserved there first (a group
  pinned to that node, `fleet.placement`); with no room there within PLACEMENT_TIMEOUT_S the fork is
  refused before it exists, rather than made outside Ray's accounting (where Ray would keep placing
  sessions on a node it believes has room). Closing the fork releases the group.
- A request naming a session goes to the node in the session's row (the `node` column the node's
  daemon stamped); one naming a call or a revocation goes to its session's node; ListSessions asks
  every node; the rest (Health, ListTools, operators' ledger views over the shared database) any node.
- A node that joins the cluster gets its daemon; sessions are placed there once it answers.
- A node Ray reports dead: its sessions are marked `lost` in the shared database, and every request
  for them is refused (`sandbox_unavailable`, details `state: lost`). Its calls in flight become
  `unknown` to whichever daemon next reaches them (their advisory locks died with its connections), so
  nothing it may have sent is sent again.
- WaitEvents: asked of the node without waiting; with nothing yet, parked here and asked again every
  `POLL_S` until it has events or its wait runs out.

The door reaches nodes as their endpoints say (`fleet.nodes`): ipc:// on one host, or tcp:// with
CURVE, presenting the fleet's door key. Its own endpoint may be tcp:// too, with its own [auth]. Every
session a node sees is the door's (the nodes admit the door's key alone, as an operator), so the door
keeps who opened which: it stamps the opener's key as the session's owner in the shared state, and
checks every request by the daemon's own rule (`sandboxd.auth.authorize`) before forwarding it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import ray
import zmq
from ray.util.placement_group import PlacementGroup, remove_placement_group

from sandboxd import auth
from sandboxd import protocol as p
from sandboxd.auth import Peer
from sandboxd.client import Client, DaemonUnreachable
from sandboxd.db import Database
from sandboxd.errors import SandboxdError, SandboxUnavailable, UnknownSession
from sandboxd.fleet.keys import FleetKeys
from sandboxd.fleet.nodes import NodeSpec, alive_nodes, start_node
from sandboxd.fleet.placement import Placements
from sandboxd.metrics import Counter

log = logging.getLogger("sandboxd.fleet")

#: how often the door checks Ray for dead nodes, and re-asks nodes for a parked waiter's events
POLL_S = 0.25
#: the longest a forwarded request may take (a tool call's own timeout is far below it)
FORWARD_TIMEOUT_S = 900.0
#: how long a started node's daemon has to answer the door on its endpoint (a refused CURVE key is silent)
REACH_TIMEOUT_S = 30.0


class _DoorMetrics:
    def __init__(self) -> None:
        self.errors = Counter("sandboxd_fleet_rejected_frames_total", "Frames the door could not decode.", ("code",))


class _Parking:
    """`Server`'s event hook: wakes the parked waiters' sessions every POLL_S, so they are asked again."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()
        self.epochs: dict[str, str] = {}
        self._wakes: list[Callable[[str], None]] = []
        self.lock = threading.Lock()

    def listen(self, wake: Callable[[str], None]) -> None:
        self._wakes.append(wake)

    def wake_all(self) -> None:
        with self.lock:
            sessions = list(self.sessions)
        for session_id in sessions:
            for wake in self._wakes:
                wake(session_id)


class Fleet:
    """The door's `Handler`: places sessions with Ray, forwards requests, marks lost nodes' sessions."""

    INLINE: tuple[type[Any], ...] = ()  # every request is forwarded, which blocks: all go to the workers
    answer_now = staticmethod(lambda request, peer: None)  # nor is any answered on the socket thread

    def __init__(self, spec: NodeSpec, cpus: float = 0.5, memory_mb: int = 512) -> None:
        self.spec = spec
        self.placements = Placements(cpus, memory_mb)
        self.db = Database(spec.state)
        self.metrics = _DoorMetrics()
        self.events = _Parking()
        self.nodes: dict[str, str] = {}  # node id -> its daemon's endpoint
        self.actors: dict[str, Any] = {}
        self.lost: set[str] = set()
        self._local, self._stop, self._lock = threading.local(), threading.Event(), threading.Lock()
        self.curve = FleetKeys(Path(spec.keys_dir)).door_curve() if spec.keys_dir else None
        """(nodes' public key, door's public key, door's secret key): how the door connects to tcp nodes."""

    # Nodes -------------------------------------------------------------------------------------

    def start(self) -> None:
        """A daemon on every live Ray node, then the watch for dead ones."""
        for node_id in alive_nodes():
            self.actors[node_id] = start_node(self.spec, node_id)
        for node_id, actor in self.actors.items():
            self.nodes[node_id] = self.check_reachable(ray.get(actor.info.remote(), timeout=180))
        threading.Thread(target=self._watch, name="sandboxd-fleet-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        for node_id, actor in self.actors.items():
            if node_id not in self.lost:
                try:
                    ray.get(actor.stop.remote(), timeout=120)
                except Exception as exc:  # a node going away while we stop is not an error of ours
                    log.warning("stopping the daemon of %s: %s", node_id, exc)
        self.placements.release_all()
        self.db.close()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                alive = set(alive_nodes())
            except Exception:  # Ray's control plane busy: ask again next round
                log.exception("asking Ray for its nodes failed")
                continue
            for node_id in set(self.nodes) - alive - self.lost:
                self.node_lost(node_id)
            for node_id in alive - set(self.actors):  # a node that joined: its daemon, without holding this loop
                self.actors[node_id] = start_node(self.spec, node_id)
                threading.Thread(target=self._joined, args=(node_id,), daemon=True).start()
            self.events.wake_all()

    def _joined(self, node_id: str) -> None:
        try:
            endpoint = self.check_reachable(ray.get(self.actors[node_id].info.remote(), timeout=180))
        except Exception:
            log.exception("the daemon of joining node %s did not start, or the door cannot reach it", node_id)
            return
        with self._lock:
            self.nodes[node_id] = endpoint  # only now may sessions be placed there
        log.info("node %s joined", node_id)

    def check_reachable(self, info: dict[str, Any]) -> str:
        """A started node's endpoint, once its daemon answers the door there; RuntimeError saying why not."""
        endpoint, here = str(info["endpoint"]), os.uname().nodename
        if endpoint.startswith("ipc://") and info["host"] != here:
            raise RuntimeError(f"node {info['node_id']} is on host {info['host']}, the door on {here}: an ipc "
                               "socket does not cross hosts; give the fleet a key directory (tcp with CURVE)")
        server, public, secret = self.curve or (None, None, None)
        probe = Client(endpoint, timeout_s=REACH_TIMEOUT_S, server_public_key=server, public_key=public,
                       secret_key=secret)
        try:
            probe.health()
        except DaemonUnreachable as exc:
            raise RuntimeError(f"the door cannot reach node {info['node_id']}'s daemon: {exc}") from exc
        finally:
            probe.close()
        return endpoint

    def node_lost(self, node_id: str) -> list[str]:
        """Record a node's loss: its open sessions are `lost` in the shared state; returns their ids."""
        with self._lock:
            self.lost.add(node_id)
        with self.db.transaction():
            rows = self.db.rows("SELECT session_id FROM sessions WHERE node = ? AND state IN ('open', 'opening')",
                                [node_id])
            self.db.execute("UPDATE sessions SET state = 'lost' WHERE node = ? AND state IN ('open', 'opening')",
                            [node_id])
        lost = [r["session_id"] for r in rows]
        for session_id in lost:  # what they held went with the node; Ray must not hold it elsewhere for them
            self.placements.release(session_id)
        log.warning("node %s is lost, and with it sessions %s", node_id, lost)
        return lost

    # Routing -----------------------------------------------------------------------------------

    def node_of(self, request: p.Request) -> str | None:
        """The node a request must go to, or None for any."""
        session_id = getattr(request, "session_id", None)
        if session_id is None and (call_id := getattr(request, "call_id", None)) is not None:
            session_id = self.db.value("SELECT session_id FROM ledger_calls WHERE call_id = ?", [call_id])
        if session_id is None and (revocation_id := getattr(request, "revocation_id", None)) is not None:
            session_id = self.db.value("SELECT session_id FROM revocations WHERE revocation_id = ?", [revocation_id])
        if not isinstance(session_id, str):
            return None
        row = self.db.row("SELECT node, state FROM sessions WHERE session_id = ?", [session_id])
        if row is None:
            raise UnknownSession(session_id)
        if row["state"] == "lost" or row["node"] in self.lost:
            raise SandboxUnavailable(f"session {session_id} lived on node {row['node']}, which is lost",
                                     session_id=session_id, node=row["node"], state="lost")
        return str(row["node"])

    def _any_node(self) -> str:
        live = sorted(set(self.nodes) - self.lost)
        if not live:
            raise SandboxUnavailable("no node of the fleet is alive")
        return live[0]

    def forward(self, node_id: str, request: p.Request) -> p.Response:
        """Send `request` to the node's daemon and wait for its reply, or for the node's loss."""
        sockets: dict[str, zmq.Socket[bytes]] = self._local.__dict__.setdefault("sockets", {})
        sock = sockets.get(node_id)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                server, public, secret = self.curve
                sock.setsockopt(zmq.CURVE_SERVERKEY, server.encode())
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public.encode())
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
            sock.connect(self.nodes[node_id])
            sockets[node_id] = sock
        sock.send(p.encode(request))
        deadline = time.monotonic() + FORWARD_TIMEOUT_S
        while not sock.poll(int(POLL_S * 1000)):
            if node_id in self.lost or time.monotonic() > deadline:
                sock.close()  # a late reply must not answer this thread's next request
                del sockets[node_id]
                session_id = getattr(request, "session_id", None)
                raise SandboxUnavailable(f"node {node_id} was lost during the request", session_id=session_id,
                                         node=node_id, state="lost")
        return p.decode_response(sock.recv(), max_frame=1 << 31)

    # Handler -----------------------------------------------------------------------------------

    def handle(self, request: p.Request, peer: Peer) -> p.Response:
        try:
            self._authorize(request, peer)
            if isinstance(request, p.OpenSessionRequest):
                return self._open(request, peer)
            if isinstance(request, p.ListSessionsRequest):
                return self._list(request, peer)
            if isinstance(request, p.AdoptSessionRequest):
                return self._adopt(request)
            if isinstance(request, p.ForkRequest):
                return self._fork(request)
            node_id = self.node_of(request)
            reply = self.forward(node_id or self._any_node(), request)
            if isinstance(request, p.CloseSessionRequest) and not isinstance(reply, p.ErrorResponse):
                self.placements.release(request.session_id)
            return reply
        except SandboxdError as exc:
            return p.error_response(request.request_id, exc)

    def _authorize(self, request: p.Request, peer: Peer) -> None:
        auth.authorize(request, peer, self._owner_of, self._session_of_revocation)

    def _owner_of(self, session_id: str) -> str | None:
        owner = self.db.value("SELECT owner FROM sessions WHERE session_id = ?", [session_id])
        return owner if isinstance(owner, str) else None

    def _session_of_revocation(self, revocation_id: str) -> str | None:
        session_id = self.db.value("SELECT session_id FROM revocations WHERE revocation_id = ?", [revocation_id])
        return session_id if isinstance(session_id, str) else None

    def _open(self, request: p.OpenSessionRequest, peer: Peer) -> p.Response:
        group, node_id = self._place()
        reply = self._holding(group, node_id, request)
        if isinstance(reply, p.OpenSessionResponse):
            # The node stamped the door's key. Until this update the session is nobody's but an operator's
            # (the rule refuses a key that is not the owner's), so the window denies rather than admits.
            session_id = reply.session.session_id
            with self.db.transaction():
                self.db.execute("UPDATE sessions SET owner = ? WHERE session_id = ?", [peer.key, session_id])
            reply = msgspec.structs.replace(reply, session=msgspec.structs.replace(reply.session, owner=peer.key))
        return reply

    def _holding(self, group: PlacementGroup, node_id: str, request: p.OpenSessionRequest | p.ForkRequest
                 ) -> p.Response:
        """Forward a request that makes a session: `group` is kept for the new session, or removed if none was made."""
        try:
            reply = self.forward(node_id, request)
        except BaseException:
            remove_placement_group(group)
            raise
        if isinstance(reply, p.OpenSessionResponse | p.ForkResponse):
            self.placements.keep(reply.session.session_id, group)
        else:
            remove_placement_group(group)
        return reply

    def _adopt(self, request: p.AdoptSessionRequest) -> p.Response:
        """Re-create a lost session on a node Ray places it on, from its last exported snapshot."""
        row = self.db.row("SELECT node, state FROM sessions WHERE session_id = ?", [request.session_id])
        if row is None:
            raise UnknownSession(request.session_id)
        if row["state"] != "lost":
            raise SandboxUnavailable(f"session {request.session_id} is {row['state']}, not lost: nothing to re-create",
                                     session_id=request.session_id, state=row["state"])
        group, node_id = self._place()
        try:
            answer = ray.get(self.actors[node_id].adopt.remote(request.session_id), timeout=600)
        except Exception as exc:
            remove_placement_group(group)
            raise SandboxUnavailable(f"re-creating {request.session_id} on {node_id} failed: {exc}",
                                     session_id=request.session_id) from exc
        reply = msgspec.convert({**answer, "request_id": request.request_id}, p.Response)
        if isinstance(reply, p.AdoptSessionResponse):
            self.placements.keep(request.session_id, group)
        else:
            remove_placement_group(group)
        return reply

    def _fork(self, request: p.ForkRequest) -> p.Response:
        """The fork's bundle reserved on its parent's node first, then the fork made there."""
        node_id = self.node_of(request)
        assert node_id is not None  # a ForkRequest names its session
        group, _ = self._place(on=node_id)
        return self._holding(group, node_id, request)

    def _place(self, on: str | None = None) -> tuple[PlacementGroup, str]:
        """A placement group holding one sandbox's resources, on the node Ray chose (or `on`), which has a daemon."""
        group, node_id = self.placements.reserve(on)
        if node_id not in self.nodes or node_id in self.lost:
            remove_placement_group(group)
            raise SandboxUnavailable(f"Ray placed the session on node {node_id}, which has no daemon")
        return group, node_id

    def _list(self, request: p.ListSessionsRequest, peer: Peer) -> p.Response:
        sessions: list[p.SessionInfo] = []
        for node_id in sorted(set(self.nodes) - self.lost):
            reply = self.forward(node_id, request)
            if isinstance(reply, p.ErrorResponse):
                return reply
            assert isinstance(reply, p.ListSessionsResponse)
            sessions += [s for s in reply.sessions if peer.operator or s.owner == peer.key]
        sessions.sort(key=lambda s: s.created_at)
        return p.ListSessionsResponse(request_id=request.request_id, sessions=sessions)

    def wait_events(self, request: p.WaitEventsRequest, peer: Peer) -> p.Response | None:
        try:
            self._authorize(request, peer)
            node_id = self.node_of(request)
            now = msgspec.structs.replace(request, timeout_s=0)
            reply = self.forward(node_id or self._any_node(), now)
        except SandboxdError as exc:
            reply = p.error_response(request.request_id, exc)
        with self.events.lock:
            if isinstance(reply, p.WaitEventsResponse) and not reply.events and request.timeout_s > 0:
                self.events.epochs[request.request_id] = reply.epoch
                self.events.sessions.add(request.session_id)
                return None
            self.events.epochs.pop(request.request_id, None)
        return reply

    def no_events(self, request: p.WaitEventsRequest) -> p.Response:
        with self.events.lock:
            epoch = self.events.epochs.pop(request.request_id, "")
        return p.WaitEventsResponse(request_id=request.request_id, epoch=epoch, events=[])


def serve(ray_address: str, spec: NodeSpec, endpoint: str, door_dir: str, cpus: float = 0.5,
          memory_mb: int = 512, ready: Callable[[Fleet], None] | None = None, door_config: str = "") -> None:
    """`sandboxd fleet serve`: join the Ray cluster, start a daemon per node, serve until SIGTERM/SIGINT
    (or until `ready`'s caller stops the returned server: tests run the door in a thread).

    `door_config`: the door's own TOML (its [auth], for a tcp:// `endpoint`); the nodes read `spec.config`.
    Bad input (a spec `NodeSpec.check` refuses, a bad key file or configuration) raises ValueError before
    anything starts."""
    import signal

    from sandboxd.auth import ServerKeys
    from sandboxd.config import load_config
    from sandboxd.server import Server

    spec.check()
    if spec.keys_dir:
        FleetKeys.ensure(Path(spec.keys_dir))
    config = load_config(Path(door_config) if door_config else None, state_dir=door_dir, endpoint=endpoint)
    keys = ServerKeys.load(config.auth) if config.endpoint.startswith("tcp://") else None
    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    fleet = Fleet(spec, cpus=cpus, memory_mb=memory_mb)
    fleet.start()
    server = Server(config, fleet, keys)
    fleet.server = server  # type: ignore[attr-defined]
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
    if ready is not None:
        ready(fleet)
    try:
        server.serve_forever()
    finally:
        fleet.stop()
