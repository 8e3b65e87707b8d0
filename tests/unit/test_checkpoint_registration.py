"""Registering a checkpoint twice: the very same position again keeps the first (an agent resumed from it
after a rollback); the same id at another position, or after the session moved on, is refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sandboxd import protocol as p
from tests.unit.test_core_service import FAST, art, daemon

POSITIONS = st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 5000))


@FAST
@given(first=POSITIONS, other=st.none() | POSITIONS, moved=st.booleans())
def test_a_checkpoint_registered_again_keeps_the_first_only_at_the_very_same_point(
        first: tuple[int, int, int], other: tuple[int, int, int] | None, moved: bool) -> None:
    again = first if other is None else other  # None: the very same position
    with daemon() as d:
        sid = d.open()
        d.record(sid, art("u1", "user", 1, 1, "task"))

        def register(at: tuple[int, int, int]) -> p.Response:
            record = p.CheckpointRecord(checkpoint_id="cp-a", step=at[0], turn=at[1], token_offset=at[2],
                                        cache_handle="", reason="turn", manifest=["u1"])
            return d.send(p.CheckpointRequest, session_id=sid, checkpoint=record)

        kept = register(first)
        assert isinstance(kept, p.CheckpointResponse)
        if moved:
            d.record(sid, art("u2", "user", 2, 2, "another task"))
        reply = register(again)
        if again == first and not moved:
            assert isinstance(reply, p.CheckpointResponse) and reply.checkpoint == kept.checkpoint
        else:
            assert isinstance(reply, p.ErrorResponse) and reply.code == "invalid_arguments", reply
        [stored] = [c for c in d.graph(sid).checkpoints if c.checkpoint_id == "cp-a"]
        assert (stored.step, stored.turn, stored.token_offset) == first
