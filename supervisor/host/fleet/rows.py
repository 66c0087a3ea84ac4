"""Pure: what a machine publishes of each of its engines, and the form the catalog stores it in.

A gateway publishes one row per engine of its data directory (`rows_of`): its models and what
each serves, its state, build, weights, admission counts, slots, the memory plan's verdict and
whether an operator stopped it, beside the machine's advertise URL. The catalog stores a row as
one JSON document (`document`), keyed by the engine's name as a JSON string (`engine_key`):
every string is escaped as JSON does, so a name with a NUL, a lone surrogate, a quote or a
terminal escape is stored, sent and read back as data. A row read from the
catalog was written by another machine (`read_row`): anything it does not hold in the form
written here is refused (None), never guessed at, and a state this version does not know is
`unavailable` (never routed to, still shown).

A row's `heard` is its machine's heartbeat, on this machine's clock: the catalog turns the
database's age of the heartbeat into a time here, so the machines' clocks need not agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final, Literal, TypeGuard, get_args

from supervisor.host.proxy.catalog import CatalogEntry
from supervisor.host.proxy.metrics import build_label
from supervisor.protocol.documents import MAX_MODELS, Capability, capabilities

# a peer engine's state: status.json's, or `unavailable` while no worker answers for it
PeerState = Literal["starting", "running", "stopping", "stopped", "failed", "unavailable"]
PEER_STATES: Final[tuple[PeerState, ...]] = get_args(PeerState)
# where a gateway is reached, as [fleet] advertise says it (sections.FleetSettings)
ADVERTISE: Final = re.compile(r"https?://[^/\s\x00-\x1f\x7f]+")
MAX_DOCUMENT: Final = 1024 * 1024  # characters of one stored row read back; larger: refused
_COUNT: Final = 10**9  # a count, a slot number, beyond which a row is not believed
_NEVER: Final = datetime.min


@dataclass(frozen=True)
class PeerEngine:
    """One engine of one machine, as that machine's gateway published it."""

    machine: str
    engine: str
    url: str  # the machine's gateway ([fleet] advertise), never the engine's own address
    models: tuple[str, ...]
    state: PeerState
    heard: datetime  # the machine's heartbeat, on this machine's clock
    declared: Mapping[str, tuple[Capability, ...]] = field(default_factory=dict)
    build: str | None = None  # `<engine version>@<image id's first 12 hex digits>` running
    weights: str | None = None  # the weights' revision, running
    running: int = 0  # requests its gateway runs on it now
    waiting: int = 0  # and holds for a slot
    slots: int | None = None  # the requests it holds at once (status.json); None: unknown
    fits: bool | None = None  # the memory plan's verdict on a start; None: no plan said
    plan: str = ""  # the plan's refusal, or why it could not plan; "" fits
    stopped_by_operator: bool = False  # an operator's stop: never started on demand

    def capabilities(self, model: str) -> tuple[Capability, ...] | None:
        """What the engine declares `model` serves; None while that is not known."""
        return self.declared.get(model)

    def fresh(self, now: datetime, stale_s: float) -> bool:
        """Whether its machine was heard from within `stale_s` of `now`."""
        return now - self.heard <= timedelta(seconds=stale_s)

    def published(self) -> PeerEngine:
        """The row as it is compared for a change: the heartbeat is no change."""
        return replace(self, heard=_NEVER)


@dataclass(frozen=True)
class Machine:
    """One machine of the catalog, for a listing: its gateway, its heartbeat, its engines."""

    name: str
    url: str
    heard: datetime
    stale: bool
    engines: tuple[PeerEngine, ...]


def rows_of(
    machine: str,
    advertise: str,
    entries: Iterable[CatalogEntry],
    counts: Mapping[str, tuple[int, int]],
    now: datetime,
) -> list[PeerEngine]:
    """The rows this machine publishes: one per engine of its catalog, by name; `counts`:
    engine -> (running, waiting), the gateway's admission."""
    rows = []
    for entry in sorted(entries, key=lambda found: found.name):
        status = entry.status
        running = status.engine if status is not None else None
        memory = status.memory if status is not None else None
        at_once, waiting = counts.get(entry.name, (0, 0))
        state: PeerState = "unavailable"
        if status is not None and entry.fresh(now):
            state = status.state
        rows.append(
            PeerEngine(
                machine=machine,
                engine=entry.name,
                url=advertise,
                models=entry.models,
                state=state,
                heard=now,
                declared=dict(status.capabilities) if status is not None else {},
                build=build_label(status) if running is not None else None,
                weights=running.model_revision if running is not None else None,
                running=at_once,
                waiting=waiting,
                slots=entry.slots,
                fits=memory.fits if memory is not None else None,
                plan=memory.message if memory is not None else "",
                stopped_by_operator=entry.desired is not None and entry.desired.operator_stop,
            )
        )
    return rows


def document(row: PeerEngine) -> str:
    """The row's stored form: JSON, ASCII only (every other character escaped)."""
    return json.dumps(
        {
            "models": list(row.models),
            "capabilities": {model: list(caps) for model, caps in row.declared.items()},
            "state": row.state,
            "build": row.build,
            "weights": row.weights,
            "running": row.running,
            "waiting": row.waiting,
            "slots": row.slots,
            "fits": row.fits,
            "plan": row.plan,
            "stoppedByOperator": row.stopped_by_operator,
        },
        separators=(",", ":"),
        sort_keys=True,
    )


def engine_key(engine: str) -> str:
    """An engine's name as the catalog keys it: a JSON string (no NUL, no lone surrogate)."""
    return json.dumps(engine)


def read_key(text: object) -> str | None:
    """An engine's name from its key; None when the key is not one."""
    if not isinstance(text, str) or len(text) > MAX_DOCUMENT:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, str) else None


def machine_document(url: str) -> str:
    """A machine's stored form: its gateway's URL, as JSON."""
    return json.dumps({"url": url})


def read_url(text: object) -> str | None:
    """A machine's URL from its stored form; None when it is not one (the machine is left out)."""
    found = _loads(text)
    url = found.get("url") if found is not None else None
    return url if isinstance(url, str) and ADVERTISE.fullmatch(url) else None


def read_row(
    machine: str, engine: str, url: str, text: object, heard: datetime
) -> PeerEngine | None:
    """A row another machine stored; None when it is not in the form `document` writes."""
    found = _loads(text)
    if found is None:
        return None
    models = found.get("models")
    declared = found.get("capabilities")
    if not (
        isinstance(models, list)
        and len(models) <= MAX_MODELS
        and all(isinstance(model, str) for model in models)
        and isinstance(declared, dict)
        and len(declared) <= MAX_MODELS
        and all(isinstance(names, list) for names in declared.values())
    ):
        return None
    state = found.get("state")
    build, weights, plan = found.get("build"), found.get("weights"), found.get("plan")
    running, waiting, slots = found.get("running"), found.get("waiting"), found.get("slots")
    fits, stopped = found.get("fits"), found.get("stoppedByOperator")
    if not (
        isinstance(state, str)
        and _text(build)
        and _text(weights)
        and isinstance(plan, str)
        and _count(running)
        and _count(waiting)
        and (slots is None or _count(slots))
        and (fits is None or isinstance(fits, bool))
        and isinstance(stopped, bool)
    ):
        return None
    return PeerEngine(
        machine=machine,
        engine=engine,
        url=url,
        models=tuple(models),
        state=_state(state),
        heard=heard,
        declared={model: capabilities(names) for model, names in declared.items()},
        build=build,
        weights=weights,
        running=running,
        waiting=waiting,
        slots=slots,
        fits=fits,
        plan=plan,
        stopped_by_operator=stopped,
    )


def _loads(text: object) -> dict[str, Any] | None:
    if not isinstance(text, str) or len(text) > MAX_DOCUMENT:
        return None
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def _state(value: str) -> PeerState:
    for known in PEER_STATES:
        if value == known:
            return known
    return "unavailable"  # a newer gateway's state: shown, never routed to


def _text(value: object) -> TypeGuard[str | None]:
    return value is None or isinstance(value, str)


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= _COUNT
