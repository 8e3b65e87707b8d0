"""The quick screen of stored records (log lines, database cells) before they are read by meaning
(`erasure.record_screen`).

A record the screen lets through is read by `ForgetFilter.holds_record`; one it stops is left as it is. So
it must never stop a line that holds a forgotten value: in every form a line can carry one (JSON
escapes, escapes twice, percent-encoding, re-flowed whitespace, other case under case folding, a piece
of a split target at a result's edge), the screen's answer is checked against the full reading.
"""

from __future__ import annotations

import json
import urllib.parse

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.revocation.erasure import record_screen, target_filter, target_texts
from sandboxd.revocation.fingerprint import _View, fingerprint, folded
from sandboxd.revocation.forgetting import ForgetFilter

SALT = bytes(range(32))

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
targets = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=2, max_size=16)
#: the ways a value reaches a log line
FORMS = (lambda t: t, lambda t: json.dumps(t)[1:-1], lambda t: json.dumps(json.dumps(t))[1:-1],
         lambda t: urllib.parse.quote(t), lambda t: t.upper(), lambda t: t.replace(" ", "\n  "),
         lambda t: t[: len(t) // 2], lambda t: t[len(t) // 2 :])


@settings(max_examples=300, deadline=None)
@given(text=texts, casefold=st.booleans(), spacefold=st.booleans())
def test_the_folded_text_is_the_one_a_match_is_searched_in(text: str, casefold: bool, spacefold: bool) -> None:
    assert folded(text, casefold, spacefold) == _View(text).fold(casefold, spacefold).folded


@settings(max_examples=400, deadline=None)
@given(target=targets.filter(str.strip), before=texts, after=texts, form=st.integers(0, len(FORMS) - 1),
       as_json=st.booleans(), casefold=st.booleans(), split=st.booleans(), around=st.lists(texts, max_size=3))
def test_a_line_the_screen_stops_holds_no_forgotten_value(target: str, before: str, after: str, form: int,
                                                          as_json: bool, casefold: bool, split: bool,
                                                          around: list[str]) -> None:
    pieces = [target[: len(target) // 2], target[len(target) // 2 :]] if split else []
    base = target_filter(target, pieces, SALT)
    fingerprints = base.fingerprints + ([fingerprint(target, SALT, casefold=True)] if casefold else [])
    forget = ForgetFilter(fingerprints, SALT)
    value = before + FORMS[form](target) + after
    line = json.dumps({"msg": value, "level": "info"}) if as_json else value
    # The log the line is cut from: other lines around it, whitespace at their edges included.
    whole = "\n".join([*around[:1], line, *around[1:]]) + "\n"
    for may_hold in (record_screen(forget, target_texts(target, pieces)),
                     record_screen(forget, target_texts(target, pieces), whole)):
        for each in whole.splitlines(keepends=True):
            if forget.holds_record(each):
                assert may_hold(each), each


def test_the_screen_stops_clean_lines_and_passes_everything_without_the_plain_texts() -> None:
    target = "screened-secret-7d1c"
    forget = target_filter(target, [], SALT)
    clean = json.dumps({"msg": "session s-1 opened", "level": "info"})
    holding = json.dumps({"msg": f"read {target}", "level": "info"})
    screen = record_screen(forget, target_texts(target, []))
    assert not screen(clean) and screen(holding)
    assert not record_screen(forget, target_texts(target, []), clean + "\n")(clean)
    assert record_screen(forget, target_texts(target, []), f"{clean}\n{holding}\n")(holding)
    assert record_screen(forget, [])(clean)  # the texts behind the fingerprints are not known: no screening
    assert record_screen(forget, ["another text"])(clean)
