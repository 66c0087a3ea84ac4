"""The peer route between two real gateway processes sharing one PostgreSQL record: a peer's
request is served by this machine's engine and recorded once, naming it; wrong, revoked and
missing peer keys are 401 and said in the journal; a peer key on /v1 is 403; the budget holds
through the peer route as it does locally."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any

import aiohttp
import psycopg
import pytest

from tests.host.fleet_world import (
    CHAT,
    Fleet,
    fleet,
    fresh,
    new_key_id,
    peer_headers,
    post,
    write_peers,
)
from tests.record_world import until

ROUTE = "/fleet/v1/chat/completions"


__all__ = ["fleet", "fresh"]  # the fixtures, imported: machines a and b


def test_a_peer_request_is_served_by_this_machines_engine_and_recorded_once_naming_it(
    fleet: Fleet,
) -> None:
    b, upstream = fleet.gateways["b"], fleet.upstreams["b"]
    key_id = new_key_id()
    before = len(upstream.bodies)
    status, answer = post(b.url, ROUTE, peer_headers(fleet.keys["a"], "a", key_id))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "toktoktok"
    assert len(upstream.bodies) == before + 1
    sent = {name.lower() for name in upstream.headers[-1]}
    assert "authorization" not in sent and not any(h.startswith("x-lucia") for h in sent)
    assert fleet.recorded(key_id) == [("b", "ok", "small", "tiny")]
    a = fleet.gateways["a"]  # a's own request is a's row: one record, each row its machine
    owner = {"Authorization": f"Bearer {a.owner}", "Content-Type": "application/json"}
    assert post(a.url, "/v1/chat/completions", owner)[0] == 200
    assert fleet.recorded("owner") == [("a", "ok", "small", "tiny")]
    assert fleet.rows(key_id) == [("b", "ok", "small", "tiny")], "recorded once"


def test_a_peer_stream_is_served_and_a_refusal_names_the_machine(fleet: Fleet) -> None:
    b = fleet.gateways["b"]
    key_id = new_key_id()

    async def main() -> list[str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                b.url + ROUTE,
                json={**CHAT, "stream": True},
                headers=peer_headers(fleet.keys["a"], "a", key_id),
            ) as answer,
        ):
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/event-stream")
            return await _lines(answer)

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert fleet.recorded(key_id) == [("b", "ok", "small", "tiny")]
    status, answer = post(
        b.url, ROUTE, peer_headers(fleet.keys["a"], "a", key_id), {**CHAT, "model": "absent"}
    )
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert answer["error"]["machine"] == "b"


async def _lines(answer: aiohttp.ClientResponse) -> list[str]:
    text = (await answer.read()).decode()
    return [line for line in text.splitlines() if line]


def refused_lines(log: str, start: int) -> list[str]:
    return [line for line in log[start:].splitlines() if "peer refused" in line]


@pytest.mark.parametrize(
    ("who", "reason"),
    [
        ("wrong", "not this machine's peer key"),  # a's name, another machine's key
        ("random", "not this machine's peer key"),
        ("unknown", "a machine the peers file does not name"),
        ("no key", "no peer key"),
        ("no machine", "no X-Lucia-Machine"),
        ("owner key", "not this machine's peer key"),
    ],
)
def test_a_wrong_or_missing_peer_key_is_401_and_said_in_the_journal(
    fleet: Fleet, who: str, reason: str
) -> None:
    b = fleet.gateways["b"]
    random = "r" * 43
    key, machine = {
        "wrong": (fleet.keys["c"], "a"),
        "random": (random, "a"),
        "unknown": (fleet.keys["a"], "zz"),
        "no key": (None, "a"),
        "no machine": (fleet.keys["a"], None),
        "owner key": (b.owner, "a"),
    }[who]
    start = len(b.log_text())
    before = len(fleet.upstreams["b"].bodies)
    status, answer = post(b.url, ROUTE, peer_headers(key, machine, new_key_id()))
    assert status == 401, answer
    assert answer["error"]["code"] == "peer_unauthorized" and answer["error"]["machine"] == "b"
    assert len(fleet.upstreams["b"].bodies) == before
    lines = until(lambda: refused_lines(b.log_text(), start), 30, "the journal line")
    assert len(lines) == 1 and reason in lines[0]
    assert f"machine='{machine or '(none)'}'" in lines[0]
    text = b.log_text()
    assert all(k not in text for k in (*fleet.keys.values(), random, b.owner))


def test_a_line_removed_while_the_gateway_runs_revokes_that_machine(fleet: Fleet) -> None:
    b = fleet.gateways["b"]
    key_id = new_key_id()
    headers = peer_headers(fleet.keys["c"], "c", key_id)
    assert post(b.url, ROUTE, headers)[0] == 200
    write_peers(fleet.peers_file, {m: k for m, k in fleet.keys.items() if m != "c"})
    try:
        start = len(b.log_text())
        status, answer = post(b.url, ROUTE, headers)
        assert status == 401 and answer["error"]["code"] == "peer_unauthorized"
        lines = until(lambda: refused_lines(b.log_text(), start), 30, "the journal line")
        assert "machine='c'" in lines[0] and "revoked" in lines[0]
        assert post(b.url, ROUTE, peer_headers(fleet.keys["a"], "a", key_id))[0] == 200
    finally:
        write_peers(fleet.peers_file, fleet.keys)
    assert post(b.url, ROUTE, headers)[0] == 200, "its line back: c again"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
def test_a_peer_key_on_v1_is_403(fleet: Fleet, path: str) -> None:
    for name, gateway in fleet.gateways.items():
        status, answer = _call(gateway.url, path, fleet.keys["a"])
        assert status == 403 and answer["error"]["code"] == "peer_key_on_v1"
        assert answer["error"]["machine"] == name
    b = fleet.gateways["b"]
    assert "peer key presented on /v1" in b.log_text()
    assert fleet.keys["a"] not in b.log_text()
    status, answer = _call(b.url, path, "w" * 40)  # no key of anyone's: still 401, naming b
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert answer["error"]["machine"] == "b"


def _call(url: str, path: str, key: str) -> tuple[int, Any]:
    """A GET of /v1/models or a POST of a chat, with `key` as the bearer."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if not path.endswith("models"):
        return post(url, path, headers)
    request = urllib.request.Request(url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_budget_holds_through_the_peer_route_as_it_does_locally(fleet: Fleet) -> None:
    b = fleet.gateways["b"]
    listed = json.loads(b.cli("keys", "list", "--json").stdout)
    key_id = next(k["id"] for k in listed if k["name"].startswith("tests-"))
    today = datetime.now(UTC).date().isoformat()
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO daily_totals (day, key_id, tokens, requests) VALUES (%s, %s, 5000, 1)",
            (today, key_id),
        )
    local = {"Authorization": f"Bearer {b.issued}", "Content-Type": "application/json"}
    until(lambda: post(b.url, "/v1/chat/completions", local)[0] == 429, 30, "the budget read")
    status, here = post(b.url, "/v1/chat/completions", local)
    peer = peer_headers(fleet.keys["a"], "a", key_id)
    status, there = post(b.url, ROUTE, peer)
    assert status == 429 and there["error"]["code"] == here["error"]["code"] == "budget_exceeded"
    assert there["budget"] == here["budget"] and there["error"]["machine"] == "b"
    assert re.search(r"daily budget is 1000\b", there["error"]["message"])
    assert post(b.url, ROUTE, {**peer, "X-Lucia-Key-Exempt": "1"})[0] == 200
    assert post(b.url, ROUTE, {**peer, "X-Lucia-Key-Budget": "100000"})[0] == 200
    status, answer = post(b.url, ROUTE, {**peer, "X-Lucia-Key-Budget": "lots"})
    assert status == 401 and answer["error"]["code"] == "peer_unauthorized"


def test_an_address_past_its_limit_of_failed_peer_keys_gets_429(fleet: Fleet) -> None:
    a = fleet.gateways["a"]  # its own count: the other cases' failures were b's
    wrong = peer_headers("x" * 40, "b", new_key_id())
    codes = [post(a.url, ROUTE, wrong)[0] for _ in range(11)]
    assert codes == [401] * 10 + [429]
    assert post(a.url, ROUTE, peer_headers(fleet.keys["b"], "b", new_key_id()))[0] == 200
