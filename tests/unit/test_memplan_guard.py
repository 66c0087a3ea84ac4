"""The worker's side of the ledger: a claim made by a passed Check that its start never follows
(a stop, a failure or a newer request came first) is settled, not left to hold memory while
the worker lives."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import Permanent
from supervisor.memplan.guard import Guard
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed, figures
from supervisor.memplan.probe import Memory

G = 1024**3


class NoContainers:
    """The runtime boundary as the guard uses it: no lucia engine runs."""

    def running_labels(self, label: str) -> list[dict[str, str]]:
        return []


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    machine = tmp_path / "machine.toml"
    machine.write_text('limit = 100.0\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    return Ledger(tmp_path / "memory")


def _guard(name: str, ledger: Ledger) -> Guard:
    def measure(_: object) -> Memory:
        return Memory("fixed", 100 * G, 100 * G)

    return Guard(name, ledger, NoContainers(), measure)


def _need(name: str, gib: int) -> EngineNeed:
    return EngineNeed(name, (figures(name, gib * G, 0, 0, multiplier=1.0),))


def _held(ledger: Ledger) -> list[tuple[str, str | None]]:
    return [(c.name, c.container) for c in ledger.claims()]


def test_an_abandoned_start_drops_its_claim(ledger: Ledger) -> None:
    a, b = _guard("a", ledger), _guard("b", ledger)
    a.claim(_need("a", 60), replacing=None)
    with pytest.raises(Permanent, match=r"held by a 60\.0"):
        b.claim(_need("b", 60), replacing=None)
    assert a.abandon(running=None)
    assert _held(ledger) == []
    assert not a.abandon(running=None)  # settled once
    assert b.claim(_need("b", 60), replacing=None).fits


def test_an_abandoned_replacement_holds_for_the_engine_still_running(ledger: Ledger) -> None:
    a = _guard("a", ledger)
    a.claim(_need("a", 60), replacing=None)
    a.started("c1")
    a.claim(_need("a", 70), replacing="c1")  # the replacement's claim replaces c1's
    assert _held(ledger) == [("a", None)]
    assert a.abandon(running="c1")  # c1 serves on: it holds again, while it runs
    assert _held(ledger) == [("a", "c1")]


def test_a_started_claim_is_not_abandoned(ledger: Ledger) -> None:
    a = _guard("a", ledger)
    a.claim(_need("a", 60), replacing=None)
    a.started("c1")
    assert not a.abandon(running=None)
    assert _held(ledger) == [("a", "c1")]
