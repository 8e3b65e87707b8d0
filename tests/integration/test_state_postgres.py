"""Two real daemons on one PostgreSQL database (a server the test set-up starts) and a real SMTP sink.

Exactly-once across nodes: the agent's retries of the same sends go to either daemon, concurrently; the
sink receives each intent once. A daemon killed mid-send leaves its call in flight: the other daemon
finds no live owner for it and refuses it as `unknown` instead of sending it again. Sessions' sandbox
calls, whose records no longer wait for other sessions' (`Database.transaction(session=...)`), run on
both daemons meanwhile: each session's records are numbered without a gap, and the sends stay once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sandboxd.client import RemoteError
from sandboxd.errors import ErrorCode
from sandboxd.launcher import DaemonProcess
from tests.integration.test_firewall_daemon import SlowSmtpSink, mail

pytestmark = pytest.mark.docker


@pytest.fixture
def smtp() -> Iterator[SlowSmtpSink]:
    sink = SlowSmtpSink(delay=0.2)
    yield sink
    sink.close()


@pytest.fixture
def two_daemons(daemon_factory: Callable[..., DaemonProcess], smtp: SlowSmtpSink, pg_url: str,
                tmp_path: Path) -> tuple[DaemonProcess, DaemonProcess]:
    config = tmp_path / "sandboxd.toml"
    config.write_text(f'[firewall]\nadapter_timeout_s = 10.0\n'
                      f'[firewall.smtp]\nhost = "127.0.0.1"\nport = {smtp.port}\n')
    args = ["--config", str(config), "--state", pg_url]
    return daemon_factory([*args, "--node-id", "node-a"]), daemon_factory([*args, "--node-id", "node-b"])


def test_two_daemons_on_one_database_send_each_intent_once(two_daemons: tuple[DaemonProcess, DaemonProcess],
                                                           smtp: SlowSmtpSink) -> None:
    a, b = two_daemons
    session = a.client().open_session().session_id
    assert session not in {s.session_id for s in b.client().sessions()}  # each daemon lists its own
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()

    def send(daemon: DaemonProcess, i: int) -> None:
        client = daemon.client()
        try:  # the agent's retries of send m<i>, to whichever daemon
            outcome = client.call(session, "send_email", mail(i % 5), call_id=f"m{i % 5}").state
        except RemoteError as error:
            outcome = error.code.value
        with lock:
            outcomes.append((f"m{i % 5}", outcome))

    threads = [threading.Thread(target=send, args=(a if i % 2 else b, i)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert smtp.count == 5, outcomes
    # Every reply is the one result, or "being fired right now" by the other daemon: never a second send.
    assert {o for _, o in outcomes} <= {"done", ErrorCode.INVALID_STATE.value}
    for i in range(5):
        assert a.client().call(session, "send_email", mail(i), call_id=f"m{i}").state == "done"
        assert b.client().call(session, "send_email", mail(i), call_id=f"m{i}").state == "done"
    assert smtp.count == 5


def test_a_daemon_killed_mid_send_leaves_an_unknown_call_the_other_never_resends(
        two_daemons: tuple[DaemonProcess, DaemonProcess], smtp: SlowSmtpSink) -> None:
    a, b = two_daemons
    smtp.delay = 5.0
    session = a.client().open_session().session_id
    errors: list[Any] = []

    def send() -> None:
        try:
            a.client(timeout_s=30).call(session, "send_email", mail(7), call_id="m7")
        except Exception as exc:  # the daemon dies under it
            errors.append(exc)

    worker = threading.Thread(target=send)
    worker.start()
    deadline = time.monotonic() + 30
    while not smtp.in_data.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert smtp.in_data.is_set(), "the send never reached the sink"
    a.kill()  # mid-send: the message is with the relay, the reply never came back
    worker.join(60)
    with pytest.raises(RemoteError) as refused:
        b.client().call(session, "send_email", mail(7), call_id="m7")
    assert refused.value.code == ErrorCode.CALL_UNKNOWN
    assert smtp.count == 1


def test_sessions_calls_on_both_daemons_run_beside_racing_sends(two_daemons: tuple[DaemonProcess, DaemonProcess],
                                                                 smtp: SlowSmtpSink, pg_url: str) -> None:
    a, b = two_daemons
    smtp.delay = 0.0
    sessions = [(daemon, daemon.client().open_session().session_id) for daemon in (a, a, b, b)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def work(daemon: DaemonProcess, sid: str) -> None:
        client = daemon.client()
        for i in range(8):
            client.call(sid, "write_file", {"path": f"f{i}.txt", "content": f"{sid} {i}"}, call_id=f"w{i}")

    def send(daemon: DaemonProcess, i: int) -> None:
        try:  # the agent's retries of send m<i> of the first session, to whichever daemon
            outcome = daemon.client().call(sessions[0][1], "send_email", mail(i % 4), call_id=f"m{i % 4}").state
        except RemoteError as error:
            outcome = error.code.value
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=work, args=pair) for pair in sessions]
    threads += [threading.Thread(target=send, args=(a if i % 2 else b, i)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert smtp.count == 4, outcomes
    assert set(outcomes) <= {"done", ErrorCode.INVALID_STATE.value}
    with psycopg.connect(pg_url) as state:
        for _, sid in sessions:
            rows = state.execute("SELECT seq, status FROM calls WHERE session_id = %s ORDER BY seq", [sid]).fetchall()
            assert rows == [(i, "done") for i in range(1, 9)], sid
    daemon, sid = sessions[2]
    again = daemon.client().call(sid, "write_file", {"path": "f3.txt", "content": f"{sid} 3"}, call_id="w3")
    assert again.replayed  # answered from its record, not run again
