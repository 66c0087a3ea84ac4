"""The page in a fleet: machine a's page lists b's and c's engines, its owner's Stop of b's engine
reaches b's gateway (b's desired.json names machine a), a peer key opens no Start or Stop without
the owner's session, a stale or unreachable machine is a clear refusal, and another machine's
hostile names come as data. Real gateway processes on loopback (test_fleet_routing's three
machines), one PostgreSQL catalog."""

from __future__ import annotations

import http.client
import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor.host.fleet.rows import PeerEngine, document, engine_key, machine_document
from supervisor.host.fleet.tables import CHANNEL
from supervisor.protocol.layout import engine_dir
from supervisor.protocol.reads import read_desired
from tests.host.fleet_world import post
from tests.host.test_fleet_routing import Three, three_machines
from tests.postgres import Cluster
from tests.record_world import until
from tests.standin import free_port

HOSTILE_ENGINE = '<img src=x onerror="alert(1)">\u202e'
HOSTILE_MACHINE = "<script>alert('m')</script>"


@pytest.fixture(scope="module")
def fleet(postgres: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Three]:
    with three_machines(postgres, tmp_path_factory.mktemp("fleet")) as made:
        yield made


def request(
    url: str, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, Any, http.client.HTTPResponse]:
    port = int(url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        connection.request(method, path, body=data, headers=headers)
        answer = connection.getresponse()
        raw = answer.read()
    finally:
        connection.close()
    try:
        return answer.status, json.loads(raw), answer
    except ValueError:
        return answer.status, raw.decode(errors="replace"), answer


class Owner:
    """A signed-in owner of one machine's page: its cookie and CSRF token."""

    def __init__(self, fleet: Three, machine: str) -> None:
        self.url = fleet.gateways[machine].url
        json_type = {"Content-Type": "application/json"}
        status, body, answer = request(
            self.url, "POST", "/page/api/signin", json_type, {"key": fleet.gateways[machine].owner}
        )
        assert status == 200, body
        self.cookie = answer.getheader("Set-Cookie", "").split(";", 1)[0]
        self.csrf = body["csrf"]

    def headers(self, csrf: bool = True) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Cookie": self.cookie}
        return {**headers, "X-CSRF-Token": self.csrf} if csrf else headers

    def overview(self) -> dict[str, Any]:
        status, body, _ = request(self.url, "GET", "/page/api/overview", self.headers())
        assert status == 200, body
        return dict(body)

    def ask(self, machine: str, engine: str, desired: str, *, csrf: bool = True) -> tuple[int, Any]:
        path = f"/page/api/machines/{machine}/engines/{engine}"
        status, body, _ = request(self.url, "POST", path, self.headers(csrf), {"desired": desired})
        return status, body


def desired(fleet: Three, machine: str, engine: str = "small") -> Any:
    return read_desired(engine_dir(fleet.gateways[machine].data_dir, engine))


def others(overview: dict[str, Any]) -> dict[str, Any]:
    return {machine["name"]: machine for machine in overview["fleet"]["machines"]}


def test_the_page_lists_every_other_machines_engines_by_machine(fleet: Three) -> None:
    fleet.fresh()
    page = Owner(fleet, "a")
    shown = until(
        lambda: (o := page.overview())["fleet"]["available"] and {"b", "c"} <= set(others(o)) and o,
        30,
        "b and c on a's page",
    )
    assert shown["fleet"]["machine"] == "a"
    assert "a" not in others(shown)  # this machine's engines are the page's own section
    assert [engine["name"] for engine in shown["engines"]] == ["small"]
    for machine, models in (("b", ["own-b", "shared"]), ("c", ["own-c", "shared"])):
        listed = others(shown)[machine]
        assert listed["stale"] is False and listed["heardAge"] >= 0
        (engine,) = listed["engines"]
        assert (engine["name"], engine["state"], engine["models"]) == ("small", "running", models)
        assert (engine["running"], engine["waiting"]) == (0, 0)


def test_the_owners_stop_of_another_machines_engine_is_written_there_naming_machine_a(
    fleet: Three,
) -> None:
    fleet.fresh()
    page = Owner(fleet, "a")
    before_a = desired(fleet, "a")
    status, body = page.ask("b", "small", "stopped")
    assert status == 202, body
    assert (body["machine"], body["engine"], body["desired"]) == ("b", "small", "stopped")
    written = desired(fleet, "b")
    assert written is not None and (written.desired, written.requested_by) == (
        "stopped",
        "operator@a",
    )
    assert written.generation == body["generation"]
    assert written.operator_stop  # never started on demand until an operator starts it
    assert desired(fleet, "a") == before_a  # nothing asked of a's own engine
    assert "engine requested by a peer" in fleet.gateways["b"].log_text()
    status, body = page.ask("b", "small", "running")
    assert status == 202, body
    again = desired(fleet, "b")
    assert again is not None and (again.desired, again.requested_by) == ("running", "operator@a")
    # b's refusal comes back through a, naming b
    status, body = page.ask("b", "nothing-here", "stopped")
    assert status == 404 and body["error"]["code"] == "engine_not_found", body
    assert body["error"]["machine"] == "b"


def test_no_start_or_stop_without_the_owners_session_and_its_csrf_token(fleet: Three) -> None:
    fleet.fresh()
    before = desired(fleet, "c")
    page = Owner(fleet, "a")
    status, body = page.ask("c", "small", "stopped", csrf=False)
    assert status == 403 and body["error"]["code"] == "csrf_refused", body
    peers = fleet.gateways["a"].data_dir.parent / "peers.keys"
    lines = [line.split() for line in peers.read_text().splitlines() if line[:1] not in "#"]
    keys = {name: key for name, key in lines}
    as_peer = {"Authorization": f"Bearer {keys['a']}", "X-Lucia-Machine": "a"}
    stop = {"desired": "stopped"}
    path = "/page/api/machines/c/engines/small"
    # a peer key is no session: a's page refuses it
    headers = {**as_peer, "X-Lucia-Key-Id": "owner", "Content-Type": "application/json"}
    assert request(page.url, "POST", path, headers, stop)[0] == 401
    # nor is it a caller's key: 403 on the owner API itself
    status, body, _ = request(
        fleet.gateways["c"].url, "POST", "/api/host/engines/small", headers, stop
    )
    assert status == 403 and body["error"]["code"] == "peer_key_on_v1", body
    # on the peer route: only the owner's key id, only a desired state, only with its own key
    url = fleet.gateways["c"].url
    route = "/fleet/api/host/engines/small"
    for key_id in ("inference", "key_0123456789ab"):
        refused = post(url, route, {**headers, "X-Lucia-Key-Id": key_id}, stop)
        assert refused[0] == 403 and refused[1]["error"]["code"] == "permission_denied", refused
    assert post(url, route, headers, {"desired": "stopped", "more": 1})[0] == 400
    wrong = {**headers, "Authorization": f"Bearer {secrets.token_urlsafe(32)}"}
    assert post(url, route, wrong, stop)[0] == 401
    assert request(url, "GET", route, headers)[0] in (404, 405)
    assert desired(fleet, "c") == before  # nothing of it was written


def plant(dsn: str, machine: str, url: str, engine: str, *, fresh: bool) -> None:
    """A machine's rows as its gateway would publish them; `fresh`: its heartbeat an hour
    ahead (heard throughout the test), else an hour old (stale)."""
    row = PeerEngine(machine, engine, url, ("planted",), "running", datetime.now(UTC))
    heard = "now() + interval '1 hour'" if fresh else "now() - interval '1 hour'"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO fleet_machines (machine, doc, heard, version) "
            f"VALUES (%s, %s, {heard}, 1)",
            (machine, machine_document(url)),
        )
        conn.execute(
            "INSERT INTO fleet_engines (machine, engine, doc) VALUES (%s, %s, %s)",
            (machine, engine_key(engine), document(row)),
        )
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, machine))


def test_hostile_names_are_data_and_a_stale_or_unreachable_machine_is_refused(
    fleet: Three, tmp_path: Path
) -> None:
    fleet.fresh()
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    plant(fleet.dsn, HOSTILE_MACHINE, nowhere, HOSTILE_ENGINE, fresh=True)
    plant(fleet.dsn, "gone", nowhere, "small", fresh=False)
    page = Owner(fleet, "a")
    shown = until(
        lambda: {HOSTILE_MACHINE, "gone"} <= set(others(o := page.overview())) and o,
        30,
        "the planted machines on a's page",
    )
    hostile = others(shown)[HOSTILE_MACHINE]
    assert hostile["stale"] is False
    assert [engine["name"] for engine in hostile["engines"]] == [HOSTILE_ENGINE]
    assert others(shown)["gone"]["stale"] is True
    status, body = page.ask("gone", "small", "stopped")
    assert status == 503 and body["error"]["code"] == "machine_stale", body
    assert body["error"]["machine"] == "gone"
    quoted = "%3Cscript%3Ealert('m')%3C%2Fscript%3E"
    status, body = page.ask(quoted, "x", "stopped")
    assert status == 503 and body["error"]["code"] == "machine_unreachable", body
    status, body = page.ask("nobody", "small", "stopped")
    assert status == 404 and body["error"]["code"] == "machine_not_found", body
    status, body = page.ask("a", "small", "stopped")
    assert status == 409, body
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:  # the test's own rows go
        conn.execute(
            "DELETE FROM fleet_machines WHERE machine = ANY(%s)", ([HOSTILE_MACHINE, "gone"],)
        )
