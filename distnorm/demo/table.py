"""The main job's table: one row per format variant (check result, match %, timings), rendered as
fixed-width text. Without timing columns (the CPU path) no timing is printed at all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

NAME_WIDTH = 26
COLUMN_WIDTH = 11


@dataclass(frozen=True)
class Row:
    """One variant's results. times_us: one entry per timing column (None: not timed, e.g. M = 0);
    graph: False when a function could not be captured and was timed with eager calls."""

    name: str
    ok: bool
    match: Optional[float]  # None: nothing to compare (M = 0)
    times_us: tuple = ()
    graph: bool = True
    problem: str = ""


def header(time_columns: Sequence[str], speedup: bool = False) -> str:
    cols = [f"{'variant':{NAME_WIDTH}s}", f"{'check':>6s}", f"{'match %':>8s}"]
    cols += [f"{c + ' us':>{COLUMN_WIDTH}s}" for c in time_columns]
    if speedup:
        cols.append(f"{'speedup':>8s}")
    return " ".join(cols)


def _time(t: Optional[float], graph: bool) -> str:
    if t is None:
        return f"{'n/a':>{COLUMN_WIDTH}s}"
    return f"{t:{COLUMN_WIDTH - 1}.2f}{' ' if graph else '*'}"


def format_row(row: Row, speedup: bool = False) -> str:
    """The row's line; speedup: the last timing column divided by the first (unfused / fused)."""
    match = f"{'n/a':>8s}" if row.match is None else f"{100 * row.match:8.3f}"
    cols = [f"{row.name:{NAME_WIDTH}s}", f"{'ok' if row.ok else 'FAIL':>6s}", match]
    cols += [_time(t, row.graph) for t in row.times_us]
    if speedup:
        first, last = row.times_us[0], row.times_us[-1]
        cols.append(f"{'n/a':>8s}" if first is None or last is None or first <= 0
                    else f"{last / first:7.2f}x")
    line = " ".join(cols)
    return line + (f"   {row.problem}" if row.problem else "")


def render(rows: Sequence[Row], time_columns: Sequence[str] = (), speedup: bool = False) -> str:
    """Header, one line per row, and a footnote when some timing was not a CUDA graph."""
    lines = [header(time_columns, speedup)] + [format_row(r, speedup) for r in rows]
    if time_columns and footnote(rows):
        lines.append(footnote(rows))
    return "\n".join(lines)


def footnote(rows: Sequence[Row]) -> str:
    """What a '*' after a time means, when some row has one ("" otherwise)."""
    if any(not r.graph for r in rows):
        return "* timed with eager calls (could not be captured in a CUDA graph)"
    return ""


def summary(rows: Sequence[Row], what: str) -> str:
    """The closing line: all checks passed, or how many failed."""
    failed = sum(not r.ok for r in rows)
    if failed:
        return f"{failed} of {len(rows)} {what} differ from the reference"
    return f"all {len(rows)} {what} match the reference"
