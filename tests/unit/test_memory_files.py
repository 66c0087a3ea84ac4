"""The memory plan and the host's page read claims.json and /proc/meminfo through one parser
each: what the ledger writes, both sides read, and the same files give both the same figures."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.host.page.memory import LedgerMemory
from supervisor.memplan import overview, probe, settings
from supervisor.memplan.fit import Budget, Holding, Verdict, check
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed, figures
from supervisor.protocol.claims import claims_path, held_claims, parse_claims
from supervisor.protocol.documents import State, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.protocol.layout import STATUS, engine_dir

G = 1024**3
MEMINFO = "MemTotal:       100000000 kB\nMemFree:         1000 kB\nMemAvailable:   60000000 kB\n"


def fits(name: str, gib: int) -> object:
    def decide(held: tuple[Holding, ...]) -> Verdict:
        need = EngineNeed(name, (figures(name, gib * G, 0, 0, multiplier=1.0),))
        return check(need, Budget(1000 * G, 0, held))

    return decide


def write_status(data: Path, name: str, state: State) -> None:
    now = utc_now()
    status = Status(
        generation=1,
        state=state,
        since=now,
        message=state,
        checked_at=now,
        url="http://127.0.0.1:1" if state == "running" else None,
    )
    write_atomic(ensure_dir(engine_dir(data, name)) / STATUS, dump(status))


def claimed(data: Path) -> Ledger:
    """A ledger with three claims: two attached to their containers, one start in progress (its
    claim holds while this process lives, whatever its status says)."""
    ledger = Ledger.for_data_dir(data)
    for name, gib in (("big", 30), ("small", 5), ("idle", 7)):
        assert ledger.claim(name, running=(), decide=fits(name, gib)).fits  # type: ignore[arg-type]
    assert ledger.attach("big", "c0ffee") and ledger.attach("idle", "d00d")
    return ledger


def test_a_claims_file_the_ledger_wrote_is_read_by_the_protocol_readers(tmp_path: Path) -> None:
    ledger = claimed(tmp_path)
    text = claims_path(tmp_path).read_text()
    assert ledger.path == claims_path(tmp_path)
    assert parse_claims(text) == list(ledger.claims())
    assert [c.container for c in parse_claims(text)] == ["c0ffee", None, "d00d"]
    assert all(c.pid == os.getpid() for c in parse_claims(text))
    assert [(h.name, h.bytes) for h in held_claims(text)] == [
        ("big", 30 * G),
        ("small", 5 * G),
        ("idle", 7 * G),
    ]


def test_the_page_and_the_plan_read_the_same_figures_from_the_same_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ledger = claimed(data)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    write_status(data, "big", "running")
    write_status(data, "small", "starting")
    write_status(data, "idle", "stopped")
    write_status(data, "free", "stopped")

    plan_held = overview.held_from_files(data)
    memory = probe.measure(settings.defaults(), host=lambda: probe.host_memory(meminfo))
    shown = LedgerMemory(data, meminfo).read()

    assert shown is not None
    assert shown["held"] == [{"name": h.name, "bytes": h.bytes} for h in plan_held]
    assert [h["name"] for h in shown["held"]] == ["big", "small"], "idle is stopped: not held"
    assert (shown["limit"], shown["availableNow"]) == (memory.limit, memory.available)
    assert (memory.limit, memory.available) == (100000000 * 1024, 60000000 * 1024)
    assert {c.name for c in ledger.claims()} == {"big", "small", "idle"}
