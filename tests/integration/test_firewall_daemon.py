"""External tools through a live daemon: real SMTP and HTTP sinks count what actually arrived."""

from __future__ import annotations

import email
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxd import protocol as p
from sandboxd.client import Client, DaemonUnreachable, RemoteError
from sandboxd.launcher import DaemonProcess
from tests.sinks import HttpSink, MailSink

pytestmark = pytest.mark.docker


class SlowSmtpSink(MailSink):
    """An SMTP sink that records each message, then takes `delay` seconds to say 250."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.in_data = threading.Event()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        reply = await super().handle_DATA(server, session, envelope)
        self.in_data.set()
        time.sleep(self.delay)  # blocks the sink's loop on purpose: the daemon waits on a slow relay
        self.in_data.clear()
        return reply

    def message_ids(self) -> list[str]:
        with self._lock:
            return [email.message_from_bytes(m[2])["Message-ID"].strip("<>").split("@")[0] for m in self.envelopes]


@pytest.fixture
def smtp() -> Iterator[SlowSmtpSink]:
    sink = SlowSmtpSink()
    yield sink
    sink.close()



def config(tmp: Path, smtp: MailSink, http: HttpSink, release: dict[str, str] | None = None) -> list[str]:
    lines = [
        "[firewall]", "adapter_timeout_s = 1.0",
        "[firewall.smtp]", 'host = "127.0.0.1"', f"port = {smtp.port}",
        "[firewall.http]", f'allowlist = ["127.0.0.1:{http.port}"]',
        "[firewall.webhook]", f'url = "{http.url("/hook")}"',
    ]
    if release:
        lines.append("[firewall.release]")
        lines += [f'{tool} = "{policy}"' for tool, policy in release.items()]
    path = tmp / "sandboxd.toml"
    path.write_text("\n".join(lines) + "\n")
    return ["--config", str(path)]


def mail(i: int, to: str = "ops@example.test") -> dict[str, Any]:
    return {"to": [to], "subject": f"report {i}", "body": f"body of message {i}"}


@pytest.fixture
def firewalled(daemon_factory: Callable[..., DaemonProcess], smtp: SlowSmtpSink, http: HttpSink,
               tmp_path: Path) -> Callable[..., DaemonProcess]:
    def make(release: dict[str, str] | None = None) -> DaemonProcess:
        return daemon_factory(config(tmp_path, smtp, http, release))
    return make


def test_external_tools_are_listed_with_their_intent_fields(firewalled: Callable[..., DaemonProcess]) -> None:
    client = firewalled().client()
    tools = {t.name: t for t in client.tools()}
    assert tools["send_email"].effect == "external"
    assert tools["http_request"].effect == "external" and tools["webhook"].effect == "external"
    assert tools["http_get"].effect == "read"
    assert set(tools["send_email"].intent_fields) >= {"to", "subject", "body"}


def test_distinct_sends_deliver_once_each_and_retries_never_twice(firewalled: Callable[..., DaemonProcess],
                                                                 smtp: SlowSmtpSink, http: HttpSink) -> None:
    client = firewalled().client()
    sid = client.open_session().session_id
    for i in range(5):
        assert client.call(sid, "send_email", mail(i), call_id=f"m{i}").state == "done"
    assert smtp.count == 5
    again = client.call(sid, "send_email", mail(3), call_id="m3")
    assert again.deduplicated and again.state == "done" and smtp.count == 5
    # Two identical sends without a call id are two intended messages (occurrence 0 and 1).
    client.call(sid, "send_email", mail(9))
    client.call(sid, "send_email", mail(9))
    assert smtp.count == 7
    with pytest.raises(RemoteError) as err:
        client.call(sid, "send_email", mail(4, to="other@example.test"), call_id="m4")
    assert err.value.wire_code == "call_id_conflict" and smtp.count == 7
    posted = client.call(sid, "http_request", {"method": "POST", "url": http.url("/pay"), "body": "10"})
    assert posted.data is not None and posted.data["status"] == 200 and http.count == 1
    ledger = [c for c in client.calls(sid) if c.effect == "external"]
    assert len(ledger) == 8 and all(c.state == "done" for c in ledger)


def open_replay(client: Client, sid: str) -> p.BeginRevocationResponse:
    """A replay branch as the daemon opens one: a recorded observation is revoked, and the revocation taken."""
    client.checkpoint(sid, p.CheckpointRecord(checkpoint_id="cp-0", step=0, turn=0, token_offset=0, cache_handle="c",
                                              reason="turn"), snapshot=False)
    client.record_artifacts(sid, [p.Artifact(artifact_id="call-1-0", type="tool_call"),
                                  p.Artifact(artifact_id="obs-1", type="observation", parents=["call-1-0"], step=1,
                                             content="a page to forget")])
    return client.begin_revocation(client.revoke(sid, "obs-1").revocation.revocation_id)


def test_shadow_replay_never_fires_and_reports_orphans(firewalled: Callable[..., DaemonProcess],
                                                       smtp: SlowSmtpSink) -> None:
    client = firewalled().client()
    sid = client.open_session().session_id
    kept = client.call(sid, "send_email", mail(1))
    gone = client.call(sid, "send_email", mail(3))
    with pytest.raises(RemoteError) as err:
        client.call(sid, "send_email", mail(1), mode="shadow")
    assert err.value.wire_code == "invalid_state"  # shadow calls belong to a replay branch
    plan = open_replay(client, sid)
    replayed = client.call(sid, "send_email", mail(1), mode="shadow", branch=plan.branch)
    assert replayed.deduplicated and replayed.call_id == kept.call_id and smtp.count == 2
    new = client.call(sid, "send_email", mail(2), mode="shadow", branch=plan.branch)
    assert new.shadowed and new.state == "staged" and smtp.count == 2
    report = client.commit_revocation(p.CommitRevocationRequest(
        request_id="r", revocation_id=plan.revocation_id, tokens=p.TokenCounts(), transitions_replayed=1,
        final_step=1))
    assert (report.calls["orphaned"], report.calls["staged"]) == (1, 1)
    assert any(gone.call_id in line and "orphaned" in line for line in report.not_erased)
    assert [c.state for c in client.calls(sid) if c.call_id == new.call_id] == ["staged"]
    assert smtp.count == 2


def test_on_commit_effects_wait_for_the_commit(firewalled: Callable[..., DaemonProcess], smtp: SlowSmtpSink) -> None:
    client = firewalled({"send_email": "on_commit"}).client()
    sid = client.open_session().session_id
    held = client.call(sid, "send_email", mail(1), turn=1)
    assert held.held and smtp.count == 0
    assert [h.call_id for h in client.outbox(sid)] == [held.call_id]
    [released] = client.commit_turn(sid, 1)
    assert released.state == "done" and smtp.count == 1
    client.call(sid, "send_email", mail(2), turn=2)
    assert len(client.drop_turn(sid, 2)) == 1
    assert client.commit_turn(sid, 2) == [] and smtp.count == 1
    client.call(sid, "send_email", mail(3), turn=3)
    client.close_session(sid)  # its turn can never commit now
    assert client.outbox(sid) == [] and smtp.count == 1


def test_manual_release_and_drop(firewalled: Callable[..., DaemonProcess], smtp: SlowSmtpSink) -> None:
    client = firewalled({"send_email": "manual"}).client()
    sid = client.open_session().session_id
    first = client.call(sid, "send_email", mail(1))
    second = client.call(sid, "send_email", mail(2))
    assert smtp.count == 0 and len(client.outbox()) == 2
    assert client.release(first.call_id).state == "done" and smtp.count == 1
    client.drop(second.call_id)
    with pytest.raises(RemoteError) as err:
        client.release(second.call_id)
    assert err.value.wire_code == "invalid_state" and smtp.count == 1


def test_an_open_replays_hold_waits_for_the_replay(firewalled: Callable[..., DaemonProcess],
                                                  smtp: SlowSmtpSink) -> None:
    client = firewalled({"send_email": "manual"}).client()
    sid = client.open_session().session_id
    branch = open_replay(client, sid).branch
    new = client.call(sid, "send_email", mail(1), mode="shadow", turn=1, branch=branch)
    assert new.held and [h.replay for h in client.outbox(sid)] == [branch]
    with pytest.raises(RemoteError) as err:
        client.release(new.call_id)
    assert err.value.wire_code == "invalid_state" and "still open" in str(err.value) and smtp.count == 0
    client.close_session(sid)  # the replay can never be committed now: what it held goes with it
    assert client.outbox(sid) == [] and smtp.count == 0
    assert [c.state for c in client.calls(sid) if c.call_id == new.call_id] == ["dropped"]


def test_bad_external_input_is_refused_cleanly(firewalled: Callable[..., DaemonProcess], http: HttpSink,
                                               smtp: SlowSmtpSink) -> None:
    client = firewalled().client()
    sid = client.open_session().session_id
    cases = [
        ("http_request", {"method": "POST", "url": "http://203.0.113.9/x", "body": ""}, "host_not_allowed"),
        ("send_email", {"to": ["not an address"], "subject": "s", "body": "b"}, "invalid_arguments"),
        ("http_request", {"method": "POST", "url": http.url("/slow"), "body": "x"}, "adapter_timeout"),
    ]
    for tool, args, code in cases:
        with pytest.raises(RemoteError) as err:
            client.call(sid, tool, args)
        assert err.value.wire_code == code, (tool, err.value)
    states = {c.tool: c.state for c in client.calls(sid) if c.effect == "external"}
    assert states == {"http_request": "unknown"}  # the slow POST was sent: it may have happened
    assert smtp.count == 0
    assert client.call(sid, "shell", {"command": "echo serving"}).stdout == "serving\n"


def test_sigkill_storm_never_delivers_twice(firewalled: Callable[..., DaemonProcess], smtp: SlowSmtpSink) -> None:
    """200 sends while the daemon is SIGKILLed at random moments (and twice mid-delivery) and restarted."""
    smtp.delay = 0.02
    daemon = firewalled()
    sid = daemon.client().open_session().session_id
    rng = random.Random(20261202)
    done = threading.Event()
    unknown: set[str] = set()

    def driver() -> None:
        client = Client(daemon.endpoint, timeout_s=3)
        i = 0
        while i < 200:
            try:
                client.call(sid, "send_email", mail(i), call_id=f"mail-{i}")
                i += 1
            except RemoteError as exc:
                assert exc.wire_code == "call_unknown", exc
                unknown.add(f"mail-{i}")
                i += 1
            except DaemonUnreachable:
                client.close()
                time.sleep(0.1)  # the daemon is down or restarting: retry the same call id
        client.close()
        done.set()

    thread = threading.Thread(target=driver)
    thread.start()
    kills = 0
    while not done.is_set() and kills < 10:
        if kills < 2:
            smtp.in_data.wait(10)  # a kill while a message is in the relay's hands
        else:
            time.sleep(rng.uniform(0.1, 0.5))
        if done.is_set():
            break
        daemon.restart()
        kills += 1
    thread.join(timeout=300)
    assert done.is_set() and kills >= 2

    client = daemon.client()
    delivered = smtp.message_ids()
    ledger = {c.call_id: c for c in client.calls(sid) if c.effect == "external"}
    assert len(delivered) == len(set(delivered)), "a message was delivered twice"
    cut = {cid for cid, c in ledger.items() if c.state == "unknown"}
    assert cut and len(cut) >= len(unknown)
    # The operator settles each cut call by looking at the relay, then the agent's retry goes through.
    for call_id in cut:
        client.resolve(call_id, "done" if call_id in delivered else "failed")
    for i in range(200):
        client.call(sid, "send_email", mail(i), call_id=f"mail-{i}")
    delivered = smtp.message_ids()
    assert len(delivered) == 200 == len(set(delivered))
    ledger = {c.call_id: c for c in client.calls(sid) if c.effect == "external"}
    assert set(delivered) == set(ledger) and all(c.state == "done" for c in ledger.values())
