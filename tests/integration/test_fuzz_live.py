"""A live fuzz run: over ten thousand random and mutated frames, with valid requests interleaved, against
a real daemon through a raw DEALER socket.

Every frame must get exactly one reply: an error reply with the code the local decoder gives, or a valid
reply of the request's own type. Bookkeeping follows the replies, not the intentions: a mutated frame
that still decodes is a valid request, so whatever its reply acknowledges (a file written, a snapshot
taken or deleted, a session opened or closed) is applied to the expected state, and whatever got an
error reply must have changed nothing. At the end the daemon's sessions, files and snapshots must be
exactly the expected ones.
"""

from __future__ import annotations

import posixpath
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq

from sandboxd import protocol as p
from sandboxd.errors import ErrorCode, ProtocolError
from sandboxd.tools.registry import WORKSPACE
from tests.integration.conftest import DaemonProcess
from tests.unit.test_protocol import SAMPLES

pytestmark = pytest.mark.docker

SEED = 20240611
FUZZ_FRAMES = 10_000
REPLY_TIMEOUT_MS = 60_000
MAX_SESSIONS = 3
NAMES = ["a.txt", "b.txt", "d/c.txt", "d/e/f.txt", "sp ace.txt", "ünï.txt", "x"]
ALPHABET = "abcxyz019 \n\t-é€\u2028"
WIRE_CODES = {code.value for code in ErrorCode}
INLINE_REQUESTS = [m for m in SAMPLES if type(m).__name__ in p.REQUEST_TYPES]


@dataclass
class Expected:
    """What the daemon has acknowledged: open sessions, their files, their snapshots and those trees."""

    files: dict[str, dict[str, str]] = field(default_factory=dict)
    snapshots: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

    def apply(self, req: Any, reply: Any) -> None:
        """Apply an acknowledged request to the expected state; error replies change nothing."""
        if isinstance(reply, p.ErrorResponse):
            return
        if isinstance(reply, p.OpenSessionResponse):
            self.files[reply.session.session_id] = {}
            self.snapshots[reply.session.session_id] = {}
        elif isinstance(reply, p.CloseSessionResponse):
            del self.files[reply.session_id]
            del self.snapshots[reply.session_id]
        elif isinstance(reply, p.CallResponse) and req.tool == "write_file" and not reply.result.replayed:
            tree = self.files[req.session_id]
            name = workspace_relative(req.args["path"])
            old = tree.get(name, "") if req.args.get("append") else ""
            tree[name] = old + req.args["content"]
        elif isinstance(reply, p.SnapshotResponse):
            self.snapshots[req.session_id][reply.snapshot.snapshot_id] = dict(self.files[req.session_id])
        elif isinstance(reply, p.RestoreResponse):
            self.files[req.session_id] = dict(self.snapshots[req.session_id][req.snapshot_id])
        elif isinstance(reply, p.DeleteSnapshotResponse):
            del self.snapshots[req.session_id][req.snapshot_id]


def workspace_relative(path: str) -> str:
    joined = path if path.startswith("/") else posixpath.join(WORKSPACE, path)
    return posixpath.relpath(posixpath.normpath(joined), WORKSPACE)


class RawPeer:
    """A DEALER socket that sends one frame and waits for its one reply (lockstep)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def exchange(self, frame: bytes) -> Any:
        self.sock.send(frame)
        if not self.sock.poll(REPLY_TIMEOUT_MS):
            raise AssertionError(f"no reply within {REPLY_TIMEOUT_MS} ms to frame {frame[:200]!r}")
        parts = self.sock.recv_multipart()
        assert len(parts) == 1, parts
        return p.decode_response(parts[0], max_frame=1 << 31)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def peer(daemon: DaemonProcess) -> Iterator[RawPeer]:
    made = RawPeer(daemon.endpoint)
    yield made
    made.close()


class Fuzzer:
    """Seeded frame generator; templates follow the live state so mutants can hit real sessions."""

    def __init__(self, rng: random.Random, expected: Expected) -> None:
        self.rng = rng
        self.expected = expected

    def rid(self) -> str:
        return f"r-{self.rng.getrandbits(48):012x}"

    def text(self, n: int = 12) -> str:
        return "".join(self.rng.choice(ALPHABET) for _ in range(self.rng.randint(0, n)))

    def session(self) -> str | None:
        return self.rng.choice(sorted(self.expected.files)) if self.expected.files else None

    def snapshot(self, sid: str) -> str | None:
        snaps = sorted(self.expected.snapshots[sid])
        return self.rng.choice(snaps) if snaps else None

    # Valid requests --------------------------------------------------------------------------

    def valid(self) -> Any:
        rng, sid = self.rng, self.session()
        if sid is None or (len(self.expected.files) < MAX_SESSIONS and rng.random() < 0.02):
            return p.OpenSessionRequest(request_id=self.rid())
        roll = rng.random()
        snap = self.snapshot(sid)
        if roll < 0.55:
            return self.write(sid)
        if roll < 0.70:
            return p.SnapshotRequest(request_id=self.rid(), session_id=sid, label=self.text(5) or None)
        if roll < 0.78 and snap:
            return p.RestoreRequest(request_id=self.rid(), session_id=sid, snapshot_id=snap)
        if roll < 0.82 and snap:
            return p.DeleteSnapshotRequest(request_id=self.rid(), session_id=sid, snapshot_id=snap)
        if roll < 0.83 and len(self.expected.files) > 1:
            return p.CloseSessionRequest(request_id=self.rid(), session_id=sid)
        return rng.choice([p.HealthRequest(request_id=self.rid()), p.ListSessionsRequest(request_id=self.rid()),
                           p.ListSnapshotsRequest(request_id=self.rid(), session_id=sid),
                           p.CallRequest(request_id=self.rid(), session_id=sid, tool="list_dir",
                                         args={"recursive": True})])

    def write(self, sid: str) -> p.CallRequest:
        args: dict[str, Any] = {"path": self.rng.choice(NAMES), "content": self.text(40)}
        if self.rng.random() < 0.3:
            args["append"] = True
        return p.CallRequest(request_id=self.rid(), session_id=sid, tool="write_file", args=args, timeout_s=5.0)

    # Templates to mutate ---------------------------------------------------------------------

    def template(self) -> Any:
        rng, sid = self.rng, self.session()
        if sid is None or rng.random() < 0.3:
            return rng.choice(INLINE_REQUESTS)  # every request type, aimed at ids that do not exist
        snap = self.snapshot(sid)
        choices: list[Callable[[], Any]] = [
            lambda: self.write(sid),
            lambda: self.write(sid),
            lambda: p.CallRequest(request_id=self.rid(), session_id=sid, tool="read_file",
                                  args={"path": rng.choice(NAMES)}, timeout_s=2.0),
            lambda: p.SnapshotRequest(request_id=self.rid(), session_id=sid, label="m"),
            lambda: p.ListSnapshotsRequest(request_id=self.rid(), session_id=sid),
            lambda: p.OpenSessionRequest(request_id=self.rid(), image="sandboxd-missing:none"),
        ]
        if snap:
            choices.append(lambda: p.RestoreRequest(request_id=self.rid(), session_id=sid, snapshot_id=snap))
            if rng.random() < 0.2:
                choices.append(lambda: p.DeleteSnapshotRequest(request_id=self.rid(), session_id=sid,
                                                               snapshot_id=snap))
        if rng.random() < 0.01 and len(self.expected.files) > 1:
            choices.append(lambda: p.CloseSessionRequest(request_id=self.rid(), session_id=sid))
        return rng.choice(choices)()

    # Garbage -----------------------------------------------------------------------------------

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(-1000, 1000)])
        if kind == 3:
            return rng.choice([0.0, -0.0, float("nan"), float("inf"), 1e308, rng.uniform(-1e6, 1e6)])
        if kind == 4:
            return self.text(20)
        if kind == 5:
            return rng.randbytes(rng.randint(0, 16))
        if kind == 6:
            return [self.value(depth + 1) for _ in range(rng.randint(0, 4))]
        keys = [self.text(6), rng.choice(["type", "request_id", "session_id", "args", "tool"]), rng.randint(-3, 3)]
        return {rng.choice(keys): self.value(depth + 1) for _ in range(rng.randint(0, 4))}

    def mutate_bytes(self, frame: bytes) -> bytes:
        rng, data = self.rng, bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data)) if data else 0
            op = rng.randrange(5)
            if op == 0 and data:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1 and data:
                data[at] = rng.randrange(256)
            elif op == 2:
                data[at:at] = rng.randbytes(rng.randint(1, 6))
            elif op == 3 and data:
                del data[at:at + rng.randint(1, 6)]
            elif op == 4:
                del data[at:]
        return bytes(data)

    def mutate_fields(self, message: Any) -> bytes:
        rng = self.rng
        raw: dict[Any, Any] = msgspec.msgpack.decode(p.encode(message))
        for _ in range(rng.randint(1, 3)):
            keys = sorted(raw, key=str)
            op = rng.randrange(4)
            if op == 0 and keys:
                del raw[rng.choice(keys)]
            elif op == 1 and keys:
                raw[rng.choice(keys)] = self.value()
            elif op == 2:
                # Never `forget`: a session that forgets random text would excise it from the checks below.
                raw[rng.choice([self.text(6) or "x", "admin", "force", "image", "args", "label"])] = self.value()
            else:
                raw["type"] = rng.choice(sorted(p.REQUEST_TYPES))
        return msgspec.msgpack.encode(raw)

    def garbage(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 100, 1000]))
        if roll < 0.40:
            return msgspec.msgpack.encode(self.value())
        if roll < 0.70:
            return self.mutate_bytes(p.encode(self.template()))
        if roll < 0.97:
            return self.mutate_fields(self.template())
        if roll < 0.99:
            return b"\x81\xa4args" + b"\x91" * rng.choice([500, 5_000, 500_000]) + b"\xc0"  # deep nesting
        return msgspec.msgpack.encode({"type": "HealthRequest", "request_id": "big", "pad": "x" * (9 << 20)})


def check_reply(frame: bytes, reply: Any) -> Any:
    """The reply fits the frame: the local decoder's code for a bad frame, the request's own reply type else."""
    try:
        req = p.decode_request(frame)
    except ProtocolError as exc:
        assert isinstance(reply, p.ErrorResponse), (frame[:200], reply)
        assert reply.code == exc.code.value, (frame[:200], reply, exc)
        assert reply.request_id == p.request_id_of(frame)
        return None
    assert reply.request_id == req.request_id, (req, reply)
    if isinstance(reply, p.ErrorResponse):
        assert reply.code in WIRE_CODES and reply.code != ErrorCode.INTERNAL.value, (req, reply)
    else:
        assert type(reply).__name__ == type(req).__name__.replace("Request", "Response"), (req, reply)
    return req


def test_ten_thousand_frames_leave_exactly_the_acknowledged_state(daemon: DaemonProcess, peer: RawPeer) -> None:
    rng = random.Random(SEED)
    expected = Expected()
    fuzz = Fuzzer(rng, expected)
    counts: dict[str, int] = {}
    accepted: dict[str, int] = {}
    started = time.monotonic()
    sent = valid_sent = 0
    while sent < FUZZ_FRAMES:
        mutant = not (rng.random() < 0.04 or not expected.files)
        if mutant:
            frame, sent = fuzz.garbage(), sent + 1
        else:
            frame, valid_sent = p.encode(fuzz.valid()), valid_sent + 1
        reply = peer.exchange(frame)
        req = check_reply(frame, reply)
        expected.apply(req, reply)
        key = reply.code if isinstance(reply, p.ErrorResponse) else "ok"
        counts[key] = counts.get(key, 0) + 1
        if mutant and key == "ok":
            accepted[type(reply).__name__] = accepted.get(type(reply).__name__, 0) + 1
    elapsed = time.monotonic() - started
    print(f"{sent} fuzz + {valid_sent} valid frames in {elapsed:.1f} s; replies: {sorted(counts.items())}; "
          f"mutants accepted: {sorted(accepted.items())}; final: {len(expected.files)} sessions, "
          f"{sum(map(len, expected.files.values()))} files, {sum(map(len, expected.snapshots.values()))} snapshots")
    assert sum(accepted.values()) > 0  # some mutants were still valid requests and were applied
    assert {"bad_frame", "unknown_type", "invalid_field", "frame_too_large"} <= set(counts)
    assert elapsed < 120, f"the fuzz run took {elapsed:.0f} s"

    verify_state(peer, expected)


def verify_state(peer: RawPeer, expected: Expected) -> None:
    """The daemon still answers and its sessions, files and snapshots are exactly the acknowledged ones."""
    def ask(message: Any) -> Any:
        reply = peer.exchange(p.encode(message))
        assert not isinstance(reply, p.ErrorResponse), (message, reply)
        return reply

    rid = lambda: uuid.uuid4().hex  # noqa: E731
    health = ask(p.HealthRequest(request_id=rid()))
    assert health.open_sessions == len(expected.files)
    listed = ask(p.ListSessionsRequest(request_id=rid())).sessions
    assert sorted(s.session_id for s in listed) == sorted(expected.files)
    for sid, tree in expected.files.items():
        snaps = ask(p.ListSnapshotsRequest(request_id=rid(), session_id=sid)).snapshots
        assert sorted(s.snapshot_id for s in snaps) == sorted(expected.snapshots[sid]), sid
        assert_tree(ask, sid, tree)
        # An acknowledged snapshot still restores to the tree it was taken of.
        for snap_id, snap_tree in sorted(expected.snapshots[sid].items())[-2:]:
            ask(p.RestoreRequest(request_id=rid(), session_id=sid, snapshot_id=snap_id))
            assert_tree(ask, sid, snap_tree)


def assert_tree(ask: Callable[[Any], Any], sid: str, tree: dict[str, str]) -> None:
    listing = ask(p.CallRequest(request_id=uuid.uuid4().hex, session_id=sid, tool="list_dir",
                                args={"recursive": True})).result.stdout
    rows = [msgspec.json.decode(line) for line in listing.splitlines()]
    assert sorted(r["path"] for r in rows if r["type"] == "file") == sorted(tree), sid
    for name, content in tree.items():
        got = ask(p.CallRequest(request_id=uuid.uuid4().hex, session_id=sid, tool="read_file",
                                args={"path": name})).result.stdout
        assert got == content, (sid, name)
