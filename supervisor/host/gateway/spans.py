"""Tracing's pure parts: the receiver's URL, a request span's children and attributes, W3C.

No OpenTelemetry here: with tracing off the gateway uses only `passed_on`, so a caller's
trace context (W3C's traceparent and tracestate) still reaches the engine, and nothing else is
made.

A request's span runs from its arrival to its last byte, with a child for each stretch it
went through: `lucia.wait` (from asking its engine's gate to a slot, a start on demand
included), `lucia.start` (the wait for a start on demand), `lucia.dial` (from sending the
request upstream to the engine's answer's head) and `lucia.answer` (from that head to the
end). A stretch that never began has no span; one the request left in (a refusal, a client
gone, the deadline) ends when the request did.

Its attributes are the record's row (record/row.py), whose every string is a name checked
against a rule with no room for prose: the key's id (never the key), the model asked for and
the engine, its build, the outcome, the tokens and where they came from. No prompt, answer or
message text exists in a row, so none can reach a span.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from supervisor.host.proxy.forward import Trace
from supervisor.host.record.row import Row

SERVICE_NAME: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # [tracing] service_name
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; a later version may add
# fields after a dash, version 00 none; version ff and all-zero ids are invalid
_PARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16
# tracestate: at most 32 list members of printable ASCII; kept as it came, bounded
_STATE: Final = re.compile(r"[\x20-\x7e]{1,512}")

WAIT: Final = "lucia.wait"
START: Final = "lucia.start"
DIAL: Final = "lucia.dial"
ANSWER: Final = "lucia.answer"

Attributes = dict[str, str | int | float]


def receiver_url(value: str) -> str:
    """Pure: `[tracing] endpoint`, an OTLP/HTTP receiver's base URL with its trailing / dropped
    ("" for off), or ValueError naming the rule. No credentials in it (they would be in the
    settings file and the journal: OTEL_EXPORTER_OTLP_HEADERS gives a receiver's headers), no
    query and no fragment."""
    if not value:
        return value
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError('an OTLP/HTTP base URL: http(s)://host:port[/prefix], or "" (off)')
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "no credentials in the URL: give the receiver's headers in the environment "
            "(OTEL_EXPORTER_OTLP_HEADERS)"
        )
    if parts.query or parts.fragment:
        raise ValueError("no query or fragment: spans go to <endpoint>/v1/traces")
    _ = parts.port  # its ValueError names a port out of range
    return value.rstrip("/")


def valid_traceparent(value: str) -> bool:
    """Pure: whether a traceparent header keeps the W3C format (its version-00 form, or a
    later version's first four fields)."""
    found = _PARENT.fullmatch(value)
    if found is None:
        return False
    version, trace_id, parent_id, _, rest = found.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return False
    return not (version == "00" and rest is not None)


def passed_on(headers: Mapping[str, str]) -> dict[str, str] | None:
    """Pure: the caller's trace context as the engine gets it with tracing off: a valid
    traceparent unchanged, with its tracestate when that is printable ASCII of at most 512
    characters; None when the caller sent no valid traceparent."""
    parent = headers.get(TRACEPARENT)
    if parent is None or not valid_traceparent(parent):
        return None
    state = headers.get(TRACESTATE)
    if state is not None and _STATE.fullmatch(state):
        return {TRACEPARENT: parent, TRACESTATE: state}
    return {TRACEPARENT: parent}


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """Pure: the W3C traceparent (version 00) naming this span."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


@dataclass(frozen=True, slots=True)
class Stretch:
    """One child span: its name and times on the loop's clock."""

    name: str
    start: float
    end: float


def stretches(trace: Trace, end: float) -> list[Stretch]:
    """Pure: the children of a request's span that ended at `end`, in order of their start."""
    found: list[Stretch] = []

    def add(name: str, start: float | None, stop: float | None) -> None:
        if start is not None:
            found.append(Stretch(name, start, max(stop if stop is not None else end, start)))

    add(WAIT, trace.queued, trace.admitted)
    add(START, trace.starting, trace.started)
    add(DIAL, trace.sent, trace.answered)
    add(ANSWER, trace.answered, end)
    return found


def row_attributes(row: Row) -> Attributes:
    """Pure: a span's attributes from its request's row: names, counts and seconds only."""
    found: Attributes = {
        "lucia.key_id": row.key_id,
        "lucia.model": row.model,
        "lucia.engine": row.engine,
        "lucia.build.engine_version": row.build.engine_version,
        "lucia.build.image_id": row.build.image_id,
        "lucia.build.weights_revision": row.build.weights_revision,
        "lucia.outcome": row.outcome,
        "lucia.usage_source": row.usage_source,
        "lucia.wait_s": row.wait_s,
        "lucia.duration_s": row.duration_s,
    }
    for name, value in (
        ("lucia.prompt_tokens", row.prompt_tokens),
        ("lucia.completion_tokens", row.completion_tokens),
        ("lucia.cached_tokens", row.cached_tokens),
        ("lucia.ttft_s", row.ttft_s),
    ):
        if value is not None:
            found[name] = value
    return found
