"""The memory plan against the real dockerd: a start that cannot fit is refused before anything
is stopped or started, every running lucia engine counts (a stopped worker's too), and two
workers starting at once cannot both take the last of it.

The machine file sets a fixed limit of 1 GiB with no reserves; each engine's recipe says it
needs 0.5 + 0.1 GiB, so one fits and two do not.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.memplan.settings import GIB, gib
from tests.fixtures import Engine, free_port

pytestmark = pytest.mark.docker

FIGURES = {"weights_gib": 0.5, "kv_gib": 0.1}
MODEL = "The model test/tiny-model does not fit after voice, OS, services, and runtime reservations"


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One data directory for the engines (the host's: its memory ledger is shared), and the
    machine file every worker started from here reads."""
    machine = tmp_path / "machine.toml"
    machine.write_text('limit = 1.0\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    data = tmp_path / "data"
    data.mkdir()
    return data


def _settled(engine: Engine, generation: int) -> dict[str, Any]:
    return engine.wait_status(
        lambda s: s["generation"] == generation and s["state"] in ("running", "failed"),
        timeout=180,
        what="running or failed",
    )


def _gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in the metrics"
    return float(found.group(1))


def _none(client: docker.DockerClient, engine: Engine) -> bool:
    return client.containers.list(all=True, filters={"name": engine.container}) == []


def test_a_refused_start_leaves_the_running_engine_untouched(make_engine, client, shared) -> None:
    # a generous readiness timeout: both workers build their images at once on a busy machine
    a: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    b: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    port = free_port()
    a.up("--metrics-port", str(port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert _gauge(metrics, "lucia_worker_memory_need_bytes") == gib(0.5) + gib(0.1)
    assert _gauge(metrics, "lucia_worker_memory_limit_bytes") == GIB
    before = client.containers.get(a.container)
    b.start_worker()
    failed = b.wait_state(b.request("running"), "failed", timeout=120)
    assert failed["message"].startswith(
        f"{MODEL}: needs 0.6 GiB, 0.4 GiB left (limit 1.0, reserves 0.0, held by {a.name} 0.6)."
        f" Lower CONTEXT or stop {a.name}; trying again in "  # a may stop: waiting may pass
    ), failed
    assert failed["retrying"] and failed["waitingFor"] == "memory", failed  # the host may swap
    assert _none(client, b)  # nothing started
    # a replacement of a that needs more than there is: refused before a is stopped
    a.memory = {"weights_gib": 0.9, "kv_gib": 0.2}
    a.settings["READY_DELAY"] = "2"  # a new run spec: a replacement
    a.reload()
    refused = a.wait_status(lambda s: "needs 1.1 GiB" in s["message"], timeout=120)
    assert refused["state"] == "running", refused  # the old engine serves on, saying why
    assert refused["message"].endswith(  # nothing held: waiting cannot make it fit
        "was refused: "
        f"{MODEL}: needs 1.1 GiB, 1.0 GiB left (limit 1.0, reserves 0.0). Lower CONTEXT."
    ), refused
    assert refused["waitingFor"] is None, refused
    after = client.containers.get(a.container)
    assert after.id == before.id and after.status == "running"
    assert after.attrs["State"]["StartedAt"] == before.attrs["State"]["StartedAt"]


def test_two_workers_starting_at_once_one_gets_the_memory(make_engine, client, shared) -> None:
    # a generous readiness timeout: both workers build their images at once on a busy machine
    a: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    b: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    a.start_worker()
    b.start_worker()
    generations = a.request("running"), b.request("running")
    outcome = {e.name: _settled(e, g) for e, g in zip((a, b), generations, strict=True)}
    running = [name for name, s in outcome.items() if s["state"] == "running"]
    assert len(running) == 1, outcome
    (loser,) = (e for e in (a, b) if e.name not in running)
    message = outcome[loser.name]["message"]
    assert message.startswith(f"{MODEL}: needs 0.6 GiB, 0.4 GiB left")
    assert f"held by {running[0]} 0.6" in message
    assert _none(client, loser)


def test_a_stopped_workers_engine_still_counts_until_it_stops(make_engine, client, shared) -> None:
    # a generous readiness timeout: both workers build their images at once on a busy machine
    a: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    b: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    proc, _ = a.up()
    assert a.stop_worker(proc, signal.SIGTERM) == 0
    assert client.containers.get(a.container).status == "running"  # left running
    b.start_worker()
    failed = b.wait_state(b.request("running"), "failed", timeout=120)
    assert f"held by {a.name} 0.6" in failed["message"]
    assert _none(client, b)
    # a stops (through its worker again); b's Check, tried again, then starts it by itself
    a.start_worker()
    a.wait_state(a.request("stopped"), "stopped", timeout=120)
    b.wait_state(failed["generation"], "running", timeout=180)


def test_a_replacement_stopped_before_it_started_frees_its_claim(
    make_engine, client, shared
) -> None:
    # a's Check for the replacement claims its memory; a stop request lands while the old
    # container drains (5 s), so the replacement never starts: that claim must not outlive it
    a: Engine = make_engine(
        memory=FIGURES, data_root=shared, ready_timeout=180, settings={"STOP_DELAY": "5"}
    )
    b: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    a.up()
    a.settings["READY_DELAY"] = "2"  # a new run spec: a replacement
    a.reload()
    a.wait_status(
        lambda s: s["message"].startswith("stopping the engine container (replacing"),
        timeout=60,
        what="the replacement's stop under way",
    )
    a.wait_state(a.request("stopped"), "stopped", timeout=60)
    assert _none(client, a)
    claims = json.loads((shared / "memory" / "claims.json").read_text())["claims"]
    assert [c["name"] for c in claims] == []
    b.start_worker()
    b.wait_state(b.request("running"), "running", timeout=120)  # nothing of a's is held


def test_a_stopped_engine_says_it_cannot_fit_before_its_start_is_asked(
    make_engine, client, shared
) -> None:
    a: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    b: Engine = make_engine(memory=FIGURES, data_root=shared, ready_timeout=180)
    b.start_worker()
    alone = b.wait_status(lambda s: s.get("memory") is not None, timeout=120)
    plan = alone["memory"]
    assert alone["state"] == "stopped", alone
    assert (plan["need"], plan["fits"], plan["message"]) == (gib(0.5) + gib(0.1), True, ""), plan
    assert (plan["limit"], plan["limitSource"], plan["reserves"]["runtime"]) == (GIB, "fixed", 0)
    a.up()
    b.request("stopped")  # a new request is looked at at once (else at the next poll)
    crowded = b.wait_status(lambda s: s["memory"] and not s["memory"]["fits"], timeout=120)
    assert crowded["state"] == "stopped", crowded
    assert crowded["memory"]["message"].startswith(
        f"{MODEL}: needs 0.6 GiB, 0.4 GiB left (limit 1.0, reserves 0.0, held by {a.name} 0.6)."
    ), crowded
    assert json.loads((shared / "memory" / "claims.json").read_text())["claims"][0]["name"] == (
        a.name  # the plan claimed nothing for b
    )
    assert len(json.loads((shared / "memory" / "claims.json").read_text())["claims"]) == 1
    assert _none(client, b)
