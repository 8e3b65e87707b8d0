"""The side-effect firewall against real servers: an aiosmtpd sink and a ThreadingHTTPServer on 127.0.0.1.

Every count below is what the servers actually received, not what the firewall claims it sent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxd.db import Database
from sandboxd.errors import (
    AdapterTimeout,
    CallIdConflict,
    CallUnknown,
    EffectFailed,
    ErrorCode,
    HostNotAllowed,
    InvalidArguments,
    InvalidState,
)
from sandboxd.firewall import Firewall, parse_config
from tests.sinks import HttpSink, MailSink, free_port

REPO = Path(__file__).resolve().parents[2]





MakeFirewall = Callable[..., Firewall]


@pytest.fixture
def make_firewall(smtp: MailSink, http: HttpSink, tmp_path: Path) -> Iterator[MakeFirewall]:
    made: list[tuple[Firewall, Any]] = []

    def make(**overrides: Any) -> Firewall:
        raw: dict[str, Any] = {
            "smtp": {"port": smtp.port, "sender": "agent@sandboxd.test"},
            "http": {"allowlist": [f"127.0.0.1:{http.port}"]},
            "webhook": {"url": http.url("/hook")},
            "adapter_timeout_s": 5.0,
        }
        raw.update(overrides)
        db = Database(str(tmp_path / "ledger.db"))
        firewall = Firewall(parse_config(raw), db)
        made.append((firewall, db))
        return firewall

    yield make
    for firewall, db in made:
        firewall.close()
        db.close()


def email(
    to: str = "alice@example.com", subject: str = "Invoice", body: str = "Pay 10 EUR"
) -> dict[str, Any]:
    return {"to": [to], "subject": subject, "body": body}


def test_manifests_describe_external_tools(make_firewall: MakeFirewall) -> None:
    manifests = {m.name: m for m in make_firewall().manifests()}
    assert set(manifests) == {"send_email", "http_request", "http_get", "webhook"}
    assert manifests["send_email"].effect == "external"
    assert manifests["send_email"].intent_fields == ["to", "subject", "body"]
    assert manifests["http_request"].intent_fields == ["method", "url", "body"]
    assert manifests["webhook"].intent_fields == ["body"] and manifests["http_get"].effect == "read"
    assert manifests["send_email"].openai_format()["function"]["parameters"]["required"] == [
        "to",
        "subject",
        "body",
    ]


def test_distinct_sends_deliver_one_message_each(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    results = [firewall.call("s", "lin", "send_email", email(body=f"n={i}")) for i in range(5)]
    assert smtp.count == 5 and len({r.call_id for r in results}) == 5
    assert all(r.state == "done" and not r.deduplicated for r in results)
    message_ids = [m[2].split(b"Message-ID: ")[1].split(b"\r\n")[0].decode() for m in smtp.envelopes]
    assert message_ids == [f"<{r.call_id}@sandboxd>" for r in results]
    assert smtp.envelopes[0][:2] == ("agent@sandboxd.test", ["alice@example.com"])


def test_retry_with_the_same_call_id_delivers_once(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    first = firewall.call("s", "lin", "send_email", email(), call_id="agent-7")
    # A cosmetic re-spelling of the same intent is still the same call.
    retry = firewall.call("s", "lin", "send_email", email(body="  Pay 10   EUR "), call_id="agent-7")
    assert smtp.count == 1
    assert retry.deduplicated and retry.call_id == first.call_id and retry.result == first.result
    assert firewall.stats().counters["deduplicated"] == 1


def test_identical_sends_without_call_id_deliver_twice(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    a = firewall.call("s", "lin", "send_email", email())
    b = firewall.call("s", "lin", "send_email", email())
    c = firewall.call("s", "lin", "send_email", email(), call_id="fresh-id")
    assert smtp.count == 3
    assert (a.occurrence, b.occurrence, c.occurrence) == (0, 1, 2)
    assert len({a.call_id, b.call_id, c.call_id}) == 3


def test_call_id_reused_for_another_intent_conflicts(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    firewall.call("s", "lin", "send_email", email(), call_id="agent-1")
    with pytest.raises(CallIdConflict) as caught:
        firewall.call("s", "lin", "send_email", email(body="Pay 1000 EUR"), call_id="agent-1")
    assert caught.value.code is ErrorCode.CALL_ID_CONFLICT and caught.value.details["call_id"] == "agent-1"
    assert smtp.count == 1 and [c.state for c in firewall.calls("s")] == ["done"]


def test_shadow_replay_delivers_once_and_reports_orphans(
    make_firewall: MakeFirewall, smtp: MailSink, http: HttpSink
) -> None:
    firewall = make_firewall()
    kept = firewall.call("s1", "root", "send_email", email(body="kept"))
    revoked = firewall.call("s1", "root", "webhook", {"body": {"order": 42, "qty": 1.0}})
    assert (smtp.count, http.count) == (1, 1)

    branch = firewall.open_replay("root")
    again = firewall.call("s2", "root", "send_email", email(body="kept"), mode="shadow")
    assert again.deduplicated and not again.shadowed and again.result == kept.result
    new = firewall.call("s2", "root", "webhook", {"body": {"order": 43}}, mode="shadow")
    assert new.shadowed and new.state == "staged" and (smtp.count, http.count) == (1, 1)

    report = firewall.finish_replay(branch, commit=True)
    assert report.orphaned == [revoked.call_id] and report.staged == [new.call_id]
    assert [c.state for c in firewall.calls("s1")] == ["done", "orphaned"]
    assert firewall.release(new.call_id).state == "done" and http.count == 2
    assert json.loads(http.requests[1]["body"]) == {"order": 43}
    assert firewall.stats().counters["orphaned"] == 1


def test_replay_counts_occurrences_from_zero(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    originals = [firewall.call("s", "root", "send_email", email()) for _ in range(2)]
    branch = firewall.open_replay("root")
    replayed = [firewall.call("s", "root", "send_email", email(), mode="shadow") for _ in range(3)]
    assert [r.call_id for r in replayed[:2]] == [o.call_id for o in originals]
    assert [r.deduplicated for r in replayed] == [True, True, False] and replayed[2].shadowed
    assert smtp.count == 2
    assert firewall.finish_replay(branch, commit=False).staged == [replayed[2].call_id]
    assert smtp.count == 2 and firewall.outbox() == []


def test_on_commit_effect_waits_for_the_commit(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall(release={"send_email": "on_commit"})
    with pytest.raises(InvalidArguments, match="turn"):
        firewall.call("s", "lin", "send_email", email())
    held = firewall.call("s", "lin", "send_email", email(), turn=3)
    assert held.held and held.state == "staged" and held.result and held.result["status"] == "held"
    assert smtp.count == 0 and [h.call_id for h in firewall.outbox("s")] == [held.call_id]
    assert firewall.commit("s", 2) == [] and smtp.count == 0
    results = firewall.commit("s", 3)
    assert [r.state for r in results] == ["done"] and smtp.count == 1
    assert firewall.commit("s", 3) == [] and smtp.count == 1 and firewall.outbox("s") == []


def test_on_commit_effect_dropped_with_its_turn_never_fires(
    make_firewall: MakeFirewall, smtp: MailSink
) -> None:
    firewall = make_firewall(release={"send_email": "on_commit"})
    held = firewall.call("s", "lin", "send_email", email(), turn=4)
    assert firewall.drop_turn("s", 4) == [held.call_id]
    assert firewall.commit("s", 4) == []
    with pytest.raises(InvalidState) as caught:
        firewall.release(held.call_id)
    assert caught.value.details["state"] == "dropped"
    assert smtp.count == 0 and [c.state for c in firewall.calls("s")] == ["dropped"]


def test_manual_release_and_drop(make_firewall: MakeFirewall, http: HttpSink) -> None:
    firewall = make_firewall(release={"http_request": "manual"})
    url = http.url("/orders")
    first = firewall.call("s", "lin", "http_request", {"method": "POST", "url": url, "body": "one"})
    second = firewall.call("s", "lin", "http_request", {"method": "DELETE", "url": url})
    assert first.held and second.held and http.count == 0
    released = firewall.release(first.call_id)
    assert released.result and released.result["status"] == 200 and http.count == 1
    assert (
        http.requests[0]["body"] == b"one" and http.requests[0]["headers"]["Idempotency-Key"] == first.call_id
    )
    firewall.drop(second.call_id)
    with pytest.raises(InvalidState):
        firewall.release(second.call_id)
    with pytest.raises(InvalidState):
        firewall.release(first.call_id)
    assert http.count == 1 and firewall.outbox() == []


def test_host_off_the_allowlist_is_refused(make_firewall: MakeFirewall, http: HttpSink) -> None:
    firewall = make_firewall()
    other = free_port()
    for url in [
        f"http://127.0.0.1:{other}/x",
        f"http://localhost:{http.port}/x",
        f"{http.url('')}@evil.test/",
    ]:
        with pytest.raises(HostNotAllowed) as caught:
            firewall.call("s", "lin", "http_request", {"method": "POST", "url": url})
        assert caught.value.code is ErrorCode.HOST_NOT_ALLOWED
        assert caught.value.details["allowlist"] == [f"127.0.0.1:{http.port}"]
    with pytest.raises(HostNotAllowed):
        firewall.call("s", "lin", "http_get", {"url": f"http://127.0.0.2:{http.port}/"})
    assert http.count == 0 and firewall.calls("s") == []


def test_http_get_reads_through_the_allowlist_without_ledger(
    make_firewall: MakeFirewall, http: HttpSink
) -> None:
    firewall = make_firewall()
    result = firewall.call("s", "lin", "http_get", {"url": http.url("/status")})
    assert result.result and result.result["status"] == 200 and json.loads(result.result["body"])["ok"]
    assert http.requests[0]["method"] == "GET" and firewall.calls("s") == []


def test_malformed_address_is_refused(make_firewall: MakeFirewall, smtp: MailSink) -> None:
    firewall = make_firewall()
    with pytest.raises(InvalidArguments) as caught:
        firewall.call(
            "s",
            "lin",
            "send_email",
            {"to": ["bob@example.com", "not an address"], "subject": "x", "body": "y"},
        )
    assert caught.value.details["path"] == "$.to[1]" and "not an email address" in caught.value.message
    with pytest.raises(InvalidArguments):
        firewall.call("s", "lin", "send_email", email(subject="hi\r\nBcc: all@example.com"))
    assert smtp.count == 0 and firewall.calls("s") == [] and firewall.stats().states == {}


def test_timeout_after_sending_leaves_the_call_unknown(make_firewall: MakeFirewall, http: HttpSink) -> None:
    firewall = make_firewall(adapter_timeout_s=0.3)
    args = {"method": "POST", "url": http.url("/slow"), "body": "pay"}
    started = time.monotonic()
    with pytest.raises(AdapterTimeout) as caught:
        firewall.call("s", "lin", "http_request", args, call_id="pay-1")
    assert time.monotonic() - started < 2.0
    assert caught.value.code is ErrorCode.ADAPTER_TIMEOUT and caught.value.details["state"] == "unknown"
    [record] = firewall.calls("s")
    assert record.state == "unknown" and http.count == 1  # it did reach the server
    with pytest.raises(CallUnknown):
        firewall.call("s", "lin", "http_request", args, call_id="pay-1")
    assert http.count == 1
    firewall.resolve(record.call_id, "done", {"status": 200, "note": "checked with the payee"})
    answered = firewall.call("s", "lin", "http_request", args, call_id="pay-1")
    assert answered.deduplicated and answered.result == {"status": 200, "note": "checked with the payee"}
    assert http.count == 1


def test_unreachable_server_fails_cleanly_and_may_be_retried(
    make_firewall: MakeFirewall, smtp: MailSink
) -> None:
    firewall = make_firewall(smtp={"port": free_port()})
    for attempt in (1, 2):
        with pytest.raises(EffectFailed) as caught:
            firewall.call("s", "lin", "send_email", email(), call_id="m1")
        assert caught.value.details["state"] == "failed"
        [record] = firewall.calls("s")
        assert record.state == "failed" and record.attempts == attempt
    assert smtp.count == 0


CHILD = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {repo!r})
    from sandboxd.db import Database
    from sandboxd.firewall import Firewall, parse_config
    config = parse_config({{"webhook": {{"url": {url!r}}}, "adapter_timeout_s": 30}})
    firewall = Firewall(config, Database({db!r}))
    firewall.call("s", "lin", "webhook", {{"body": {{"pay": 10}}}}, call_id="agent-1")
    """
)


def test_crash_mid_effect_becomes_unknown_and_is_never_refired(
    make_firewall: MakeFirewall, http: HttpSink, tmp_path: Path
) -> None:
    code = CHILD.format(repo=str(REPO), url=http.url("/slow"), db=str(tmp_path / "ledger.db"))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while http.count == 0 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
        assert http.count == 1, "the child never reached the server"
        os.kill(child.pid, signal.SIGKILL)  # the daemon dies while the POST is in flight
    finally:
        child.wait(timeout=10)
    firewall = make_firewall()
    [call_id] = firewall.recover()
    record = firewall.ledger.get(call_id)
    assert record is not None and (record.state, record.recovered_from) == ("unknown", "fired")
    with pytest.raises(CallUnknown):
        firewall.call("s", "lin", "webhook", {"body": {"pay": 10.0}}, call_id="agent-1")
    assert http.count == 1
    firewall.resolve(call_id, "failed")  # the operator checked: it did not go through
    retried = firewall.call("s", "lin", "webhook", {"body": {"pay": 10}}, call_id="agent-1")
    assert retried.call_id == call_id and retried.state == "done" and http.count == 2
