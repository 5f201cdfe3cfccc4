"""Token ranges: half-open intervals [start, end) of global positions in a sequence, and the set arithmetic the
sharding, exchange and reduction plans are written in.

A *range set* is a tuple of ranges sorted by start, pairwise disjoint, none empty and none touching the next (so
each set has exactly one spelling): :func:`normalize` makes one. A range set also describes a compact buffer that
holds its tokens back to back in ascending order; :func:`offset_in` maps a position to its row there.
"""

from __future__ import annotations

from typing import Iterable

Range = tuple[int, int]
RangeSet = tuple[Range, ...]


def normalize(ranges: Iterable[Range]) -> RangeSet:
    """The range set covering the union of `ranges` (any order, overlapping, touching or empty)."""
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


def intersect(a: RangeSet, b: RangeSet) -> RangeSet:
    """The positions in both range sets."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(a: RangeSet, b: RangeSet) -> RangeSet:
    """The positions of `a` that are not in `b`."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return tuple(out)


def length(ranges: RangeSet) -> int:
    """The number of positions in a range set."""
    return sum(end - start for start, end in ranges)


def offset_in(ranges: RangeSet, position: int) -> int:
    """The row of `position` in the compact buffer of `ranges` (its tokens back to back in ascending order).

    Raises:
        ValueError: `position` is not in the set (a bug of the caller's plan).
    """
    offset = 0
    for start, end in ranges:
        if start <= position < end:
            return offset + position - start
        offset += end - start
    raise ValueError(f"position {position} is not in the range set {ranges}")


def covers(ranges: RangeSet, needed: RangeSet) -> bool:
    """Whether every position of `needed` is in `ranges`."""
    return not subtract(needed, ranges)
