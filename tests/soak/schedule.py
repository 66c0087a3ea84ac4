"""The soak's fault schedule: drawn from a seed, so that a seed replays the same schedule.

Pure: (seed, duration, engines) -> the faults, each at an offset from the start. Nothing here
touches the machine; run.py injects them and checker.py judges what the supervisor claimed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Final

KINDS: Final = (
    "request",  # one request, running or stopped
    "burst",  # several requests in quick succession
    "race",  # two requests written back to back, before the first is answered
    "recipe-edit",  # a setting the container is created with changes, then a reload
    "worker-kill",  # SIGKILL to the worker (systemd restarts it)
    "worker-stop",  # systemctl stop, a pause, systemctl start (the engine keeps running)
    "worker-reload",  # SIGHUP with nothing changed
    "dockerd-restart",  # dockerd stopped and started (its containers die with it)
    "dockerd-stall",  # SIGSTOP, a pause, SIGCONT
    "engine-kill",  # the engine container killed
    "engine-oom",  # the engine container killed for memory
    "disk-full",  # the data directory's file system filled, then freed
    "bad-desired",  # desired.json truncated, garbage or a directory, then fixed
)
# how often each is drawn, relative to the others: requests dominate, as on a real host
WEIGHTS: Final = (8, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 2)
_BAD: Final = ("truncated", "garbage", "directory")
MACHINE_WIDE: Final = ("dockerd-restart", "dockerd-stall", "disk-full")  # engine "*"
# the front door's (run.py --front-door): drawn beside the others, and each once more at a drawn
# time, so that every short soak has them
FRONT_DOOR: Final = (
    "gateway-kill",  # SIGKILL to the gateway (systemd restarts it)
    "record-down",  # the record's database stopped at once, a pause, started again
    "operator-stop",  # an operator stops the engine clients use, a pause, starts it again
)
FRONT_WEIGHTS: Final = (1, 1, 2)


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start
    kind: str
    engine: str
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"t+{self.at:6.1f}s {self.kind:<15} {self.engine} {extra}".rstrip()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def draw(
    seed: int,
    seconds: float,
    engines: tuple[str, ...],
    *,
    gap: tuple[float, float] = (3.0, 9.0),
    max_stall: float = 90.0,
    traffic: str | None = None,
) -> list[Fault]:
    """Faults at random gaps until `seconds`, leaving the last fifth for the system to settle
    (every generation must be answered by the end). `traffic`: the engine the front door's
    clients use; given, the front door's faults are drawn too (a seed without it draws the
    schedule it always drew)."""
    rng = random.Random(seed)
    kinds, weights = KINDS, WEIGHTS
    if traffic is not None:
        kinds, weights = KINDS + FRONT_DOOR, WEIGHTS + FRONT_WEIGHTS
    faults: list[Fault] = []
    at = rng.uniform(*gap)
    end = seconds * 0.8
    while at < end:
        kind = rng.choices(kinds, weights)[0]
        faults.append(_fault(rng, at, kind, engines, traffic, max_stall))
        at += rng.uniform(*gap)
    if traffic is not None:
        extra = random.Random(seed + 1)
        faults += [
            _fault(extra, extra.uniform(0.1, 0.8) * seconds, kind, engines, traffic, max_stall)
            for kind in FRONT_DOOR
        ]
        faults.sort(key=lambda f: f.at)
    return faults


def _fault(
    rng: random.Random,
    at: float,
    kind: str,
    engines: tuple[str, ...],
    traffic: str | None,
    max_stall: float,
) -> Fault:
    engine = rng.choice(engines)
    if kind in MACHINE_WIDE or kind in ("gateway-kill", "record-down"):
        engine = "*"
    elif kind == "operator-stop" and traffic is not None:
        engine = traffic
    return Fault(round(at, 1), kind, engine, _params(rng, kind, max_stall))


def _params(rng: random.Random, kind: str, max_stall: float) -> dict[str, Any]:
    match kind:
        case "request":
            return {"desired": rng.choice(("running", "running", "stopped"))}
        case "burst":
            return {"count": rng.randint(3, 6), "desired": rng.choice(("running", "stopped"))}
        case "race":
            return {
                "first": rng.choice(("running", "stopped")),
                "second": rng.choice(("running", "stopped")),
            }
        case "recipe-edit":
            return {"value": str(rng.randint(1000, 999_999))}
        case "worker-stop":
            return {"pause": round(rng.uniform(0.5, 4.0), 1)}
        case "dockerd-stall":
            return {"pause": round(rng.uniform(2.0, max_stall), 1)}
        case "disk-full":
            return {"pause": round(rng.uniform(1.0, 5.0), 1)}
        case "record-down" | "operator-stop":
            return {"pause": round(rng.uniform(1.0, 8.0), 1)}
        case "bad-desired":
            return {"how": rng.choice(_BAD), "pause": round(rng.uniform(0.5, 3.0), 1)}
    return {}
