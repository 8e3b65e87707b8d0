"""Malformed input against a live daemon: each kind gets its error reply and the daemon keeps serving."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from sandboxd import protocol as p
from sandboxd.client import Client
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.docker


def test_malformed_frames_get_error_replies_and_change_nothing(daemon: DaemonProcess, client: Client) -> None:
    session = client.open_session().session_id
    client.call(session, "write_file", {"path": "f", "content": "before"})
    cases = [
        (b"\x93\x01", "bad_frame"),
        (msgspec.msgpack.encode({"type": "Bogus", "request_id": "r1"}), "unknown_type"),
        (msgspec.msgpack.encode({"type": "CallRequest", "request_id": "r2", "session_id": session,
                                 "tool": "write_file"}), "invalid_field"),
        (msgspec.msgpack.encode({"type": "CloseSessionRequest", "request_id": "r3", "session_id": session,
                                 "force": True}), "invalid_field"),
        (msgspec.msgpack.encode({"type": "CallRequest", "request_id": "r4", "session_id": session,
                                 "tool": "write_file", "args": {"path": "f", "content": "x" * (9 << 20)}}),
         "frame_too_large"),
    ]
    for frame, code in cases:
        reply = client.send_raw(frame)
        assert isinstance(reply, p.ErrorResponse) and reply.code == code, (code, reply)
    assert [s.session_id for s in client.sessions()] == [session]
    assert client.call(session, "read_file", {"path": "f"}).stdout == "before"


@pytest.mark.parametrize("image", ["no-such-image:latest", "\u00e9-9\nzz19\n-\u20acy\u2028x0", "a/../../b?c#d",
                                   "x" * 300])
def test_an_image_that_is_missing_or_no_reference_is_not_found(client: Client, image: str) -> None:
    # A newline in the name once reached the engine's URL router and came back as a bare 404: internal.
    before = client.sessions()
    reply = client.send_raw(p.encode(p.OpenSessionRequest(request_id="img", image=image)))
    assert isinstance(reply, p.ErrorResponse) and reply.code == "not_found", reply
    assert client.sessions() == before


def test_error_reply_echoes_the_request_id(client: Client) -> None:
    reply = client.send_raw(msgspec.msgpack.encode({"type": "Bogus", "request_id": "echo-me"}))
    assert reply.request_id == "echo-me"


def test_multi_part_request_is_refused(daemon: DaemonProcess, client: Client) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        sock.send_multipart([b"extra", b"frames", p.encode(p.HealthRequest(request_id="m"))])
        assert sock.poll(10_000)
        reply = p.decode_response(sock.recv_multipart()[-1])
        assert isinstance(reply, p.ErrorResponse) and reply.code == "bad_frame"
    finally:
        sock.close()
    assert client.health().protocol == p.PROTOCOL_VERSION


def test_concurrent_sessions_are_served_in_parallel(daemon: DaemonProcess) -> None:
    import threading
    import time

    first, second = daemon.client(), daemon.client()
    a = first.open_session().session_id
    b = second.open_session().session_id
    slow_done: list[float] = []

    def slow() -> None:
        first.call(a, "shell", {"command": "sleep 2"})
        slow_done.append(time.monotonic())

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)
    assert second.call(b, "shell", {"command": "echo quick"}).stdout == "quick\n"
    quick_done = time.monotonic()
    thread.join()
    assert slow_done and quick_done < slow_done[0]
