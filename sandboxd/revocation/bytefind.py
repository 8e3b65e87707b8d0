"""Every offset of a byte needle in a buffer, found fast on the mostly-zero bytes a leak scan reads.

Needles with zero bytes (UTF-16 forms) are found through their half without any (`half_of`): on
zeros, `bytes.find` for such a needle advances one byte at a time.
"""

from __future__ import annotations

from collections.abc import Iterator


def half_of(needle: bytes) -> tuple[bytes, int] | None:
    """The half of a needle (its even or its odd bytes, and which) with the fewest zero bytes, when that
    half has none: found through it, the needle is found without a zero byte to search for."""
    k = min((0, 1), key=lambda k: needle[k::2].count(0))
    half = needle[k::2]
    return (half, k) if half and 0 not in half else None


def positions(buffer: bytes, needle: bytes, half: tuple[bytes, int] | None,
               split: tuple[bytes, bytes] | None) -> Iterator[int]:
    """Every offset of `needle` in `buffer`, ascending.

    Most of what a scan reads is zeros (a disk image's metadata, pages secure_delete cleared), and on
    zeros `bytes.find` for a needle holding zero bytes (a UTF-16 form) advances one byte at a time:
    ten times slower than for the others, most of a revocation's scan. Such a needle, at offset p, puts
    its half `needle[k::2]` at offset (p + k) // 2 of the buffer's even bytes (p + k even) or odd bytes
    (p + k odd), and that half has no zero byte; each place it is found there is checked in full."""
    if half is None or split is None:
        position = buffer.find(needle)
        while position != -1:
            yield position
            position = buffer.find(needle, position + 1)
        return
    sub, k = half
    found = []
    for parity, side in enumerate(split):
        index = side.find(sub)
        while index != -1:
            position = 2 * index + parity - k
            if position >= 0 and buffer.startswith(needle, position):
                found.append(position)
            index = side.find(sub, index + 1)
    yield from sorted(found)
