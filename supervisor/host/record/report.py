"""The usage figures for a person (a table) or a program (JSON), and `--since` read, all pure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any, Final

from supervisor.host.record.queries import GROUPS, By, Line
from supervisor.host.record.row import REFUSED

_SPAN: Final = re.compile(r"([1-9][0-9]{0,5})([mhdw])")
_UNIT: Final = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
HEADINGS: Final[dict[str, str]] = {
    "key_id": "KEY",
    "model": "MODEL",
    "engine": "ENGINE",
    "engine_version": "VERSION",
    "image_id": "IMAGE",
    "weights_revision": "WEIGHTS",
}
JSON_NAMES: Final[dict[str, str]] = {
    "key_id": "keyId",
    "model": "model",
    "engine": "engine",
    "engine_version": "engineVersion",
    "image_id": "imageId",
    "weights_revision": "weightsRevision",
}
_SHORT_IMAGE: Final = len("sha256:") + 12


class BadSince(ValueError):
    pass


def _out_of_range(text: str) -> BadSince:
    return BadSince(f"--since {text!r}: out of range, before the year 1 or after 9999 (UTC)")


def parse_since(text: str, now: datetime) -> datetime:
    """A span back from now (30m, 12h, 1d, 2w), an ISO date (that day's start, UTC) or an ISO
    time with its offset; BadSince for anything else, or a time no datetime holds."""
    found = _SPAN.fullmatch(text)
    if found:
        try:
            return now - timedelta(**{_UNIT[found.group(2)]: int(found.group(1))})
        except OverflowError:  # 999999w: 19,000 years back
            raise _out_of_range(text) from None
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        return datetime(day.year, day.month, day.day, tzinfo=UTC)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        at = None
    if at is None or at.utcoffset() is None:
        raise BadSince(
            f"--since {text!r}: a span (30m, 12h, 1d, 2w), an ISO date (2026-05-01) or an ISO "
            "time with its offset (2026-05-01T08:00:00+02:00)"
        )
    try:
        return at.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00:00+05:00 is in the year 0 in UTC
        raise _out_of_range(text) from None


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _counts(counts: Mapping[str, int]) -> str:
    return " ".join(f"{name}={count}" for name, count in sorted(counts.items())) or "-"


def _cell(column: str, value: str) -> str:
    if column == "image_id" and value.startswith("sha256:"):
        return value[:_SHORT_IMAGE]
    return value


def failed(line: Line) -> dict[str, int]:
    """The outcomes that are neither ok nor a refusal: errors, timeouts, clients gone."""
    return {
        outcome: count
        for outcome, count in line.outcomes.items()
        if outcome != "ok" and not outcome.startswith(REFUSED)
    }


def table(lines: Sequence[Line], by: By, names: Mapping[str, str] | None = None) -> str:
    """The figures as aligned columns; with `names`, a key's name beside its id."""
    columns = GROUPS[by]
    header = [HEADINGS[c] for c in columns]
    named = by == "key" and names is not None
    if named:
        header.append("NAME")
    header += [
        "REQUESTS",
        "OK",
        "PROMPT",
        "COMPLETION",
        "CACHED",
        "TTFT P50 S",
        "TTFT P95 S",
        "REFUSED",
        "FAILED",
    ]
    rows = [header]
    for line in lines:
        cells = [_cell(c, v) for c, v in zip(columns, line.group, strict=True)]
        if named:
            assert names is not None
            cells.append(names.get(line.group[0], "-"))
        cells += [
            str(line.requests),
            str(line.outcomes.get("ok", 0)),
            str(line.prompt_tokens),
            str(line.completion_tokens),
            str(line.cached_tokens),
            _seconds(line.ttft_p50),
            _seconds(line.ttft_p95),
            _counts(line.refusals),
            _counts(failed(line)),
        ]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def as_json(
    lines: Sequence[Line], by: By, since: datetime, names: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The figures as one JSON document: the same as the table, image ids whole."""
    groups = []
    for line in lines:
        entry: dict[str, Any] = {
            JSON_NAMES[column]: value for column, value in zip(GROUPS[by], line.group, strict=True)
        }
        if by == "key" and names is not None:
            entry["name"] = names.get(line.group[0])
        entry.update(
            requests=line.requests,
            ok=line.outcomes.get("ok", 0),
            promptTokens=line.prompt_tokens,
            completionTokens=line.completion_tokens,
            cachedTokens=line.cached_tokens,
            ttftSeconds={"p50": line.ttft_p50, "p95": line.ttft_p95},
            refusals=line.refusals,
            failed=failed(line),
            outcomes=dict(sorted(line.outcomes.items())),
        )
        groups.append(entry)
    return {"since": since.isoformat(), "by": by, "groups": groups}
