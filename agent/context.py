"""Injected determinism: the virtual clock and the id source of an agent session.

Nothing in the runtime reads the wall clock or a global random generator. Ids are positional (the
step or turn they belong to), so a replayed branch names an artifact exactly as a fresh run on the
same observations would; the clock is a function of the step, so a tool re-executed on replay sees
the time of the original call.
"""

from __future__ import annotations

import random

import msgspec

#: 2026-01-01T00:00:00Z, the epoch of every scripted session's virtual clock
DEFAULT_EPOCH = 1_767_225_600.0


class SeededContext(msgspec.Struct, frozen=True, kw_only=True):
    """Seed, epoch and tick of a session; everything else is derived from a position."""

    seed: int = 0
    epoch: float = DEFAULT_EPOCH
    tick_s: float = 60.0

    def clock(self, step: int, turn: int) -> float:
        """Virtual Unix time of a call made at (step, turn)."""
        return self.epoch + self.tick_s * (step * 1000 + turn)

    def rng(self, *position: int) -> random.Random:
        """A generator seeded by the session seed and a position, never by history."""
        return random.Random(hash((self.seed, *position)) & 0xFFFFFFFF)


def artifact_id(kind: str, *position: int) -> str:
    """Positional artifact id, e.g. artifact_id("turn", 7) -> "turn-7"."""
    return "-".join([kind, *(str(p) for p in position)])
