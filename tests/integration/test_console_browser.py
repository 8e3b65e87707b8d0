"""The web console in a real headless browser (Debian's chromium through its chromedriver, via Selenium).

A real daemon, a real SMTP sink, the console served by uvicorn on a free loopback port; the browser
logs in with the token, approves and drops held emails, raises a revocation, draws a 300-node graph.
Screenshots go to docs/ for the README.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from sandboxd import protocol as p
from sandboxd.auth import generate_keys, read_public_key, read_secret_key
from sandboxd.client import Client
from sandboxd.console.app import Console
from sandboxd.launcher import DaemonProcess
from tests.browser import big_graph, chrome, serve_console
from tests.integration.operator_world import Sinks, drive, notes, operated, sinks
from tests.sinks import SmtpSink

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
__all__ = ["operated", "sinks"]
pytestmark = [pytest.mark.docker,
              pytest.mark.skipif(not shutil.which("chromedriver"), reason="needs Debian's chromium-driver")]


@pytest.fixture
def smtp() -> Iterator[SmtpSink]:
    sink = SmtpSink()
    controller = Controller(sink, hostname="127.0.0.1", port=sink.port)
    controller.start()
    yield sink
    controller.stop()


@pytest.fixture
def firewalled(daemon_factory: Callable[..., DaemonProcess], smtp: SmtpSink, tmp_path: Path) -> DaemonProcess:
    config = tmp_path / "sandboxd.toml"
    config.write_text(f'[firewall.smtp]\nhost = "127.0.0.1"\nport = {smtp.port}\n'
                      '[firewall.release]\nsend_email = "manual"\n')
    return daemon_factory(["--config", str(config)])


@pytest.fixture
def console(firewalled: DaemonProcess) -> Iterator[tuple[str, Console]]:
    app = Console(lambda: Client(firewalled.endpoint, timeout_s=60))
    with serve_console(app) as base:
        yield base, app


@pytest.fixture
def browser() -> Iterator[object]:
    driver = chrome()
    yield driver
    driver.quit()


def login(driver: object, base: str, token: str) -> None:
    driver.get(f"{base}/login")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "token").send_keys(token)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    WebDriverWait(driver, 10).until(
        lambda d: d.find_elements(By.ID, "sessions") or d.find_elements(By.ID, "login-error"))


def mail(i: int) -> dict[str, object]:
    return {"to": [f"ops{i}@example.test"], "subject": f"invoice {i}", "body": f"pay invoice {i} today"}


def test_login_needs_the_token(console: tuple[str, Console], browser: object) -> None:
    base, app = console
    driver: object = browser
    driver.get(f"{base}/approvals")  # type: ignore[attr-defined]
    assert "/login" in driver.current_url  # type: ignore[attr-defined]
    login(driver, base, app.token + "x")
    assert driver.find_element(By.ID, "login-error").text == "wrong token"  # type: ignore[attr-defined]
    driver.get(f"{base}/approvals")  # type: ignore[attr-defined]
    assert "/login" in driver.current_url  # type: ignore[attr-defined]
    login(driver, base, app.token)
    assert driver.find_element(By.ID, "sessions")  # type: ignore[attr-defined]


def test_approve_sends_once_and_drop_never(console: tuple[str, Console], browser: object, firewalled: DaemonProcess,
                                           smtp: SmtpSink) -> None:
    import httpx

    base, app = console
    client = firewalled.client()
    sid = client.open_session().session_id
    kept = client.call(sid, "send_email", mail(1), turn=1)
    gone = client.call(sid, "send_email", mail(2), turn=2)
    assert kept.held and gone.held and smtp.count == 0
    # A POST without the CSRF token changes nothing, even with the login cookie.
    refused = httpx.post(f"{base}/approvals/decide", data={"call_id": kept.call_id, "action": "approve"},
                         cookies={"sandboxd_console": app.token})
    assert refused.status_code == 403 and smtp.count == 0
    driver: object = browser
    login(driver, base, app.token)
    driver.get(f"{base}/approvals")  # type: ignore[attr-defined]
    row = driver.find_element(By.CSS_SELECTOR, f'tr[data-call="{kept.call_id}"]')  # type: ignore[attr-defined]
    assert "pay invoice 1 today" in row.text and "ops1@example.test" in row.text
    driver.save_screenshot(str(DOCS / "console-approvals.png"))  # type: ignore[attr-defined]
    row.find_element(By.CLASS_NAME, "reason").send_keys("expected invoice")
    row.find_element(By.CLASS_NAME, "approve").click()
    WebDriverWait(driver, 10, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: not d.find_elements(By.CSS_SELECTOR, f'tr[data-call="{kept.call_id}"]'))
    row = driver.find_element(By.CSS_SELECTOR, f'tr[data-call="{gone.call_id}"]')  # type: ignore[attr-defined]
    row.find_element(By.CLASS_NAME, "reason").send_keys("the agent was hijacked")
    row.find_element(By.CLASS_NAME, "drop").click()
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.ID, "nothing"))
    # Approving twice (a double click, a reload) must not send twice.
    again = httpx.post(f"{base}/approvals/decide", data={"call_id": kept.call_id, "action": "approve",
                                                         "csrf": app.csrf}, cookies={"sandboxd_console": app.token})
    assert "Refused" in again.text
    time.sleep(0.5)
    assert smtp.count == 1 and b"pay invoice 1 today" in smtp.messages[0][2]
    states = {c.call_id: c.state for c in client.calls(sid)}
    assert states[kept.call_id] in ("done", "released") and states[gone.call_id] == "dropped"
    # Who decided and why is in each call's ledger history (read here from the daemon's database).
    with sqlite3.connect(firewalled.state_dir / "state.db") as db:
        decided = {row[0]: row[1:] for row in db.execute(
            "SELECT call_id, actor, reason FROM ledger_events WHERE to_state IN ('released', 'dropped')")}
    assert decided == {kept.call_id: ("local", "expected invoice"), gone.call_id: ("local", "the agent was hijacked")}


def test_graph_of_300_nodes_highlights_the_closure_and_revocation_completes(
        console: tuple[str, Console], browser: object, firewalled: DaemonProcess) -> None:
    import httpx

    base, app = console
    client = firewalled.client()
    sid = client.open_session().session_id
    observations = big_graph(client, sid)
    source = observations[len(observations) // 2]
    expected = set(client.provenance(sid, source).taint_closure)
    driver: object = browser
    login(driver, base, app.token)
    driver.get(f"{base}/sessions/{sid}/graph")  # type: ignore[attr-defined]
    box = WebDriverWait(driver, 20).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#graph[data-rendered]"))
    assert len(driver.find_elements(By.CSS_SELECTOR, "#graph g.node")) == 300  # type: ignore[attr-defined]
    assert float(box.get_attribute("data-rendered")) > 0  # the timing bound lives in benchmarks/bench_console.py
    node = driver.find_element(By.CSS_SELECTOR, f'#graph g.node[data-artifact="{source}"] rect')  # type: ignore
    # The node lies below the first screenful: a click is a pointerdown and pointerup on it, wherever it is.
    driver.execute_script(  # type: ignore[attr-defined]
        "for (const t of ['pointerdown', 'pointerup']) arguments[0].dispatchEvent("
        "new PointerEvent(t, {bubbles: true, clientX: 5, clientY: 5}));", node)
    WebDriverWait(driver, 20).until(lambda d: d.find_element(By.ID, "graph").get_attribute("data-closure") != "0")
    shown = {g.get_attribute("data-artifact") for g in driver.find_elements(  # type: ignore[attr-defined]
        By.CSS_SELECTOR, "#graph g.node.closure")}
    assert shown == expected
    driver.save_screenshot(str(DOCS / "console-graph.png"))  # type: ignore[attr-defined]
    driver.find_element(By.ID, "revoke").click()  # type: ignore[attr-defined]
    WebDriverWait(driver, 20).until(lambda d: "/revocations/" in d.current_url)
    # Raised: the graph now draws what it takes back by id, type and digest, never its text.
    svg = httpx.get(f"{base}/sessions/{sid}/graph.svg?source={source}", cookies={"sandboxd_console": app.token}).text
    assert f"{source.replace('obs-', 'item ')} says hello" not in svg and "[redacted:" in svg
    assert "item 1 says hello" in svg
    rid = driver.current_url.rsplit("/", 1)[1]  # type: ignore[attr-defined]
    assert client.revocation_status(rid).revocation.state == "pending"
    WebDriverWait(driver, 20, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: d.find_element(By.ID, "state").text == "pending")
    # The agent's half, as an agent does it: take the revocation, replay nothing, commit.
    plan = client.begin_revocation(rid)
    client.commit_revocation(p.CommitRevocationRequest(
        request_id="r", revocation_id=plan.revocation_id, tokens=p.TokenCounts(recomputed=123, reused_prefix=45),
        transitions_replayed=3, final_step=plan.checkpoint.step))
    report = client.revocation_status(rid).report
    assert report is not None
    WebDriverWait(driver, 20, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: d.find_elements(By.ID, "report"))
    figures = {e.get_attribute("data-key"): e.text for e in driver.find_elements(  # type: ignore[attr-defined]
        By.CSS_SELECTOR, "#report .figure")}
    assert figures["tokens.recomputed"] == f"recomputed {report.tokens.recomputed}"
    assert figures["tokens.reused_prefix"] == f"reused_prefix {report.tokens.reused_prefix}"
    assert figures["transitions_replayed"] == str(report.transitions_replayed)
    assert figures["taint_closure"] == str(len(report.taint_closure))
    for key, value in report.calls.items():
        assert figures[f"calls.{key}"] == f"{key} {value}"
    assert [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#not-erased li")] == report.not_erased  # type: ignore
    driver.save_screenshot(str(DOCS / "console-revocation.png"))  # type: ignore[attr-defined]
    # The plots: the revocation is one point of cost against tau.
    driver.get(f"{base}/plots")  # type: ignore[attr-defined]
    assert len(driver.find_elements(By.CSS_SELECTOR, ".plot svg")) == 2  # type: ignore[attr-defined]
    assert driver.execute_script(  # type: ignore[attr-defined]
        "return document.querySelectorAll('.plot')[1].querySelectorAll('g[id^=PathCollection] use').length") == 1


def test_timeline_streams_new_calls(console: tuple[str, Console], browser: object, firewalled: DaemonProcess) -> None:
    base, app = console
    client = firewalled.client()
    sid = client.open_session().session_id
    driver: object = browser
    login(driver, base, app.token)
    driver.get(f"{base}/sessions/{sid}")  # type: ignore[attr-defined]
    client.call(sid, "write_file", {"path": "note.txt", "content": "streamed"})
    WebDriverWait(driver, 20).until(lambda d: "write_file" in d.find_element(By.ID, "timeline").text)
    driver.save_screenshot(str(DOCS / "console-session.png"))  # type: ignore[attr-defined]


def test_an_operator_key_logs_in_and_the_session_page_forks_and_rolls_back(
        operated: DaemonProcess, sinks: Sinks, browser: object, tmp_path: Path) -> None:
    """Logged in with an operator's CURVE secret (not the token); a fork from the page opens the new
    session's page; a rollback from the page takes the later checkpoint off the parent's timeline."""
    ops_public, ops_secret = generate_keys(tmp_path, "ops")
    _, stranger_secret = generate_keys(tmp_path, "stranger")
    client = operated.client()
    sid = client.open_session().session_id
    points = drive(client, sid)
    app = Console(lambda: Client(operated.endpoint, timeout_s=60),
                  operator_keys=frozenset({read_public_key(ops_public)}))
    driver: Any = browser
    with serve_console(app) as base:
        login(driver, base, read_secret_key(stranger_secret)[1])  # a well-formed key that is no operator's
        assert driver.find_element(By.ID, "login-error").text == "wrong token or key"
        # The whole NAME.key_secret file pasted: a one-line field drops its line breaks, as a browser's paste does.
        login(driver, base, ops_secret.read_text().replace("\n", ""))
        row = driver.find_element(By.XPATH, f'//tr[@class="session"][td/a[text()="{sid}"]]')
        # Owner (the ipc socket's owner is `local`), state, and what it uses, its disk among it.
        assert [td.text for td in row.find_elements(By.TAG_NAME, "td")][1:3] == ["local", "open"]
        assert "disk " in row.text and "MiB" in row.text and "memory " in row.text

        def shown(kind: str) -> dict[str, str]:
            """The timeline's rows of one kind, id -> text, read at once (the event stream redraws them)."""
            pairs = driver.execute_script("return [...document.querySelectorAll('tr.item.' + arguments[0])]"
                                          ".map(r => [r.dataset.id, r.innerText])", kind)
            return dict(pairs)

        def checkpoints_shown() -> list[str]:
            return list(shown("checkpoint"))

        driver.get(f"{base}/sessions/{sid}")
        assert checkpoints_shown() == ["cp-start", "cp-1-turn", "cp-2-turn"]
        Select(driver.find_element(By.NAME, "checkpoint")).select_by_value(points["A"].checkpoint_id)
        driver.find_element(By.ID, "fork").click()
        WebDriverWait(driver, 30).until(lambda d: d.current_url.rstrip("/") != f"{base}/sessions/{sid}")
        child = driver.current_url.rsplit("/", 1)[1]
        assert child != sid and child in {s.session_id for s in client.sessions()}
        assert checkpoints_shown() == ["cp-start", "cp-1-turn"] and notes(client, child) == "v1\n"

        driver.get(f"{base}/sessions/{sid}")
        Select(driver.find_element(By.NAME, "checkpoint")).select_by_value(points["A"].checkpoint_id)
        driver.find_element(By.ID, "rollback").click()
        WebDriverWait(driver, 30, ignored_exceptions=[StaleElementReferenceException]).until(
            lambda d: checkpoints_shown() == ["cp-start", "cp-1-turn"])
        assert driver.current_url.rstrip("/") == f"{base}/sessions/{sid}"
        # The timeline shows what the rollback did to the calls after the point: the held email dropped,
        # the fired webhook orphaned; the files are back.
        rows = shown("call")
        [email] = [c for c in client.calls(sid) if c.tool == "send_email"]
        assert "send_email · dropped" in rows[email.call_id]
        assert any("webhook · orphaned" in text for text in rows.values())
        assert notes(client, sid) == "v1\n" and notes(client, child) == "v1\n"
        driver.save_screenshot(str(DOCS / "console-rollback.png"))
    assert sinks.smtp.count == 0 and len(sinks.posts("/hook")) == 2
