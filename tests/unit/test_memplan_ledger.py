"""The memory ledger with real processes and real flocks: no two starts take the same memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from supervisor.memplan.fit import Budget, Holding, Verdict, check
from supervisor.memplan.ledger import Claim, Ledger, process_start
from supervisor.memplan.need import EngineNeed, figures

G = 1024**3
ROOT = Path(__file__).resolve().parents[2]

# A worker: waits for the start signal (a file), claims 60 GiB of a 100 GiB limit, holding the
# decision open 0.3 s so that the others try meanwhile, prints whether it fit, then lives on
# (its claim holds while it lives) until told to quit.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from supervisor.memplan.fit import Budget, check
    from supervisor.memplan.ledger import Ledger
    from supervisor.memplan.need import EngineNeed, figures

    directory, name, go, quit = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    need = EngineNeed(name, (figures(name, 60 * 1024**3, 0, 0, multiplier=1.0),))
    while not go.exists():
        time.sleep(0.001)

    def decide(held):
        verdict = check(need, Budget(100 * 1024**3, 0, held))
        time.sleep(0.3)
        return verdict

    verdict = Ledger(directory).claim(name, running=(), decide=decide)
    print(json.dumps({"name": name, "fits": verdict.fits, "message": verdict.message}), flush=True)
    while not quit.exists():
        time.sleep(0.01)
    """
)


def _spawn(directory: Path, name: str, go: Path, quit_: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), name, str(go), str(quit_)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _need(name: str, gib: int) -> EngineNeed:
    return EngineNeed(name, (figures(name, gib * G, 0, 0, multiplier=1.0),))


def _decide(name: str, gib: int, limit: int = 100) -> object:
    def decide(held: tuple[Holding, ...]) -> Verdict:
        return check(_need(name, gib), Budget(limit * G, 0, held))

    return decide


def test_concurrent_starts_exactly_one_gets_the_memory(tmp_path: Path) -> None:
    directory, go, quit_ = tmp_path / "memory", tmp_path / "go", tmp_path / "quit"
    children = [_spawn(directory, f"engine-{i}", go, quit_) for i in range(4)]
    try:
        time.sleep(1.0)  # all four are imported and waiting
        go.touch()
        results = [json.loads(child.stdout.readline()) for child in children if child.stdout]
    finally:
        quit_.touch()
        for child in children:
            child.wait(timeout=30)
    winners = [r["name"] for r in results if r["fits"]]
    assert len(winners) == 1, results
    losers = [r for r in results if not r["fits"]]
    assert all(f"held by {winners[0]} 60.0" in r["message"] for r in losers), losers
    # the winner's process is gone and its engine never ran: its claim holds nothing now
    assert Ledger(directory).held(running=()) == ()
    # ... unless its engine runs (a stopped worker leaves its engine running)
    assert Ledger(directory).held(running={winners[0]}) == (Holding(winners[0], 60 * G),)


def test_a_live_workers_claim_holds_before_its_engine_runs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "memory")
    assert ledger.claim("a", running=(), decide=_decide("a", 60)).fits  # this process lives
    refused = ledger.claim("b", running=(), decide=_decide("b", 60))
    assert not refused.fits
    assert "held by a 60.0" in refused.message
    assert ledger.claims()[0].name == "a"
    assert [c.name for c in ledger.claims()] == ["a"]  # a refusal records nothing


def test_release_and_replace(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "memory")
    assert ledger.claim("a", running=(), decide=_decide("a", 60)).fits
    # a's own new claim replaces its old one instead of counting against it
    assert ledger.claim("a", running=(), decide=_decide("a", 90)).fits
    assert [(c.name, c.bytes) for c in ledger.claims()] == [("a", 90 * G)]
    assert ledger.attach("a", "c0ffee")
    assert ledger.claims()[0].container == "c0ffee"
    assert ledger.release("a")
    assert not ledger.release("a")
    assert ledger.claim("b", running=(), decide=_decide("b", 60)).fits


def test_a_reused_pid_does_not_hold(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "memory")
    start = process_start(os.getpid())
    assert start is not None
    ledger.directory.mkdir(parents=True)
    stale = Claim(name="old", bytes=60 * G, pid=os.getpid(), pidStart=start + 1, at="2026-01-01")
    live = Claim(name="live", bytes=10 * G, pid=os.getpid(), pidStart=start, at="2026-01-01")
    document = {"schemaVersion": 1, "claims": [c.model_dump(by_alias=True) for c in (stale, live)]}
    ledger.path.write_text(json.dumps(document))
    assert ledger.held(running=()) == (Holding("live", 10 * G),)
    assert ledger.held(running={"old"}) == (Holding("old", 60 * G), Holding("live", 10 * G))
    assert ledger.held(running=(), exclude="live") == ()
    # the next claim drops the stale one from the file
    assert ledger.claim("new", running=(), decide=_decide("new", 80)).fits
    assert sorted(c.name for c in ledger.claims()) == ["live", "new"]


def test_an_unreadable_ledger_holds_nothing(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "memory")
    ledger.directory.mkdir(parents=True)
    ledger.path.write_text("{not json")
    assert ledger.held(running=()) == ()
    assert ledger.claim("a", running=(), decide=_decide("a", 60)).fits
    assert [c.name for c in ledger.claims()] == ["a"]


def test_an_attached_claim_holds_only_while_its_engine_runs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "memory")
    assert ledger.claim("a", running=(), decide=_decide("a", 60)).fits
    assert ledger.attach("a", "c0ffee")
    # its worker (this process) lives, but the engine stopped or exited: nothing is held
    assert ledger.held(running=()) == ()
    assert ledger.held(running={"a"}) == (Holding("a", 60 * G),)
    assert ledger.claim("b", running=(), decide=_decide("b", 60)).fits
