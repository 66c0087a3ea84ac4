"""Three machines as one service, each a network namespace of its own (tests/machines.py) with its
real gateway process and its engine inside, one PostgreSQL cluster on the switch address, one
peers file, and Debian's haproxy (the shipped file) in the root namespace in front of them.

Each machine's engine is the host tests' fast engine (gateway_world.Upstream) in a process of its
own inside the machine, on the machine's address: it goes with the machine when its cable is
pulled, as a real engine would. The test holds and releases its streams, and counts what reached
it, on the process's stdin and stdout.

Every machine's models are served through any gateway's address and through HAProxy's. A machine
cut (`cut()`) while a stream another gateway forwarded to it is under way: its rows go stale
within `[fleet] stale_s`, and that stream ends then with an error event naming the machine (the
forwarding gateway's deadline, set longer than the client waits, plays no part); its own model
is 503 `model_not_loaded` naming it and the model another machine serves too goes there; once
mended it is fresh and served again. PostgreSQL frozen: each gateway serves its own model,
forwards nothing, says `fleet unavailable` once, and the fleet comes back after the thaw.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests import haproxy
from tests.fixtures import ROOT
from tests.gateway_proc import Gateway, running_gateway
from tests.host.fleet_world import post, write_peers
from tests.host.gateway_world import write_status
from tests.machines import Machine, Machines, machines
from tests.postgres import Cluster, bindir, cluster
from tests.record_world import until
from tests.standin import free_port

OWNER = "owner-key-" + "o" * 32
INFERENCE = "inference-key-" + "i" * 32
CHECKS = "250ms"  # HAProxy's checks, shortened from the shipped 1 s
ROUTE = "/v1/chat/completions"
HEADERS = {"Authorization": f"Bearer {INFERENCE}", "Content-Type": "application/json"}
# The forwarding gateway's clock on a peer's answer: max_wait_s + load_wait_s + deadline_s,
# past the client's socket timeout: a cut machine's stream must end by its staleness alone.
MAX_WAIT_S, LOAD_WAIT_S, DEADLINE_S = 2, 2, 120
FORWARD_S = MAX_WAIT_S + LOAD_WAIT_S + DEADLINE_S
BOUND_S = 60  # a client's socket timeout: a bound on a hang, below FORWARD_S
HEARTBEAT_S = 5.0  # each engine's status.json written again, as its worker's heartbeat is

# The fast engine, served on argv[1] (a port of the kernel's, printed first). Each stdin line is
# a command, answered on stdout with the number of requests it has had: `hold` (each stream
# from now on stops after its first chunk), `release` (those held go on; new ones are not
# held), anything else (the count only). It ends when stdin closes.
ENGINE = """
import asyncio, sys
from aiohttp import web
from tests.host.gateway_world import Upstream

async def main():
    up = Upstream()
    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, up.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, sys.argv[1], 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "hold":
            up.hold = asyncio.Event()
        elif line.strip() == "release":
            if up.hold is not None:
                up.hold.set()
            up.hold = None
        print(len(up.bodies), flush=True)
    await runner.cleanup()

asyncio.run(main())
"""


@dataclass
class Engine:
    """One machine's engine process and the commands the test gives it."""

    machine: Machine
    proc: subprocess.Popen[str]
    url: str
    lock: threading.Lock

    def say(self, command: str) -> int:
        """The command given, and the number of requests the engine has had."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return int(self.proc.stdout.readline())

    def served(self) -> int:
        return self.say("count")


@contextlib.contextmanager
def engine_in(machine: Machine) -> Iterator[Engine]:
    proc = machine.popen(
        [sys.executable, "-u", "-c", ENGINE, machine.address],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        assert port.isdigit(), f"the engine in {machine.name} did not start: {port!r}"
        assert machine.holds(proc.pid)
        yield Engine(machine, proc, f"http://{machine.address}:{port}", threading.Lock())
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def settings(machine: Machine, port: int, dsn: str, peers: Path) -> str:
    return (
        f'[record]\ndsn = "{dsn}"\n'
        f'[fleet]\nmachine = "{machine.name}"\n'
        f'advertise = "http://{machine.address}:{port}"\n'
        f'peers_file = "{peers}"\nstale_s = 2\npublish_s = 0.5\n'
        f"[limits]\nrunning = 4\nwaiting = 8\nmax_wait_s = {MAX_WAIT_S}\n"
        f"load_wait_s = {LOAD_WAIT_S}\ndeadline_s = {DEADLINE_S}\n"
    )


@dataclass
class Fleet:
    machines: Machines
    pg: Cluster
    engines: dict[str, Engine]  # by machine name
    gateways: dict[str, Gateway]
    serves: dict[str, tuple[str, ...]]  # machine name -> the models its engine serves

    def beat(self) -> None:
        """Each engine's status.json as its worker writes it: running, fresh."""
        for name, gateway in self.gateways.items():
            write_status(
                gateway.data_dir,
                "small",
                "running",
                url=self.engines[name].url,
                models=self.serves[name],
            )

    def listed(self, via: str) -> list[dict[str, Any]]:
        status, answer = self.gateways[via].get("/v1/models", INFERENCE)
        assert status == 200, answer
        return list(answer["data"])

    def sees(self, via: str, names: set[str]) -> bool:
        """Does `via` list the models of these machines, and of no other?"""
        return {e["machine"] for e in self.listed(via)} == names

    def where(self, via: str, model: str) -> dict[str, dict[str, Any]]:
        """`model`'s entries in `via`'s listing, by machine."""
        return {m["machine"]: m for m in self.listed(via) if m["id"] == model}


def chat(model: str, **more: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    return {**body, **more}


def connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=BOUND_S)


def ask(url: str, model: str) -> tuple[int, Any]:
    """A chat's status and its JSON (or text) body, over a connection of its own."""
    return post(url, ROUTE, HEADERS, chat(model))


@contextlib.contextmanager
def three_machines(work: Path) -> Iterator[Fleet]:
    if bindir() is None:
        pytest.fail("these tests need Debian's postgresql (scripts/machine.sh installs it)")
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(machines(3))
        pg = stack.enter_context(
            cluster(listen=(made.switch,), clients=(made.subnet.with_prefixlen,))
        )
        dsn = pg.database(host=made.switch)
        serves: dict[str, tuple[str, ...]] = {m.name: (f"own-{m.index}",) for m in made}
        for m in made.machines[1:]:  # machines 2 and 3 serve `shared` too
            serves[m.name] += ("shared",)
        keys = {m.name: secrets.token_urlsafe(32) for m in made}
        peers = work / "peers.keys"
        write_peers(peers, keys)
        fleet = Fleet(made, pg, {}, {}, serves)
        for m in made:
            engine = fleet.engines[m.name] = stack.enter_context(engine_in(m))
            data = work / m.name / "data"
            data.mkdir(parents=True)
            write_status(data, "small", "running", url=engine.url, models=serves[m.name])
            port = free_port()
            fleet.gateways[m.name] = stack.enter_context(
                running_gateway(
                    work / m.name,
                    data,
                    settings(m, port, dsn, peers),
                    address=m.address,
                    prefix=m.prefix(),
                    keys=(OWNER, INFERENCE),
                    port=port,
                )
            )
            assert m.holds(fleet.gateways[m.name].proc.pid)
        stopped = threading.Event()

        def heartbeat() -> None:
            while not stopped.wait(HEARTBEAT_S):
                fleet.beat()

        beating = threading.Thread(target=heartbeat, daemon=True)
        beating.start()
        stack.callback(beating.join, 30)
        stack.callback(stopped.set)
        for m in made:  # every machine sees every other's models
            until(partial(fleet.sees, m.name, set(serves)), 60, f"{m.name} seeing the fleet")
        yield fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with three_machines(tmp_path_factory.mktemp("fleet-machines")) as made:
        yield made


def test_every_machines_model_is_served_through_any_gateway_and_haproxy(
    fleet: Fleet, tmp_path: Path
) -> None:
    models = sorted({model for served in fleet.serves.values() for model in served})
    for via in fleet.gateways:
        listed = {(e["id"], e["machine"]) for e in fleet.listed(via)}
        assert listed == {(model, m) for m, served in fleet.serves.items() for model in served}
    before = {name: engine.served() for name, engine in fleet.engines.items()}
    for via, gateway in fleet.gateways.items():
        for model in models:
            status, answer = ask(gateway.url, model)
            assert status == 200, (via, model, answer)
            assert answer["model"] == model
    got = {name: engine.served() - before[name] for name, engine in fleet.engines.items()}
    one, two, three = (m.name for m in fleet.machines)
    # own-N on machine N from each of the three gateways; `shared` on 2 or 3 from each
    assert got[one] == 3 and got[two] + got[three] == 3 + 3 + 3, got
    servers = [(name, gw.url.removeprefix("http://")) for name, gw in fleet.gateways.items()]
    with haproxy.running(tmp_path / "haproxy", servers, CHECKS) as proxy:
        for _ in range(2):
            for model in models:
                status, answer = ask(proxy.url, model)
                assert status == 200, (model, answer, proxy.log_text())
                assert answer["model"] == model
        for name in fleet.gateways:  # each gateway took some of them (leastconn, no stream held)
            assert int(proxy.server(name)["stot"]) >= 1, proxy.server(name)


def events_of(raw: bytes) -> list[str]:
    return [line.removeprefix("data: ") for line in raw.decode().splitlines() if line]


def test_a_cut_machine_ends_its_forwarded_stream_goes_stale_and_comes_back(fleet: Fleet) -> None:
    one, two, three = fleet.machines
    origin, cut = fleet.gateways[one.name], fleet.engines[two.name]
    cut.say("hold")
    conn = connection(origin.url)
    try:
        conn.request("POST", ROUTE, body=json.dumps(chat("own-2", stream=True)), headers=HEADERS)
        answer = conn.getresponse()
        assert answer.status == 200
        first = answer.readline()  # the engine's first chunk, through one from two
        assert first.startswith(b"data: ") and b"tok" in first, first
        two.cut()
        try:
            rest = answer.read()  # ended once two is stale; past BOUND_S: a hang
        finally:
            cut.say("release")
    finally:
        conn.close()
    try:
        events = events_of(rest)
        assert events and events[-1] != "[DONE]", events
        ended = json.loads(events[-1])["error"]
        assert ended["machine"] == two.name and ended["code"] == "machine_gone", ended
        assert f"machine {two.name} is no longer heard from" in ended["message"]
        until(lambda: not fleet.where(one.name, "own-2")[two.name]["fresh"], 30, "two stale")
        assert fleet.where(three.name, "shared")[two.name]["fresh"] is False
        assert fleet.where(one.name, "own-3")[three.name]["fresh"] is True
        status, refused = ask(origin.url, "own-2")
        assert status == 503, refused
        assert refused["error"]["code"] == "model_not_loaded"
        assert refused["machines"] == [two.name]
        assert f"last seen on {two.name}" in refused["error"]["message"]
        before = {name: engine.served() for name, engine in fleet.engines.items()}
        for _ in range(3):
            status, answer = ask(origin.url, "shared")
            assert status == 200, answer
        after = {name: engine.served() for name, engine in fleet.engines.items()}
        assert after[two.name] == before[two.name]  # none to the machine that is gone
        assert after[three.name] == before[three.name] + 3
    finally:
        two.mend()
    until(lambda: fleet.where(one.name, "own-2")[two.name]["fresh"], 60, "two fresh again")
    before_two = cut.served()
    status, answer = ask(origin.url, "own-2")
    assert status == 200, answer
    assert cut.served() == before_two + 1


def test_a_frozen_database_leaves_each_machine_serving_its_own(fleet: Fleet) -> None:
    names = [m.name for m in fleet.machines]
    said = {name: gw.log_text().count("fleet unavailable") for name, gw in fleet.gateways.items()}
    fleet.pg.freeze()
    try:
        for name in names:  # each knows only itself
            until(partial(fleet.sees, name, {name}), 30, f"{name} alone")
        for index, name in enumerate(names, start=1):
            gateway = fleet.gateways[name]
            status, answer = ask(gateway.url, f"own-{index}")
            assert status == 200, (name, answer)
            other = f"own-{index % 3 + 1}"
            status, answer = ask(gateway.url, other)
            assert status == 404, (name, answer)  # sent nowhere: nothing known of the others
    finally:
        fleet.pg.thaw()
    for name in names:
        until(partial(fleet.sees, name, set(names)), 60, f"{name} seeing the fleet again")
    for name, gateway in fleet.gateways.items():
        log = gateway.log_text()
        assert log.count("fleet unavailable") == said[name] + 1, log[-3000:]
        assert "fleet available" in log
    assert ask(fleet.gateways[names[0]].url, "own-2")[0] == 200
