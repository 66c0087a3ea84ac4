"""One finished request as the record's row: who, what, which build, how it ended, its times.

Only a request with a caller and a model the gateway routed is a row: a 401 has no caller, and
a body that broke or names no known model has no name the record may keep (the client's text is
never stored). The build and the weights revision are the engine's status.json's when the
request was admitted; a revision that may be another model's (an engine serving several names
whose status names another) is `unknown`, never a guess. The model and the engine are kept as
`names.kept` gives them: a name outside the served-name rule (a GGUF a library held before the
rule) is its digest form, never a reason to lose the row, so its tokens are charged as any.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Protocol

from supervisor import logs
from supervisor.host.proxy.forward import Trace
from supervisor.host.proxy.metrics import GatewayMetrics, build_label
from supervisor.host.record.row import Build, Row, RowRefused, refused, tokens_of
from supervisor.protocol.documents import Status
from supervisor.protocol.names import kept

log = logs.get("gateway")


class Recorder(Protocol):
    """What the gateway asks of the record (record.store.Store): never blocks, never raises."""

    def record(self, row: Row) -> bool: ...


@dataclass(frozen=True)
class Stamped:
    """A recorder whose every row names the machine that served it (a fleet's)."""

    recorder: Recorder
    machine: str

    def record(self, row: Row) -> bool:
        return self.recorder.record(replace(row, machine=self.machine))


def stamped(recorder: Recorder | None, machine: str | None) -> Recorder | None:
    """The recorder, its rows naming `machine` when there is one (the fleet on)."""
    return recorder if recorder is None or machine is None else Stamped(recorder, machine)


def build_of(status: Status | None, model: str) -> Build:
    """Pure: the build that served `model`, from the engine's status at admission."""
    running = status.engine if status is not None else None
    if running is None:
        return Build()
    build = Build.of(running)
    if len(status.models) > 1 and running.model != model:  # type: ignore[union-attr]
        return Build(build.engine_version, build.image_id)  # the revision is another model's
    return build


@dataclass(frozen=True)
class Request:
    """Who asked for what, and where it went."""

    key_id: str
    asked: str  # the tier or model name asked for
    model: str  # the model name the engine knows
    engine: str


def row_of(trace: Trace, asked: Request, now: float) -> Row:
    """Pure: the row of a finished request (`now` on the loop's clock). RowRefused for a value
    no row may hold."""
    outcome: str = trace.outcome or "client_gone"
    if outcome == "refused":
        outcome = refused(trace.code or "unknown")
    prompt, completion, cached = tokens_of(trace.usage)
    admitted = trace.admitted if trace.admitted is not None else now
    return Row(
        at=trace.at,
        key_id=asked.key_id,
        model=kept(asked.asked),
        engine=kept(asked.engine),
        build=build_of(trace.served_by, asked.model),
        outcome=outcome,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        wait_s=max(admitted - trace.arrived, 0.0),
        ttft_s=trace.first_byte - trace.arrived if trace.first_byte is not None else None,
        duration_s=max(now - trace.arrived, 0.0),
        usage_source=trace.usage_source,
    )


def record(
    recorder: Recorder | None, trace: Trace, asked: Request, now: float, *, keep: bool = False
) -> Row | None:
    """The row into the record, when there is one; a row refused is said, never raised. The
    row, when one was made: with a record, or when `keep` asks for it (a span's attributes)."""
    if recorder is None and not keep:
        return None
    try:
        row = row_of(trace, asked, now)
    except RowRefused as exc:
        if recorder is not None:
            log.warning("request not recorded", engine=asked.engine, reason=str(exc))
        return None
    if recorder is not None:
        recorder.record(row)
    return row


def count(metrics: GatewayMetrics, trace: Trace, model: str, engine: str, key: str) -> None:
    """The request in the metrics; a handler ended without an outcome lost its client."""
    m = metrics
    outcome = trace.outcome or "client_gone"
    m.child(m.requests, model, engine, outcome).inc()
    now = asyncio.get_running_loop().time()
    if trace.first_byte is not None:
        build = build_label(trace.served_by)
        m.child(m.ttft, engine, model, build).observe(trace.first_byte - trace.arrived)
    if outcome != "refused":
        m.child(m.duration, engine).observe(now - trace.arrived)
    m.usage(model, engine, key, trace.usage)
