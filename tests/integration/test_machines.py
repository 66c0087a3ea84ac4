"""The fleet tests' machines (tests/machines.py) on the real kernel, dockerd and PostgreSQL.

Three network namespaces on one switch: a process in one reaches a server in another by its
address and a server of the root namespace on the switch address, and not a server on another
machine's loopback; a busybox container published on a Docker gateway address (the default
bridge's and a network of the test's own) answers a machine through the route `reach` makes,
and a machine without that route reaches nothing; `cut()` leaves an established connection in
silence (no RST: the byte sent during the cut comes back once `mend()` is done) and fails new
ones, while the other machines go on; PostgreSQL listens on the switch address and a psycopg
connection from a machine arrives from that machine's address; a real gateway inside a machine
answers /v1/models from the root namespace and from another machine. The end of a set, a
failed body included, leaves no namespace, veth or route, a set whose owner was SIGKILLed is
swept by the next, and a subnet in use is refused.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.fixtures import ROOT, RUN_ID, TEST_LABEL
from tests.gateway_proc import running_gateway
from tests.machine_subnet import SubnetError
from tests.machines import Machine, Machines, leftovers, machines, sweep
from tests.postgres import bindir, cluster
from tests.standin import free_port
from tests.system.harness import USER, wait_for

pytestmark = pytest.mark.docker

# GET argv[1] with argv[2] seconds to connect and read (an Authorization header from
# $LUCIA_TEST_KEY); one JSON line: {"status", "body"} or {"error", "errno"}.
FETCH = """
import json, os, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1])
if os.environ.get("LUCIA_TEST_KEY"):
    request.add_header("Authorization", "Bearer " + os.environ["LUCIA_TEST_KEY"])
try:
    with urllib.request.urlopen(request, timeout=float(sys.argv[2])) as answer:
        print(json.dumps({"status": answer.status, "body": answer.read().decode()}))
except urllib.error.HTTPError as exc:
    print(json.dumps({"status": exc.code, "body": exc.read().decode()}))
except OSError as exc:
    exc = getattr(exc, "reason", exc)
    print(json.dumps({"error": type(exc).__name__, "errno": getattr(exc, "errno", None)}))
"""
# Echo each connection's bytes back; bound to argv[1], a port of the kernel's, printed first.
ECHO = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def echo(conn):
    while data := conn.recv(4096):
        conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""
# Connect to argv[1]:argv[2] with a 3 s bound; one JSON line: {"connected"} or {"error", "errno"}.
CONNECT = """
import json, socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print(json.dumps({"connected": True}))
except OSError as exc:
    print(json.dumps({"error": type(exc).__name__, "errno": exc.errno}))
"""
SILENT = 3.0  # seconds a cut connection's reader waits and hears nothing


def fetch(where: Machine | None, url: str, key: str = "", timeout: float = 10) -> dict[str, Any]:
    """FETCH's answer, run in the machine (None: the root namespace)."""
    argv = [sys.executable, "-c", FETCH, url, str(timeout)]
    env = {**os.environ, "LUCIA_TEST_KEY": key}  # the key in the environment, never in argv
    if where is None:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    else:
        done = where.run(argv, env=env, timeout=60)
    return dict(json.loads(done.stdout))


def connect(where: Machine, host: str, port: int) -> dict[str, Any]:
    done = where.run([sys.executable, "-c", CONNECT, host, str(port)], timeout=60)
    return dict(json.loads(done.stdout))


def refused(answer: dict[str, Any]) -> bool:
    return answer.get("errno") == errno.ECONNREFUSED


def silent_failure(answer: dict[str, Any]) -> bool:
    """A connect that heard nothing (timed out) or whose peer's address went unanswered
    (EHOSTUNREACH once ARP gave up): never refused, never reset."""
    return answer.get("error") == "TimeoutError" or answer.get("errno") == errno.EHOSTUNREACH


@contextlib.contextmanager
def serving(where: Machine | None, address: str, user: str | None = None) -> Iterator[int]:
    """Python's http.server bound to address (a kernel's port), in the machine (None: the root
    namespace), as user; the port, once it listens. Its page says where it runs."""
    site = Path(tempfile.mkdtemp(prefix="lucia-machines-site-"))
    try:
        site.chmod(0o755)  # the test user reads it
        name = where.name if where is not None else "root"
        (site / "index.html").write_text(f"served by {name}\n")
        (site / "index.html").chmod(0o644)
        argv = [sys.executable, "-u", "-m", "http.server", "0", "--bind", address]
        argv += ["--directory", str(site)]
        options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
        proc = (
            where.popen(argv, user=user, text=True, cwd=ROOT, **options)
            if where is not None
            else subprocess.Popen(argv, text=True, **options)
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "Serving HTTP on ADDRESS port PORT (...)"
            assert " port " in line, f"http.server in {name} did not start: {line!r}"
            if where is not None:
                assert where.holds(proc.pid)
            yield int(line.split(" port ")[1].split()[0])
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(site)


@pytest.fixture(scope="module")
def own_network(client: docker.DockerClient) -> Iterator[Any]:
    """A bridge network of the test's own, as an engine's recipe names one."""
    network = client.networks.create(
        f"lucia-test-{RUN_ID}-machines", driver="bridge", labels={TEST_LABEL: RUN_ID}
    )
    network.reload()
    try:
        yield network
    finally:
        network.remove()


def subnet_and_gateway(network: Any) -> tuple[str, str]:
    """A bridge network's IPv4 subnet and gateway address (the default bridge's IPAM names no
    gateway: its bridge interface's address is)."""
    [config] = [c for c in network.attrs["IPAM"]["Config"] if ":" not in c["Subnet"]]
    if config.get("Gateway"):
        return str(config["Subnet"]), str(config["Gateway"])
    bridge = network.attrs["Options"]["com.docker.network.bridge.name"]
    shown = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "dev", bridge],
        capture_output=True,
        text=True,
        check=True,
    )
    [link] = json.loads(shown.stdout)
    return str(config["Subnet"]), str(link["addr_info"][0]["local"])


@pytest.fixture(scope="module")
def fleet(client: docker.DockerClient, own_network: Any) -> Iterator[Machines]:
    """Three machines that reach the default bridge's and the own network's subnets."""
    default = client.networks.get("bridge")
    reach = [subnet_and_gateway(net)[0] for net in (default, own_network)]
    with machines(3, reach=reach) as made:
        yield made


def test_a_machine_reaches_another_by_address_and_the_host_on_the_switch(
    fleet: Machines,
) -> None:
    one, two, three = fleet
    with serving(two, two.address, user=USER) as port:
        answer = fetch(one, f"http://{two.address}:{port}/")
        assert answer == {"status": 200, "body": f"served by {two.name}\n"}
        assert fetch(None, f"http://{two.address}:{port}/")["status"] == 200
    with serving(None, fleet.switch) as port:
        for machine in (one, three):
            answer = fetch(machine, f"http://{fleet.switch}:{port}/")
            assert answer == {"status": 200, "body": "served by root\n"}


def test_processes_run_inside_their_machine_as_the_user_asked(fleet: Machines) -> None:
    one = fleet[0]
    assert one.run(["id", "-un"], user=USER).stdout.strip() == USER
    assert "docker" in one.run(["id", "-Gn"], user=USER).stdout.split()  # its groups too
    assert one.run(["id", "-u"]).stdout.strip() == "0"
    server = one.run(["docker", "version", "-f", "{{.Server.Version}}"], user=USER).stdout
    assert server.strip()  # dockerd's socket is a file: a worker in a machine reaches it
    seen = one.run(["readlink", "/proc/self/ns/net"], user=USER).stdout.strip()
    assert seen == f"net:[{os.stat(one.netns_path).st_ino}]"
    assert seen != os.readlink("/proc/self/ns/net")  # not the root namespace's
    addresses = one.run(["ip", "-j", "-4", "addr"]).stdout
    assert one.address in addresses and fleet[1].address not in addresses


def test_a_server_on_a_machines_loopback_is_its_own(fleet: Machines) -> None:
    one, two, _ = fleet
    with serving(two, "127.0.0.1") as port:
        assert fetch(two, f"http://127.0.0.1:{port}/")["status"] == 200  # it serves there
        assert refused(fetch(one, f"http://127.0.0.1:{port}/"))  # one's own loopback
        assert refused(fetch(one, f"http://{two.address}:{port}/"))  # not on two's address


@pytest.mark.parametrize("which", ["bridge", "own"])
def test_a_container_published_on_a_docker_gateway_answers_a_machine(
    fleet: Machines,
    client: docker.DockerClient,
    base_image: str,
    own_network: Any,
    which: str,
) -> None:
    network = client.networks.get("bridge") if which == "bridge" else own_network
    subnet, gateway = subnet_and_gateway(network)
    port = free_port()
    container = client.containers.run(
        base_image,
        ["sh", "-c", "echo served by docker > /site/index.html && exec httpd -f -p 8080 -h /site"],
        name=f"lucia-t{RUN_ID}-machines-{which}",
        labels={TEST_LABEL: RUN_ID},
        network=network.name,
        ports={"8080/tcp": (gateway, port)},
        detach=True,
    )
    try:
        url = f"http://{gateway}:{port}/"
        wait_for(lambda: fetch(None, url).get("status") == 200, 30, "the container answering")
        for machine in fleet:
            assert fetch(machine, url) == {"status": 200, "body": "served by docker\n"}
        with machines(1) as unrouted:  # no route to dockerd's subnets: nothing reaches them
            assert fetch(unrouted[0], url)["errno"] == errno.ENETUNREACH
        assert subnet in fleet.reached
    finally:
        container.remove(force=True)


def test_a_cut_machine_is_silent_and_mend_brings_it_back(fleet: Machines) -> None:
    one, two, three = fleet
    echo = two.popen(
        [sys.executable, "-u", "-c", ECHO, two.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        with socket.create_connection((two.address, port), timeout=10) as held:
            held.sendall(b"a")
            assert held.recv(16) == b"a"
            two.cut()
            try:
                assert not two.connected()
                held.sendall(b"b")  # into the void: no answer, and no reset either
                held.settimeout(SILENT)
                with pytest.raises(TimeoutError):
                    held.recv(16)
                assert silent_failure(connect(one, two.address, port))
                with serving(three, three.address) as other:  # the others go on
                    assert fetch(one, f"http://{three.address}:{other}/")["status"] == 200
            finally:
                two.mend()
            assert two.connected()
            held.settimeout(60)
            assert held.recv(16) == b"b"  # retransmitted once the cable is back: the same
            held.sendall(b"c")  # connection, never reset
            assert held.recv(16) == b"c"
        assert connect(one, two.address, port) == {"connected": True}
    finally:
        echo.kill()
        echo.wait(30)


def test_postgres_on_the_switch_address_answers_a_machine(fleet: Machines) -> None:
    if bindir() is None:
        pytest.fail("these tests need Debian's postgresql (scripts/machine.sh installs it)")
    with cluster(listen=(fleet.switch,), clients=(fleet.subnet.with_prefixlen,)) as pg:
        dsn = pg.database(host=fleet.switch)
        code = (
            "import os, psycopg\n"
            "with psycopg.connect(os.environ['LUCIA_TEST_DSN'], connect_timeout=10) as conn:\n"
            "    print(conn.execute('SELECT host(inet_client_addr())').fetchone()[0])\n"
        )
        one = fleet[0]
        done = one.run([sys.executable, "-c", code], env={**os.environ, "LUCIA_TEST_DSN": dsn})
        assert done.stdout.strip() == one.address  # it came over the switch, from one
        one.cut()
        try:
            failed = one.run(
                [sys.executable, "-c", code], env={**os.environ, "LUCIA_TEST_DSN": dsn}, check=False
            )
        finally:
            one.mend()
        assert failed.returncode != 0 and "OperationalError" in failed.stderr


def test_a_gateway_inside_a_machine_answers_the_host_and_another_machine(
    fleet: Machines, tmp_path: Path
) -> None:
    one, two, _ = fleet
    with running_gateway(
        tmp_path / "work", tmp_path / "data", address=one.address, prefix=one.prefix()
    ) as gateway:
        assert one.holds(gateway.proc.pid)
        status, listing = gateway.get("/v1/models", gateway.issued)  # from the root namespace
        assert status == 200 and listing["object"] == "list"
        answer = fetch(two, f"{gateway.url}/v1/models", key=gateway.issued)
        assert answer["status"] == 200 and json.loads(answer["body"]) == listing
        assert fetch(two, f"{gateway.url}/v1/models")["status"] == 401  # the key is checked
    assert gateway.issued not in str(gateway.proc.args)


def names_left(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name starts with prefix, read afresh."""
    spaces = subprocess.run(
        ["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True
    )
    found = [ns["name"] for ns in json.loads(spaces.stdout or "[]")]
    links = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    found += [link["ifname"] for link in json.loads(links.stdout)]
    return [name for name in found if name.startswith(prefix)]


def routes_in(subnet: ipaddress.IPv4Network) -> list[str]:
    """The root namespace's routes into subnet, in every table."""
    routes = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=True,
    )
    dsts = [r["dst"] for r in json.loads(routes.stdout) if r.get("dst", "default") != "default"]
    return [dst for dst in dsts if ipaddress.IPv4Network(dst, strict=False).overlaps(subnet)]


def test_the_end_removes_all_it_made_even_after_a_failure() -> None:
    with pytest.raises(RuntimeError, match="the body failed"), machines(2) as made:
        names, subnet = made.names, made.subnet
        sleeper = made[0].popen(["sleep", "600"], user=USER)
        assert names_left(names.prefix) and names_left(names.link_prefix)
        assert routes_in(subnet)
        raise RuntimeError("the body failed")
    assert sleeper.wait(30) == -signal.SIGTERM  # ended by the set's end, not left behind
    assert names_left(names.prefix) == [] and names_left(names.link_prefix) == []
    assert routes_in(subnet) == []
    assert leftovers(names) == []


OWNER = """
import json, sys, time
from tests.machines import machines
with machines(2) as made:
    sleeper = made[1].popen(["sleep", "600"])
    print(json.dumps({"id": made.names.id, "sleeper": sleeper.pid}), flush=True)
    time.sleep(600)
"""


def test_a_set_whose_owner_was_killed_is_swept_by_the_next() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    made = json.loads(owner.stdout.readline())
    owner.kill()  # no finally runs: its namespaces, veths and sleeper stay
    owner.wait(30)
    assert names_left(f"lucia-t{made['id']}-")
    sweep()  # as the next set's start does (another test's may have swept it already)
    assert names_left(f"lucia-t{made['id']}-") == [] and names_left(f"lt{made['id']}") == []
    wait_for(lambda: not Path(f"/proc/{made['sleeper']}").exists(), 30, "the sleeper ended")


def test_a_subnet_in_use_is_refused(fleet: Machines) -> None:
    with (
        pytest.raises(SubnetError, match="in use here"),
        machines(1, subnet=fleet.subnet.with_prefixlen),
    ):
        pytest.fail("a second set on the same subnet was made")
    with pytest.raises(SubnetError, match="/24"), machines(1, subnet="100.64.0.0/16"):
        pytest.fail("a /16 was taken")
    assert fetch(fleet[0], f"http://{fleet[1].address}:1/")["errno"] == errno.ECONNREFUSED
