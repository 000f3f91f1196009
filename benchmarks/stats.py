"""The spread every benchmark reports: min, median, 90th percentile and max over its repeats, and whether it holds.

A figure is quoted as its median with this spread. It "holds" when the max is within
1.5× of the median: a run with a slower mode (page faults, a cold cache, a neighbour)
shows up here instead of in a figure that another run cannot reproduce.
"""

from __future__ import annotations

import statistics
from typing import Any

MIN_REPEATS = 7
SPREAD_LIMIT = 1.5  # max / median above this: the figure does not hold


def p90(values: list[float]) -> float:
    """The 90th percentile, nearest rank (of 7 values: the 6th)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def spread(values: list[float]) -> dict[str, Any]:
    """{min, median, p90, max, n, within_1_5x} of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread() of no values: the benchmark measured nothing")
    med = statistics.median(values)
    return {
        "min": min(values),
        "median": med,
        "p90": p90(values),
        "max": max(values),
        "n": len(values),
        "within_1_5x": max(values) <= SPREAD_LIMIT * med if med > 0 else True,
    }


def spread_text(values: list[float], unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    """``median (min / p90 / max, n=7, holds)`` for a table cell; ``scale`` converts (1000: s to ms)."""
    s = spread([v * scale for v in values])
    holds = "holds" if s["within_1_5x"] else f"max {s['max'] / s['median']:.1f}× median"
    unit = f" {unit}" if unit else ""
    return (
        f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f} / {s['p90']:.{digits}f} / {s['max']:.{digits}f}, "
        f"n={s['n']}, {holds})"
    )


def parse_repeated(parser: Any) -> Any:
    """``parser``'s arguments, refused when ``--repeats`` is below ``MIN_REPEATS`` (a spread needs that many)."""
    args = parser.parse_args()
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats {args.repeats} is below {MIN_REPEATS}: a spread needs at least {MIN_REPEATS} repeats")
    return args
