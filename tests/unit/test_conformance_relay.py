"""The conformance relay's bookkeeping, and the worker log an engine under test reads last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conformance.relay import Relay
from tests.fixtures import Engine, RecipeRepo


class Engines:
    """Engines that come up at once, and a record of which were discarded."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.discarded: list[Engine] = []
        self.serving: set[int] = set()
        self.made = 0

    def __call__(self) -> Engine:
        self.made += 1
        root = self.tmp_path / f"engine-{self.made}"
        root.mkdir()
        engine = Engine(name=root.name, repo=RecipeRepo(self.tmp_path), base="base", root=root)
        engine.up = lambda *extra, timeout=120: (None, {"state": "running"})  # type: ignore
        self.serving.add(id(engine))
        return engine

    def discard(self, engine: Engine) -> None:
        self.discarded.append(engine)


class BookRelay(Relay):
    """The relay with `serving` answered by the test: the Docker side is proven in conformance."""

    def __init__(self, engines: Engines) -> None:
        super().__init__(engines, client=None)  # type: ignore[arg-type]
        self.engines = engines

    def serving(self, engine: Engine) -> dict[str, Any] | None:
        return {"state": "running", "again": True} if id(engine) in self.engines.serving else None


@pytest.fixture
def relay(tmp_path: Path) -> BookRelay:
    return BookRelay(Engines(tmp_path))


def test_an_engine_handed_on_is_the_next_cases_and_starts_nothing(relay: BookRelay) -> None:
    first, status = relay.take(relay.engines, 1)
    assert status == {"state": "running"} and relay.starts == 1
    relay.hand_on(first)
    again, status = relay.take(relay.engines, 1)
    assert again is first and status["again"] and relay.starts == 1
    assert relay.engines.discarded == []


def test_an_engine_not_handed_on_is_discarded_and_a_fresh_one_started(relay: BookRelay) -> None:
    first, _ = relay.take(relay.engines, 1)  # its case stopped it, killed it, or failed
    second, _ = relay.take(relay.engines, 1)
    assert second is not first and relay.starts == 2
    assert relay.engines.discarded == [first]


def test_an_engine_handed_on_that_no_longer_serves_is_discarded(relay: BookRelay) -> None:
    first, _ = relay.take(relay.engines, 1)
    relay.hand_on(first)
    relay.engines.serving.discard(id(first))  # its container died between the cases
    second, _ = relay.take(relay.engines, 1)
    assert second is not first and relay.engines.discarded == [first]


def test_only_the_engine_taken_last_can_be_handed_on(relay: BookRelay) -> None:
    first, _ = relay.take(relay.engines, 1)
    relay.take(relay.engines, 1)
    with pytest.raises(AssertionError, match="taken last"):
        relay.hand_on(first)


def test_the_log_tail_is_the_last_workers_past_nine(tmp_path: Path) -> None:
    engine = Engine(name="e", repo=RecipeRepo(tmp_path), base="base", root=tmp_path)
    for number in (2, 9, 10):
        (tmp_path / f"worker-{number}.log").write_text(f"worker {number} here\n")
    assert engine.log_tail() == "worker 10 here\n"
