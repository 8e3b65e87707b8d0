"""The byte search of a leak scan finds every occurrence of every needle, wherever it falls.

Needles with zero bytes (UTF-16 forms) are found through their even or odd bytes (`sandboxd.revocation.bytefind`),
so the cases that matter are zeros around and inside them, odd and even offsets, and matches that
straddle the chunks a file is read in; the reference is a plain search of the whole bytes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.revocation.leakscan import LeakReport, _Matcher, needles_for


def every_offset(data: bytes, needle: bytes) -> list[int]:
    found, position = [], data.find(needle)
    while position != -1:
        found.append(position)
        position = data.find(needle, position + 1)
    return found


pieces = st.one_of(st.binary(max_size=40), st.integers(min_value=1, max_value=300).map(bytes))


@settings(max_examples=300, deadline=None)
@given(target=st.text(min_size=1, max_size=12).filter(lambda t: t.strip("\x00")),
       layout=st.lists(st.tuples(pieces, st.integers(min_value=-1, max_value=20)), max_size=12),
       chunk=st.integers(min_value=1, max_value=200))
def test_every_occurrence_is_found_once_at_its_offset(target: str, layout: list[tuple[bytes, int]],
                                                      chunk: int) -> None:
    needles = needles_for(target)
    # Zeros and random bytes with needles dropped in (index -1: none), at whatever parity falls out.
    data = b"".join(piece + (needles[index % len(needles)] if index >= 0 else b"") for piece, index in layout)
    report = LeakReport()
    _Matcher(needles, report)._chunks((data[i:i + chunk] for i in range(0, len(data), chunk)), 0, "data")
    got = sorted((hit.needle, hit.offset) for hit in report.hits)
    assert got == sorted((index, offset) for index, needle in enumerate(needles)
                         for offset in every_offset(data, needle))
