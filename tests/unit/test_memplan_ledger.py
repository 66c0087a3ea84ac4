"""The memory ledger with real processes and real flocks: no two starts take the same memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from supervisor.memplan.fit import Budget, Holding, Verdict, check
from supervisor.memplan.ledger import LOCK, Ledger, process_start
from supervisor.memplan.need import EngineNeed, figures
from supervisor.protocol.claims import Claim

G = 1024**3
ROOT = Path(__file__).resolve().parents[2]

# A worker: claims 60 GiB of a 100 GiB limit; inside its decision (under the ledger's lock) it
# says so and waits until the test lets it go on; prints whether it fit, then lives on (its
# claim holds while it lives) until the test closes its stdin.
CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from supervisor.memplan.fit import Budget, check
    from supervisor.memplan.ledger import Ledger
    from supervisor.memplan.need import EngineNeed, figures

    directory, name = Path(sys.argv[1]), sys.argv[2]
    need = EngineNeed(name, (figures(name, 60 * 1024**3, 0, 0, multiplier=1.0),))

    def decide(held):
        print(json.dumps({"deciding": name}), flush=True)
        sys.stdin.readline()
        return check(need, Budget(100 * 1024**3, 0, held))

    verdict = Ledger(directory).claim(name, running=(), decide=decide)
    print(json.dumps({"name": name, "fits": verdict.fits, "message": verdict.message}), flush=True)
    sys.stdin.read()
    """
)


class Child:
    """A worker process, and what it said so far (read on a thread of its own)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[dict[str, Any]] = []
        self.released = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    @property
    def deciding(self) -> bool:
        """Inside its decision, waiting for the test to let it go on."""
        return sum("deciding" in line for line in self.lines) > self.released

    @property
    def result(self) -> dict[str, Any] | None:
        return next((line for line in self.lines if "fits" in line), None)

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.released += 1
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def quit(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _blocked_on(lock: Path) -> set[int]:
    """The pids blocked in flock on this file: the kernel's own list (/proc/locks, `->`)."""
    try:
        inode = os.stat(lock).st_ino
    except FileNotFoundError:
        return set()
    found = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 6 and fields[1] == "->" and fields[6].rsplit(":", 1)[-1] == str(inode):
            found.add(int(fields[5]))
    return found


def _need(name: str, gib: int) -> EngineNeed:
    return EngineNeed(name, (figures(name, gib * G, 0, 0, multiplier=1.0),))


def _decide(name: str, gib: int, limit: int = 100) -> object:
    def decide(held: tuple[Holding, ...]) -> Verdict:
        return check(_need(name, gib), Budget(limit * G, 0, held))

    return decide


def test_concurrent_starts_decide_one_at_a_time_and_exactly_one_gets_the_memory(
    tmp_path: Path,
) -> None:
    """Four workers claim at once. Whenever each of them is inside its decision, blocked on the
    ledger's lock (as the kernel lists it) or done, the test counts those deciding and lets them
    go on: under the lock, one decides while the others wait, however the machine schedules."""
    directory = tmp_path / "memory"
    children = [Child(directory, f"engine-{i}") for i in range(4)]
    at_once = []
    deadline = time.monotonic() + 60  # a bound on a failure only
    try:
        while not all(child.result for child in children):
            assert time.monotonic() < deadline, (at_once, [child.lines for child in children])
            blocked = _blocked_on(directory / LOCK)
            deciding = [child for child in children if child.deciding]
            if deciding and all(
                child.deciding or child.proc.pid in blocked or child.result for child in children
            ):
                at_once.append(len(deciding))
                for child in deciding:
                    child.go_on()
            time.sleep(0.005)  # the interval of polling the children's states
    finally:
        for child in children:
            child.quit()
    assert at_once == [1, 1, 1, 1], f"workers deciding at once: {at_once}"
    results = [child.result for child in children if child.result]
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
