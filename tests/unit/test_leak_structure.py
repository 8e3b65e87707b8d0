"""A database byte the leak scan finds is structure only when the database's structure spells it.

Records of every shape (nested objects and lists, field names, numbers, values of any text, records
long enough to spill onto overflow pages) are stored in a real SQLite state database, and its files
are searched byte by byte as a revocation's scan searches them. A target spelled by a field name, a
number run or the schema is structure wherever it is found; a target that only a record's values say
is never called structure, so a leak cannot hide behind the record's keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sandboxd.db import Database
from sandboxd.revocation.leaks import Spellings, skeleton
from sandboxd.revocation.leakscan import scan_paths

FIELD = st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True)
#: a value's text: anything but the marker that makes a target no field name, number or syntax spells
VALUE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="§"), max_size=40)
#: a long value spills the record onto overflow pages, which split its bytes in the file
FILLER = st.integers(400, 800).map(lambda n: "abc def " * n)
LEAF = st.one_of(VALUE, st.integers(-10**12, 10**12), st.booleans(), st.none(), FILLER)
RECORDS = st.recursive(st.dictionaries(FIELD, LEAF, min_size=1, max_size=6),
                       lambda inner: st.dictionaries(FIELD, st.one_of(inner, st.lists(inner, max_size=3)),
                                                     min_size=1, max_size=4), max_leaves=12)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def fields(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [f for key, item in value.items() for f in [key, *fields(item)]]
    if isinstance(value, list):
        return [f for item in value for f in fields(item)]
    return []


def says(value: Any, target: str) -> bool:
    """Whether a string value of the record holds `target` (then it is content there, not structure)."""
    if isinstance(value, dict):
        return any(says(item, target) for item in value.values())
    if isinstance(value, list):
        return any(says(item, target) for item in value)
    return isinstance(value, str) and target in value


def stored(tmp_path: Path, records: list[dict[str, Any]]) -> tuple[Database, list[Path]]:
    db = Database(tmp_path / "state.db")
    with db.transaction():
        db.insert("sessions", {"session_id": "s-1", "image": "tools", "state": "open", "created_at": 1.0,
                                   "owner": "local"})
        for n, record in enumerate(records):
            db.insert("calls", {"call_id": f"c-{n}", "session_id": "s-1", "seq": n, "tool": "shell",
                                "args": "{}", "status": "done", "created_at": 1.0,
                                "result": json.dumps(record, ensure_ascii=False)})
    return db, [tmp_path / name for name in ("state.db", "state.db-wal") if (tmp_path / name).exists()]


@SETTINGS
@given(records=st.lists(RECORDS, min_size=1, max_size=4), data=st.data())
def test_a_target_a_field_name_spells_is_structure_wherever_it_is_found(
        tmp_path_factory: Any, records: list[dict[str, Any]], data: st.DataObject) -> None:
    names = [name for record in records for name in fields(record) if len(name) >= 8]
    sources = names + ["CREATE TABLE", "session_id TEXT"]
    source = data.draw(st.sampled_from(sources))
    start = data.draw(st.integers(0, len(source) - 8))
    target = source[start:data.draw(st.integers(start + 8, len(source)))]
    assume(not any(says(record, target) for record in records))
    db, files = stored(tmp_path_factory.mktemp("db"), records)
    try:
        needle = target.encode()
        report = scan_paths([needle], files)
        assert report.hits, "the schema at least spells it"
        spellings = Spellings.of_database(db)
        for hit in report.hits:
            assert spellings.spell(hit, needle), (hit, target)
    finally:
        db.close()


@SETTINGS
@given(records=st.lists(RECORDS, min_size=1, max_size=4), value=VALUE, at=st.integers(0, 3))
def test_a_target_only_a_value_says_is_never_structure(tmp_path_factory: Any, records: list[dict[str, Any]],
                                                      value: str, at: int) -> None:
    target = f"§{value}§"  # no field name, number or syntax spells the marker
    holder = records[at % len(records)]
    holder[next(iter(holder))] = f"before {target} after"
    db, files = stored(tmp_path_factory.mktemp("db"), records)
    try:
        needle = json.dumps(target, ensure_ascii=False)[1:-1].encode()  # as the record stores it
        report = scan_paths([needle], files)
        assert report.hits
        spellings = Spellings.of_database(db)
        assert not any(spellings.spell(hit, needle) for hit in report.hits), target
    finally:
        db.close()


def test_a_records_skeleton_is_its_syntax_numbers_and_field_names() -> None:
    record = json.dumps({"kind": "result", "stdout_truncated": False, "exit_code": 12345678,
                         "Content Key": "x", "nested": [{"deep_field": "value text"}]})
    runs = skeleton(record)
    assert any("stdout_truncated" in run for run in runs) and any("12345678" in run for run in runs)
    assert any("deep_field" in run for run in runs)
    # Values, and a key that is content used as a key, are not structure.
    assert not any(text in run for run in runs for text in ("result", "Content Key", "value text"))
    assert skeleton("not json {") == [] and skeleton("plain text") == []


@SETTINGS
@given(records=st.lists(RECORDS, min_size=1, max_size=4), value=VALUE, data=st.data())
def test_a_log_line_spells_its_field_names_and_never_its_messages(
        tmp_path_factory: Any, records: list[dict[str, Any]], value: str, data: st.DataObject) -> None:
    log = tmp_path_factory.mktemp("log") / "sandboxd.log"
    secret = f"§{value}§"
    lines = [json.dumps({"ts": 1796534443.241, "level": "info", "msg": f"call said {secret}", **record})
             for record in records]
    log.write_text("".join(line + "\n" for line in lines))
    names = [name for record in records for name in fields(record) if len(name) >= 8] + ["level"]
    name = data.draw(st.sampled_from(names))
    assume(not any(says(record, name) for record in records) and name not in secret)
    spellings = Spellings.of_log(log)
    for target, structure in ((name, True), (secret, False)):
        needle = json.dumps(target)[1:-1].encode()  # as the log writes it (ASCII escapes)
        report = scan_paths([needle], [log])
        assert report.hits
        assert all(spellings.spell(hit, needle) == structure for hit in report.hits), (target, structure)
