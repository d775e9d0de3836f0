"""Weight versions as ranges: a run serves hundreds of versions, shown as a few spans."""

from __future__ import annotations

from collections.abc import Iterable


def version_ranges(versions: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct versions as runs of consecutive numbers: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(versions)):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def version_span(versions: Iterable[int]) -> str:
    """'157 (v0-v156)'; gaps show as further ranges: '12 (v0-v9, v12-v13)'; 'none'."""
    ranges = version_ranges(versions)
    if not ranges:
        return "none"
    count = sum(b - a + 1 for a, b in ranges)
    return f"{count} ({', '.join(f'v{a}' if a == b else f'v{a}-v{b}' for a, b in ranges)})"
