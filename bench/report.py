"""Rows of the results table, their formatting, and RESULTS.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .procfs import percentile

# RESULTS.md from this heading on holds the separate scripts' results (bench/README.md names
# them); the suite's rewrite of the file keeps that part as it is
SEPARATE_SCRIPTS = "# Separate scripts"


@dataclass
class Row:
    key: str  # the measurement (--only name)
    metric: str  # what was timed or counted
    unit: str  # ms, s, MB, %
    p50: float | None
    high: float | None  # p99 when n >= 100, else the maximum
    n: int
    baseline: str  # the baseline's figure, formatted
    compare: str  # overhead and/or ratio against the baseline
    goal: str = ""  # the goal, when it has one
    verdict: str = ""  # "met" / "MISSED" against the goal; "" when there is none
    note: str = ""
    always_max: bool = False  # the p99/max column holds the maximum whatever n is

    @property
    def high_kind(self) -> str:
        return "p99" if self.n >= 100 and not self.always_max else "max"


def summary(values: list[float]) -> tuple[float, float]:
    """p50, and p99 (n >= 100) or the maximum (fewer samples: p99 would be the maximum anyway)."""
    high = percentile(values, 0.99) if len(values) >= 100 else max(values)
    return percentile(values, 0.5), high


def num(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    magnitude = abs(value)
    if magnitude >= 100:
        text = f"{value:.0f}"
    elif magnitude >= 10:
        text = f"{value:.1f}"
    elif magnitude >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3f}"
    return f"{text} {unit}".strip()


def ratio(value: float, base: float) -> str:
    if base <= 0 or math.isnan(base) or math.isnan(value):
        return "-"
    return f"x{value / base:.2f}"


def overhead(value: float, base: float, unit: str) -> str:
    return f"{'+' if value >= base else ''}{num(value - base, unit)} ({ratio(value, base)})"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


HEADER = ("measurement", "metric", "n", "p50", "p99/max", "baseline", "vs baseline", "goal")


def cells(row: Row) -> tuple[str, ...]:
    goal = f"{row.goal}: {row.verdict}" if row.goal else ""
    return (
        row.key,
        row.metric,
        str(row.n),
        num(row.p50, row.unit),
        f"{num(row.high, row.unit)} ({row.high_kind})" if row.high is not None else "-",
        row.baseline,
        row.compare,
        goal,
    )


def text_table(rows: list[Row]) -> str:
    table = [HEADER, *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(rows: list[Row]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(_md(c) for c in cells(row)) + " |" for row in rows]
    return "\n".join(out)


def write_results(
    path: Path,
    *,
    rows: list[Row],
    machine: dict[str, str],
    command: str,
    wall: float,
    durations: dict[str, float],
    run_id: str,
    load: tuple[str, str],
    problems: list[str],
) -> None:
    lines = [
        "# Benchmark results",
        "",
        f"Produced by `{command}` (run `{run_id}`), in {wall:.0f} s of wall time "
        f"({wall / 60:.1f} min) including setup and cleanup. See bench/README.md for what each "
        "row means and how its baseline is measured. The bench reports; it asserts nothing: "
        "the goal column compares against the issue's goals.",
        "",
        "## Machine",
        "",
        *(f"- {key}: {value}" for key, value in machine.items()),
        f"- load average (1/5/15 min) at start: {load[0]}; at end: {load[1]}",
        "",
        "## Results",
        "",
        markdown_table(rows),
        "",
        "## Notes",
        "",
        *(f"- **{row.key}** ({row.metric}): {row.note}" for row in rows if row.note),
        "",
        "## Time per measurement",
        "",
        *(f"- {name}: {seconds:.0f} s" for name, seconds in durations.items()),
    ]
    if problems:
        lines += ["", "## Problems", "", *(f"- {p}" for p in problems)]
    kept = separate_scripts(path)
    path.write_text("\n".join(lines) + "\n" + (f"\n{kept}" if kept else ""))


def separate_scripts(path: Path) -> str:
    """The part of an existing RESULTS.md from the separate scripts' heading on, or ""."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return ""
    found = ("\n" + text).find(f"\n{SEPARATE_SCRIPTS}\n")
    return "" if found < 0 else text[found:]
