"""Three machines as one service: a request for a model another machine serves goes there from
any gateway, the one row is that machine's, `/v1/models` lists every machine's models, two
machines serving one model share its load, a machine that disappears is not routed to, and a
fleet whose database is gone serves each machine's own models. Real gateway processes on
loopback, each with its own data directory and the host tests' fast engine, one PostgreSQL
record and catalog."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway_proc import Gateway, running_gateway
from tests.host.fleet_world import EngineLoop, fleet_settings, post, write_peers
from tests.host.gateway_world import Upstream, write_status
from tests.postgres import Cluster
from tests.record_world import until
from tests.standin import free_port

# each machine's engine and the models it serves: `shared` on b and c, one of its own each
SERVES = {"a": ("own-a",), "b": ("own-b", "shared"), "c": ("own-c", "shared")}
ROUTE = "/v1/chat/completions"


def chat(model: str, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        **more,
    }


class Three:
    def __init__(self, dsn: str, engines: EngineLoop) -> None:
        self.dsn = dsn
        self.engines = engines
        self.upstreams: dict[str, Upstream] = {}
        self.gateways: dict[str, Gateway] = {}

    def fresh(self) -> None:
        for name, gateway in self.gateways.items():
            if gateway.proc.poll() is None:
                write_status(
                    gateway.data_dir,
                    "small",
                    "running",
                    url=self.upstreams[name].url,
                    models=SERVES[name],
                    slots={SERVES[name][0]: 1},  # one request at a time, whatever the model
                )

    def ask(self, via: str, model: str, **more: Any) -> tuple[int, Any]:
        gateway = self.gateways[via]
        headers = {
            "Authorization": f"Bearer {gateway.inference}",
            "Content-Type": "application/json",
        }
        return post(gateway.url, ROUTE, headers, chat(model, **more))

    def listed(self, via: str) -> list[dict[str, Any]]:
        gateway = self.gateways[via]
        request = urllib.request.Request(
            f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {gateway.inference}"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return list(json.load(answer)["data"])

    def where(self, via: str, model: str) -> dict[str, dict[str, Any]]:
        """`model`'s entries in `via`'s listing, by machine."""
        return {m["machine"]: m for m in self.listed(via) if m["id"] == model}

    def served(self, name: str) -> int:
        return len(self.upstreams[name].bodies)


@contextlib.contextmanager
def three_machines(postgres: Cluster, work: Path) -> Iterator[Three]:
    keys = {name: secrets.token_urlsafe(32) for name in SERVES}
    peers = work / "peers.keys"
    write_peers(peers, keys)
    engines = EngineLoop()
    fleet = Three(postgres.database(), engines)
    try:
        with contextlib.ExitStack() as stack:
            for name, models in SERVES.items():
                upstream = fleet.upstreams[name] = engines.serve(Upstream())
                data = work / f"data-{name}"
                data.mkdir(parents=True)
                write_status(data, "small", "running", url=upstream.url, models=models)
                port = free_port()
                settings = fleet_settings(name, port, fleet.dsn, peers).replace(
                    "[fleet]\n", "[fleet]\nstale_s = 2\npublish_s = 0.5\n", 1
                )
                fleet.gateways[name] = stack.enter_context(
                    running_gateway(work / f"gateway-{name}", data, settings, port=port)
                )
            fleet.fresh()
            for name in SERVES:  # every machine sees every other's models
                until(
                    lambda name=name: {m["machine"] for m in fleet.listed(name)} == set(SERVES),
                    30,
                    f"{name} seeing the fleet",
                )
            yield fleet
    finally:
        engines.close()


@pytest.fixture
def fleet(postgres: Cluster, tmp_path: Path) -> Iterator[Three]:
    with three_machines(postgres, tmp_path) as made:
        yield made


def rows(dsn: str, model: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT machine, outcome, model FROM generations WHERE model = %s", (model,)
        )
        return list(found.fetchall())


def test_any_gateway_serves_every_machines_model_and_only_the_server_records_it(
    fleet: Three,
) -> None:
    for via in SERVES:
        for owner in SERVES:
            status, answer = fleet.ask(via, f"own-{owner}")
            assert status == 200, (via, owner, answer)
    assert [fleet.served(name) for name in SERVES] == [3, 3, 3]  # each model on its machine
    for owner in SERVES:  # one row per generation, by the machine that served it
        until(lambda owner=owner: len(rows(fleet.dsn, f"own-{owner}")) == 3, 30, "rows")
        assert rows(fleet.dsn, f"own-{owner}") == [(owner, "ok", f"own-{owner}")] * 3


def test_a_stream_through_another_gateway_comes_whole_with_the_servers_usage(fleet: Three) -> None:
    status, answer = fleet.ask("a", "own-b", stream=True)
    assert status == 200
    events = [line for line in str(answer).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert fleet.upstreams["b"].bodies[-1]["stream"] is True
    until(lambda: rows(fleet.dsn, "own-b") == [("b", "ok", "own-b")], 30, "the row")


def test_the_models_of_every_machine_are_listed_with_where_they_run(fleet: Three) -> None:
    listed = fleet.listed("a")
    where = {(m["id"], m["machine"]) for m in listed}
    assert where == {
        ("own-a", "a"),
        ("own-b", "b"),
        ("shared", "b"),
        ("own-c", "c"),
        ("shared", "c"),
    }
    assert all(m["fresh"] for m in listed)


def test_an_unknown_model_is_404_naming_the_fleets_models(fleet: Three) -> None:
    status, answer = fleet.ask("a", "absent")
    assert status == 404, answer
    assert answer["error"]["code"] == "model_not_found"
    assert "own-c" in answer["error"]["message"]


def test_two_machines_serving_one_model_share_its_load(fleet: Three) -> None:
    """b and c serve `shared` with one slot each: while b's is taken, the next goes to c."""
    b = fleet.upstreams["b"]
    hold = b.hold = asyncio.Event()
    try:
        with contextlib.ExitStack() as stack:
            first: list[tuple[int, Any]] = []
            runner = threading.Thread(target=lambda: first.append(fleet.ask("a", "shared")))
            runner.start()
            stack.callback(runner.join, 60)
            stack.callback(lambda: fleet.engines.call(hold.set))
            until(lambda: fleet.served("b") == 1, 30, "the first on b (by name)")
            until(lambda: fleet.where("a", "shared")["b"]["running"] == 1, 30, "b's slot taken")
            status, _ = fleet.ask("a", "shared")
            assert status == 200
            assert (fleet.served("b"), fleet.served("c")) == (1, 1)
        assert first and first[0][0] == 200
    finally:
        b.hold = None


def test_a_machine_that_disappears_is_not_routed_to(fleet: Three) -> None:
    """c killed: its rows go stale within the bound; its own model is 503 naming it, and the
    model b serves too goes to b."""
    c = fleet.gateways["c"]
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(30)
    until(lambda: not fleet.where("a", "own-c")["c"]["fresh"], 30, "c stale")
    status, answer = fleet.ask("a", "own-c")
    assert status == 503, answer
    assert answer["error"]["code"] == "model_not_loaded"
    assert answer["machines"] == ["c"]
    assert "last seen on c (last heard" in answer["error"]["message"]
    before = fleet.served("c")
    for _ in range(3):
        status, _ = fleet.ask("a", "shared")
        assert status == 200
    assert fleet.served("c") == before  # none went to the machine that is gone


def test_without_the_database_each_gateway_serves_its_own_and_forwards_nothing(
    fleet: Three, postgres: Cluster
) -> None:
    postgres.stop()
    try:
        until(
            lambda: fleet.listed("a") and all(m["machine"] == "a" for m in fleet.listed("a")),
            30,
            "a alone",
        )
        assert fleet.ask("a", "own-a")[0] == 200
        status, answer = fleet.ask("a", "own-b")
        assert status == 404, answer  # not sent anywhere: nothing is known of the others
    finally:
        postgres.start()
    until(lambda: {m["machine"] for m in fleet.listed("a")} == set(SERVES), 60, "the fleet back")
    assert fleet.ask("a", "own-b")[0] == 200


def test_one_of_two_machines_killed_mid_load_loses_only_its_own_streams(fleet: Three) -> None:
    """A stream on b and one on c, both held; c killed: its stream ends with an error event
    naming it, and b's, let go, ends whole."""
    b, c = fleet.upstreams["b"], fleet.upstreams["c"]
    b.hold, c.hold = asyncio.Event(), asyncio.Event()
    answers: dict[str, tuple[int, Any]] = {}

    def stream(name: str) -> threading.Thread:
        runner = threading.Thread(
            target=lambda: answers.__setitem__(name, fleet.ask("a", "shared", stream=True))
        )
        runner.start()
        return runner

    first = stream("first")
    until(lambda: fleet.served("b") == 1, 30, "the first on b")
    until(lambda: fleet.where("a", "shared")["b"]["running"] == 1, 30, "b's slot taken")
    second = stream("second")
    until(lambda: fleet.served("c") == 1, 30, "the second on c")
    gone = fleet.gateways["c"]
    os.kill(gone.proc.pid, signal.SIGKILL)
    gone.proc.wait(30)
    second.join(60)
    fleet.engines.call(b.hold.set)
    first.join(60)
    fleet.engines.call(c.hold.set)
    assert not first.is_alive() and not second.is_alive()
    status, text = answers["second"]
    assert status == 200
    last = [line for line in str(text).splitlines() if line.startswith("data: ")][-1]
    error = json.loads(last.removeprefix("data: "))["error"]
    assert (error["code"], error["machine"]) == ("engine_failed", "c"), error
    status, text = answers["first"]
    assert status == 200
    assert str(text).rstrip().endswith("data: [DONE]")
    until(lambda: rows(fleet.dsn, "shared") == [("b", "ok", "shared")], 30, "b's row alone")
