"""What the engines serve, from their status.json files, and which of them a request goes to.

The host never reads a recipe: each worker writes its engine's model names into status.json
(`models`), in every state; desired.json says what was last asked of each, and by whom. A file
is parsed again only when it was replaced (both are written by rename) or changed.

Several engines may serve one model. A request goes to one that declares the capability its
route asks for (or whose capabilities are not known) before one whose declaration leaves it
out (capability.py); of those, to the first, by name, of the best kind there is (`route`): one
serving with a slot free now, then one serving (its gate queues), then one whose start is under
way, then one that may be started on demand (a fresh worker, and no operator's stop). Only when
none of these exists does it go to an engine that cannot serve, whose refusal then says why:
an operator's stop before a worker gone silent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from supervisor.host.protocol import STALE_AFTER
from supervisor.host.proxy import capability
from supervisor.host.proxy.starter import Step, plan
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import Capability, DesiredFile, Status, utc_now
from supervisor.protocol.layout import DESIRED, STATUS, BadName, check_name
from supervisor.protocol.reads import load_status, read_desired

_SHOWN: Final = 50  # model names listed in a 404


# a request's engine, best first, by its start plan; "ready" splits by a free slot
_RANK: Final[dict[Step, int]] = {
    "ready": 1,
    "follow": 2,
    "request": 3,
    "stopped": 4,
    "unavailable": 5,
}


@dataclass(frozen=True)
class CatalogEntry:
    """One engine as the host sees it: its name, its status.json and its desired.json."""

    name: str
    status: Status | None
    desired: DesiredFile | None = None

    def fresh(self, now: datetime) -> bool:
        return self.status is not None and now - self.status.checked_at <= STALE_AFTER

    def url(self, now: datetime) -> str | None:
        """Where it serves: running, its worker alive, and nobody has asked it to stop."""
        found = plan(self.desired, self.status, now)
        return found.url if found.step == "ready" else None

    @property
    def models(self) -> tuple[str, ...]:
        return self.status.models if self.status is not None else ()

    def capabilities(self, model: str) -> tuple[Capability, ...] | None:
        """What its worker declares `model` serves; None while that is not known."""
        found = self.status.capabilities if self.status is not None else {}
        return found.get(model)

    @property
    def slots(self) -> int | None:
        """The requests it holds at once, as its worker publishes them while it runs: the sum
        over its loaded models (each has slots of its own); None while none is published."""
        found = self.status.slots if self.status is not None else {}
        return sum(found.values()) if found else None


def route(
    model: str,
    engines: list[CatalogEntry],
    tiers: dict[str, str],
    now: datetime,
    free: Callable[[CatalogEntry], bool] = lambda _: True,
    *,
    path: str = "",
) -> tuple[CatalogEntry, str]:
    """Pure: the engine that serves `model` (a tier alias resolved first), and the model
    name it knows; 404 naming the models that exist. Of several, one that does not refuse
    `path` (capability.py) first, then the best kind (the module's order; `free`: whether a
    serving engine would run a request at once), then by name."""
    name = tiers.get(model, model)
    serving = [engine for engine in engines if name in engine.models]
    if serving:

        def order(engine: CatalogEntry) -> tuple[bool, int, str]:
            refuses = capability.serves(engine.capabilities(name), path) is False
            return refuses, rank(engine, now, free), engine.name

        return min(serving, key=order), name
    known = sorted({m for engine in engines for m in engine.models} | set(tiers))
    shown = ", ".join(known[:_SHOWN]) + (", …" if len(known) > _SHOWN else "")
    raise Refusal(
        404,
        "model_not_found",
        f"The model `{model}` does not exist or is not served here. Models: {shown or 'none'}",
        param="model",
    )


def rank(engine: CatalogEntry, now: datetime, free: Callable[[CatalogEntry], bool]) -> int:
    """Pure: 0 serving with a slot free, 1 serving, 2 starting, 3 may be started on demand,
    4 stopped by an operator, 5 its worker unavailable."""
    step = plan(engine.desired, engine.status, now).step
    return 0 if step == "ready" and free(engine) else _RANK[step]


class Catalog:
    """The engines of a data directory, re-read as their status files change."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._seen: dict[str, tuple[tuple[int, ...], CatalogEntry]] = {}
        self._names: dict[str, bool] = {}  # a directory entry's name: an engine's, or not

    def _engine_name(self, name: str) -> bool:
        known = self._names.get(name)
        if known is None:
            try:
                known = check_name(name) == name
            except BadName:
                known = False
            self._names[name] = known
        return known

    def engines(self) -> list[CatalogEntry]:
        """Every engine with a status file, by name; a stat of its two files each (every
        request asks)."""
        found: dict[str, tuple[tuple[int, ...], CatalogEntry]] = {}
        root = str(self.data_dir)
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            names = []
        for name in names:
            if not self._engine_name(name):
                continue
            try:
                info = os.stat(os.path.join(root, name, STATUS))
            except OSError:
                continue
            stamp = _stamp(info) + _stamp(_stat(os.path.join(root, name, DESIRED)))
            known = self._seen.get(name)
            if known is not None and known[0] == stamp:
                found[name] = known
            else:
                directory = self.data_dir / name
                entry = CatalogEntry(name, load_status(directory), read_desired(directory))
                found[name] = (stamp, entry)
        self._seen = found
        return [engine for _, engine in found.values()]

    def engine(self, name: str) -> CatalogEntry:
        """One engine, read now."""
        directory = self.data_dir / check_name(name)
        return CatalogEntry(name, load_status(directory), read_desired(directory))

    @staticmethod
    def now() -> datetime:
        return utc_now()


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _stamp(info: os.stat_result | None) -> tuple[int, ...]:
    """A file's version: each write by rename is a new inode; (0, 0, 0) for none."""
    return (info.st_ino, info.st_mtime_ns, info.st_size) if info is not None else (0, 0, 0)
