"""The worker's side of the plan: claim a start's memory under the ledger's lock, or refuse it.

Run by the Check step before any Start or replacement. What counts as held is what runs: the
names of the running lucia containers (any worker's, a stopped worker's too) keep their claims;
a claim whose start is still in progress holds while its worker lives. The container this start
replaces is the same name, so its claim is replaced, not counted, and what it frees is credited
to the check against the memory free now. The settings file is read at each check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from supervisor.docker import labels
from supervisor.errors import MemoryBlocked, Permanent
from supervisor.memplan import probe, settings
from supervisor.memplan.fit import Budget, Holding, Verdict, check, check_now
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed
from supervisor.memplan.probe import Memory
from supervisor.memplan.settings import MachineSettings


class Containers(Protocol):
    """What the plan asks of the Docker side (the runtime): the labels of the running
    containers carrying a label."""

    def running_labels(self, label: str) -> Sequence[Mapping[str, str]]: ...


@dataclass(frozen=True)
class Room:
    """The machine as a plan sees it: its settings, its memory, what the others hold."""

    settings: MachineSettings
    memory: Memory
    held: tuple[Holding, ...] = ()

    @property
    def budget(self) -> Budget:
        return Budget(self.memory.limit, self.settings.reserves.total, self.held, self.memory.host)


def load_settings() -> MachineSettings:
    try:
        return settings.load()
    except settings.MachineError as exc:
        raise Permanent(f"the machine memory settings cannot be used: {exc}") from None


def measure(machine: MachineSettings, gpu: probe.GpuQuery = probe.nvidia_smi_query) -> Memory:
    try:
        return probe.measure(machine, gpu=gpu)
    except (probe.ProbeFailed, OSError) as exc:
        raise Permanent(f"cannot measure the memory limit: {exc}") from None


def room(guard: Guard | None) -> Room:
    """The room now; what the others hold counts only with a ledger to read it from."""
    machine = load_settings()
    if guard is None:
        return Room(machine, measure(machine))
    held = guard.ledger.held(running_engines(guard.runtime), exclude=guard.name)
    return Room(machine, guard.measure(machine), held)


def running_engines(runtime: Containers) -> set[str]:
    """The names of the running lucia engines, from their containers' labels."""
    found = runtime.running_labels(f"{labels.MANAGED}=true")
    return {marks[labels.NAME] for marks in found if labels.NAME in marks}


@dataclass
class Guard:
    name: str
    ledger: Ledger
    runtime: Containers
    measure: Callable[[MachineSettings], Memory] = measure
    last: Verdict | None = field(default=None, init=False)  # for the worker's gauges
    limit: int | None = field(default=None, init=False)
    pending: bool = field(default=False, init=False)  # a claim made whose start has not run

    @classmethod
    def for_data_dir(cls, name: str, data_dir: Path, runtime: Containers) -> Guard:
        return cls(name, Ledger.for_data_dir(data_dir), runtime)

    def claim(self, need: EngineNeed, replacing: str | None) -> Verdict:
        """Record need as this engine's claim, or raise the refusal: Blocked when what others
        hold or use is in the way (it may pass by waiting), Permanent when it cannot fit."""
        machine = load_settings()
        running = running_engines(self.runtime)
        releasing = self.own_claim() if replacing else 0
        reserves = machine.reserves.total

        def decide(held: tuple[Holding, ...]) -> Verdict:
            memory = self.measure(machine)
            self.limit = memory.limit
            planned = check(need, Budget(memory.limit, reserves, held))
            if not planned.fits:
                return planned
            return check_now(need, memory.available, reserves, releasing)

        verdict = self.ledger.claim(self.name, running, decide)
        self.last = verdict
        if not verdict.fits:
            raise (MemoryBlocked if verdict.waitable else Permanent)(verdict.message)
        self.pending = True
        return verdict

    def own_claim(self) -> int:
        """The bytes this engine's own claims record: what a replacement of its running
        container frees."""
        return sum(c.bytes for c in self.ledger.claims() if c.name == self.name)

    def started(self, container_id: str | None) -> None:
        """The start made container_id (its claim now holds while it runs), or failed (the
        claim is dropped: nothing was allocated)."""
        self.pending = False
        if container_id is None:
            self.ledger.release(self.name)
        else:
            self.ledger.attach(self.name, container_id)

    def abandon(self, running: str | None) -> bool:
        """The start a claim was made for will not run (a stop, a failure or a new request came
        first): the claim now holds for the container that still runs (a replacement that did
        not happen), or is dropped. Whether there was such a claim; raises OSError when the
        ledger cannot be written (the claim then stays pending, to be settled later)."""
        if not self.pending:
            return False
        if running is None:
            self.ledger.release(self.name)
        else:
            self.ledger.attach(self.name, running)
        self.pending = False
        return True
