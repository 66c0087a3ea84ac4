"""The probe's decisions, pure: which models to probe now, and what an answer means.

An engine is probed only while it serves (running, its worker's heartbeat fresh, nobody asked
it to stop, not being stopped for idling): a probe never starts an engine, and never keeps one
from idling (it takes no admission slot, so the idle clock does not see it). It is skipped
while its slots are full or a request waits (`free`): a probe never holds a user's request
back, nor waits behind one. Of an engine's models, those it has loaded are probed: the names
its status.json gives `slots` for (a router's loaded models, vLLM's first served name), else
the one model of an engine that serves one; a router that publishes no slots is not probed, so
a probe never loads a model. A model whose status.json declares what it serves and not text
completions (an embedding model) is not probed: a probe asks for a completion.

Each model is probed at once when its engine begins a run (a new `since` or container), then
every interval. A probe's answer (`verdict`): a 2xx answer with a choice is `ok`; a 5xx, an
answer with no choice, a broken or refused connection and a timeout are `failed`; a 4xx, and a
501 (a route the server does not implement, as llama-server answers an embedding route it does
not serve), are `inconclusive` (the engine answered and refused the request itself, as an
embedding model refuses a completion: it can be reached and it reasons, so the mark it had
stands). A model
whose last conclusive probe failed is `degraded` until one succeeds, or its engine's run ends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from supervisor.host.proxy.catalog import CatalogEntry
from supervisor.protocol.documents import Status

Verdict = Literal["ok", "failed", "inconclusive"]
NOT_IMPLEMENTED: Final = 501  # the route is not the engine's: as a 4xx, the engine refused it
# how a probe ended: an answer (its HTTP status), or none
Ended = Literal["answered", "timed_out", "unreachable", "broken"]
PROMPT: Final = "Hello"  # the probe's own text: a constant, never a user's
PATH: Final = "/v1/completions"
Run = tuple[datetime, str]  # an engine's run: its state's `since` and its container


@dataclass(frozen=True)
class ProbeTarget:
    """One model of a serving engine, to probe now."""

    engine: str
    model: str
    url: str
    status: Status
    run: Run


def run_of(status: Status) -> Run:
    """Pure: what tells one run of an engine from the next."""
    container = status.engine.container_id if status.engine is not None else None
    return status.since, container or ""


def probed_models(status: Status) -> tuple[str, ...]:
    """Pure: the models a probe may ask for without loading one (module docstring)."""
    if status.slots:
        loaded = tuple(sorted(model for model in status.slots if model in status.models))
    else:
        loaded = status.models if len(status.models) == 1 else ()
    return tuple(model for model in loaded if _completes(status, model))


def _completes(status: Status, model: str) -> bool:
    """Whether a model may be asked for a completion: it declares one, or declares nothing."""
    declared = status.capabilities.get(model)
    return declared is None or "completion" in declared


def body(model: str) -> dict[str, Any]:
    """The probe's request: one token of a text completion, greedy, not streamed (its answer's
    first byte comes with the token)."""
    return {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": False}


@dataclass(frozen=True)
class Last:
    """When a model was last probed, in which run of its engine (the loop's clock)."""

    at: float
    run: Run


def due(last: Last | None, run: Run, now: float, interval_s: float) -> bool:
    """Pure: probe now? At once in a new run, then every interval."""
    return last is None or last.run != run or now - last.at >= interval_s


def targets(
    engines: Iterable[CatalogEntry],
    when: datetime,
    now: float,
    *,
    last: Mapping[tuple[str, str], Last],
    interval_s: float,
    busy: Collection[tuple[str, str]] = (),
    stopping: Collection[str] = (),
    free: Callable[[CatalogEntry], bool] = lambda _: True,
) -> list[ProbeTarget]:
    """Pure: what to probe now (`when`: the wall clock, for the heartbeat; `now`: the loop's);
    `busy`: probes still in flight, never sent twice; `stopping`: engines being stopped for
    idling. Nothing when the probe is off (`interval_s` 0)."""
    if interval_s <= 0:
        return []
    found: list[ProbeTarget] = []
    for engine in engines:
        url = engine.url(when)
        status = engine.status
        if url is None or status is None or engine.name in stopping or not free(engine):
            continue
        run = run_of(status)
        for model in probed_models(status):
            key = (engine.name, model)
            if key not in busy and due(last.get(key), run, now, interval_s):
                found.append(ProbeTarget(engine.name, model, url, status, run))
    return found


@dataclass(frozen=True)
class ProbeAnswer:
    """How one probe ended: `status` is the HTTP status when it was answered."""

    ended: Ended
    status: int | None = None
    choices: int = 0  # choices in a 2xx answer's body


def verdict(answer: ProbeAnswer) -> Verdict:
    """Pure: what the answer says of the engine (module docstring)."""
    if answer.ended != "answered" or answer.status is None:
        return "failed"
    if 200 <= answer.status < 300:
        return "ok" if answer.choices > 0 else "failed"
    if 400 <= answer.status < 500 or answer.status == NOT_IMPLEMENTED:
        return "inconclusive"
    return "failed"


def outcome(answer: ProbeAnswer) -> str:
    """Pure: the probe's outcome, as the record and the metrics name a request's."""
    if answer.ended == "timed_out":
        return "timed_out"
    if answer.ended != "answered":
        return "engine_failed"
    return "ok" if verdict(answer) == "ok" else "engine_error"


def reason(answer: ProbeAnswer, timeout_s: float) -> str:
    """Pure: why a probe failed, in one line with no answer text in it."""
    if answer.ended == "timed_out":
        return f"no answer within {timeout_s:g} s"
    if answer.ended == "unreachable":
        return "the engine could not be reached"
    if answer.ended == "broken":
        return "the engine broke off its answer"
    if answer.status is not None and 200 <= answer.status < 300:
        return "the answer held no generated choice"
    return f"the engine answered {answer.status}"


@dataclass(frozen=True)
class Mark:
    """A model's mark from its probes: `degraded` since its last conclusive probe failed."""

    run: Run
    degraded: bool = False
    reason: str = ""  # why the last conclusive probe failed
    checked_at: datetime | None = None  # the wall clock of the last probe's end
    ttft_s: float | None = None  # of the last probe that succeeded

    def shown(self) -> dict[str, Any]:
        """As /v1/models and the page show it."""
        return {
            "degraded": self.degraded,
            "reason": self.reason or None,
            "checkedAt": _iso(self.checked_at),
            "ttftS": round(self.ttft_s, 4) if self.ttft_s is not None else None,
        }


def after(
    health: Mark | None,
    run: Run,
    answer: ProbeAnswer,
    *,
    at: datetime,
    ttft_s: float | None,
    timeout_s: float,
) -> Mark:
    """Pure: a model's mark once a probe of it ended. A new run starts from a clean mark; an
    inconclusive answer keeps the mark it had."""
    known = health if health is not None and health.run == run else Mark(run)
    found = verdict(answer)
    if found == "ok":
        return Mark(run, False, "", at, ttft_s)
    if found == "failed":
        return Mark(run, True, reason(answer, timeout_s), at, known.ttft_s)
    return Mark(run, known.degraded, known.reason, at, known.ttft_s)


def current(health: Mark | None, status: Status | None) -> Mark | None:
    """Pure: a mark that still holds: its engine serves in the same run (a stopped engine, or a
    new run, has none until it is probed)."""
    if health is None or status is None or status.state != "running":
        return None
    return health if health.run == run_of(status) else None


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
