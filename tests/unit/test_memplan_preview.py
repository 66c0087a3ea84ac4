"""The plan a worker publishes in status.json: the Check step's two checks, claiming nothing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from supervisor.docker import labels
from supervisor.errors import Permanent
from supervisor.memplan.fit import Budget
from supervisor.memplan.guard import Guard
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed, figures
from supervisor.memplan.preview import NOT_PLANNED, Need, preview
from supervisor.memplan.probe import Memory

G = 1024**3
WHEN = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


@dataclass
class Running:
    """The runtime boundary as the guard uses it: these engines' containers run."""

    names: tuple[str, ...] = ()

    def running_labels(self, label: str) -> list[dict[str, str]]:
        assert label == f"{labels.MANAGED}=true"
        return [{labels.MANAGED: "true", labels.NAME: name} for name in self.names]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    machine = tmp_path / "machine.toml"
    machine.write_text(
        'limit = 100.0\nprofile = "gpu-server"\nweight_multiplier = 1.5\n[reserves]\nruntime = 10\n'
    )
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    return Ledger(tmp_path / "memory")


def _guard(name: str, ledger: Ledger, running: tuple[str, ...] = (), free: int = 100) -> Guard:
    def measure(_: object) -> Memory:
        return Memory("fixed", 100 * G, free * G)

    return Guard(name, ledger, Running(running), measure)


def _fixed(gib: int) -> EngineNeed:
    return EngineNeed("a", (figures("a", gib * G, 0, 0, multiplier=1),))


def _need(gib: int) -> Need:
    return lambda budget, multiplier: _fixed(gib)


def _hold(ledger: Ledger, name: str, gib: int) -> None:
    """name's start claims gib and runs (its claim holds while its container runs)."""
    other = _guard(name, ledger, running=(name,))
    other.claim(_fixed(gib), replacing=None)
    other.started(f"id-{name}")


@pytest.mark.parametrize(
    ("held", "running", "free", "need", "fits", "says"),
    [
        ({}, (), 100, 60, True, ""),  # 100 - 10 reserved: 90 left
        ({}, (), 100, 95, False, "does not fit after"),  # more than the limit less reserves
        ({"b": 40}, ("b",), 100, 60, False, "held by b"),  # the plan counts b's claim
        ({"b": 40}, (), 100, 60, True, ""),  # b's claim does not hold: its container is gone
        ({}, (), 50, 60, False, "in the memory free now"),  # used outside lucia
        ({"a": 60}, ("a",), 30, 60, True, ""),  # its own claim is freed by a replacement
        ({"a": 60}, (), 30, 60, False, "in the memory free now"),  # ...only while it runs
    ],
)
def test_the_plan_of_a_start(
    ledger: Ledger,
    held: dict[str, int],
    running: tuple[str, ...],
    free: int,
    need: int,
    fits: bool,
    says: str,
) -> None:
    for name, gib in held.items():
        _hold(ledger, name, gib)
    before = ledger.claims()
    plan = preview(_guard("a", ledger, running, free), _need(need), clock=lambda: WHEN)
    assert plan is not None
    assert (plan.need, plan.fits) == (need * G, fits)
    assert says in plan.message and bool(plan.message) == (not fits)
    assert (plan.limit, plan.limit_source, plan.planned_at) == (100 * G, "fixed", WHEN)
    assert plan.reserves.runtime == 10 * G and plan.reserves.voice == 0
    assert ledger.claims() == before  # nothing claimed, nothing released


def test_a_recipe_not_yet_planned_is_said_and_not_refused(ledger: Ledger) -> None:
    plan = preview(_guard("a", ledger), lambda budget, multiplier: None)
    assert plan is not None and (plan.need, plan.fits, plan.message) == (None, True, NOT_PLANNED)


def test_a_need_that_cannot_be_planned_says_why(ledger: Ledger) -> None:
    def unreadable(budget: Budget, multiplier: float) -> EngineNeed:
        raise Permanent("model x: the GGUF header \x1b[31mcannot be read")

    plan = preview(_guard("a", ledger), unreadable)
    assert plan is not None and (plan.need, plan.fits) == (None, False)
    assert plan.message == "model x: the GGUF header cannot be read"  # one clean line


def test_no_plan_without_machine_settings_it_can_use(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('limit = "plenty"\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(bad))
    assert preview(_guard("a", ledger), _need(1)) is None


def test_the_need_is_planned_in_the_budget_the_others_leave(ledger: Ledger) -> None:
    _hold(ledger, "b", 30)
    seen: list[tuple[int, float]] = []

    def need(budget: Budget, multiplier: float) -> EngineNeed:
        seen.append((budget.left, multiplier))  # a router's auto context is sized in it
        return EngineNeed("a", (figures("a", 10 * G, 0, 0, multiplier=multiplier),))

    plan = preview(_guard("a", ledger, running=("b",)), need)
    assert seen == [(60 * G, 1.5)]  # 100 - 10 reserved - 30 held by b; the file's multiplier
    assert plan is not None and plan.need == 15 * G
