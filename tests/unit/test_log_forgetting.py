"""A line the daemon logs about a session after it forgot a value is written without that value.

Generated values and messages (of any text) are logged about the session that forgot them, about
another session, and with an exception whose text quotes them, through the daemon's own handler
chain (a real state database, the JSON formatter, a log file); the file is then read back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.daemon import ForgetInLog, JsonFormatter
from sandboxd.db import Database
from sandboxd.revocation.forgotten import Forgotten

SALT = bytes(range(32))
VALUE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=8,
                max_size=60).filter(lambda v: v.strip() and len(v.strip()) >= 8)


@pytest.fixture
def logged(tmp_path: Path) -> Iterator[tuple[Forgotten, logging.Logger, Path]]:
    db = Database(tmp_path / "state.db")
    forgotten = Forgotten(db, SALT)
    path = tmp_path / "sandboxd.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ForgetInLog(forgotten))
    log = logging.getLogger(f"sandboxd.test-log-forgetting.{tmp_path.name}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield forgotten, log, path
    log.removeHandler(handler)
    handler.close()
    db.close()


def lines(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUE, before=st.text(max_size=20), after=st.text(max_size=20))
def test_a_line_about_the_session_is_written_without_what_it_forgot(
        logged: tuple[Forgotten, logging.Logger, Path], value: str, before: str, after: str) -> None:
    forgotten, log, path = logged
    path.write_text("")
    forgotten.forget("s-1", value)
    forget = forgotten.filter("s-1")
    log.info("call said %s%s%s", before, value, after, extra={"session_id": "s-1"})
    try:
        raise RuntimeError(f"failed on {value}")
    except RuntimeError:
        log.exception("the call failed", extra={"session_id": "s-1"})
    log.info("about another session: %s", value, extra={"session_id": "s-2"})
    log.info("about no session: %s", value)
    mine, theirs, nobody = lines(path)[0:2], lines(path)[2], lines(path)[3]
    assert not any(forget.holds(entry["msg"]) or forget.holds(entry.get("exc", "")) for entry in mine), mine
    assert mine[1]["exc"].startswith("Traceback") and "RuntimeError" in mine[1]["exc"]
    # What the daemon wrote around the value stays; another session's lines are not this session's to filter.
    assert mine[0]["msg"].startswith("call said")
    assert theirs["msg"] == f"about another session: {value}" and nobody["msg"] == f"about no session: {value}"


def test_a_line_whose_session_cannot_be_read_is_withheld(logged: tuple[Forgotten, logging.Logger, Path]) -> None:
    forgotten, log, path = logged
    forgotten.db.close()
    log.info("call said %s", "a secret", extra={"session_id": "s-9"})
    [entry] = lines(path)
    assert "a secret" not in entry["msg"] and "withheld" in entry["msg"] and entry["session_id"] == "s-9"
