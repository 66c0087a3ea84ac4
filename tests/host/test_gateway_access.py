"""Roles and the host API: the inference role may call /v1 only, the owner also the host API,
which shows each engine's status and writes desired.json through the protocol's host module;
and on the real gateway process, paths that name the host API or another engine through
percent-encoding or dot segments reach neither."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from supervisor.host.web.auth import allowed
from tests.gateway_proc import running_gateway
from tests.host.gateway_world import AUTH, OWNER, SETTINGS, World, stale, world, write_status

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def run(tmp_path: Path, scenario: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        async with world(tmp_path, SETTINGS) as w:
            await scenario(w)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "role", "access"),
    [
        ("/v1/chat/completions", "inference", "allowed"),
        ("/v1/models", "inference", "allowed"),
        ("/api/host/engines", "inference", "forbidden"),
        ("/api/host/engines/small", "inference", "forbidden"),
        ("/v1", "inference", "forbidden"),
        ("/anything", "inference", "forbidden"),
        ("/api/host/engines", "owner", "allowed"),
        ("/v1/chat/completions", "owner", "allowed"),
        ("/metrics", None, "open"),
        ("/healthz", None, "open"),
        ("/healthz/", None, "forbidden"),
        ("/v1/models", None, "forbidden"),
        ("/fleet/v1/chat/completions", None, "peer"),  # its own peer key check (host/fleet)
        ("/fleet/v1/chat/completions", "owner", "peer"),
    ],
)
def test_what_each_role_may_call(path: str, role: str | None, access: str) -> None:
    assert allowed(path, role) == access  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        ("GET", "/api/host/engines", AUTH, 403, "permission_denied"),
        ("POST", "/api/host/engines/small", AUTH, 403, "permission_denied"),
        ("GET", "/api/host/engines", {}, 401, "invalid_api_key"),
        (
            "POST",
            "/api/host/engines/small",
            {"Authorization": "Bearer nope"},
            401,
            "invalid_api_key",
        ),
        ("GET", "/v1/models", {}, 401, "invalid_api_key"),
        ("GET", "/v1/models", OWNER, 200, None),
        ("GET", "/v1/models", AUTH, 200, None),
        ("GET", "/api/host/engines", OWNER, 200, None),
    ],
)
def test_the_role_table_end_to_end(
    tmp_path: Path,
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with (
            aiohttp.ClientSession(headers=headers) as s,
            s.request(method, str(w.gateway.make_url(path)), json={"desired": "running"}) as r,
        ):
            assert r.status == status
            document = await r.json()
        if code is not None:
            assert document["error"]["code"] == code
        if status == 403:
            assert "needs the owner key" in document["error"]["message"]
            assert "role is inference" in document["error"]["message"]
        assert w.desired() is None  # nothing refused wrote a request

    run(tmp_path, scenario)


@pytest.mark.parametrize("headers", [{}, AUTH, OWNER])
def test_with_the_fleet_off_the_peer_route_is_404_and_refusals_name_no_machine(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url)
        async with aiohttp.ClientSession(headers=headers) as s:
            fleet = str(w.gateway.make_url("/fleet/v1/chat/completions"))
            async with s.post(fleet, json=CHAT) as r:
                assert r.status == 404
            async with s.post(str(w.gateway.make_url("/v1/chat/completions")), json={}) as r:
                error = (await r.json())["error"]
                assert r.status == (401 if not headers else 400) and "machine" not in error
        assert w.upstream.bodies == []

    run(tmp_path, scenario)


def test_the_owner_sees_each_engine_and_whether_its_heartbeat_is_fresh(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url, generation=3)
        write_status(w.data, "old", "stopped", checked_at=stale(), models=("old-m",))
        async with (
            aiohttp.ClientSession(headers=OWNER) as s,
            s.get(str(w.gateway.make_url("/api/host/engines"))) as r,
        ):
            rows = {row["name"]: row for row in (await r.json())["engines"]}
        assert rows["small"]["fresh"] is True and rows["old"]["fresh"] is False
        assert rows["small"]["status"]["state"] == "running"
        assert rows["small"]["status"]["generation"] == 3
        assert rows["small"]["status"]["models"] == ["tiny"]
        assert rows["old"]["status"]["checkedAt"].endswith("Z")
        assert (rows["small"]["running"], rows["small"]["waiting"]) == (0, 0)
        assert rows["small"]["startedByGateway"] is False

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("name", "payload", "status", "code"),
    [
        ("small", {"desired": "running"}, 202, None),
        ("small", {"desired": "stopped"}, 202, None),
        ("small", {"desired": "paused"}, 400, "invalid_request"),
        ("small", {"desired": "running", "x": 1}, 400, "invalid_request"),
        ("small", ["running"], 400, "invalid_request"),
        ("ghost", {"desired": "running"}, 404, "engine_not_found"),
        ("Bad..Name", {"desired": "running"}, 400, "invalid_request"),
    ],
)
def test_the_owner_asks_an_engine_to_run_or_stop(
    tmp_path: Path, name: str, payload: object, status: int, code: str | None
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped", generation=4)
        async with (
            aiohttp.ClientSession(headers=OWNER) as s,
            s.post(str(w.gateway.make_url(f"/api/host/engines/{name}")), json=payload) as r,
        ):
            assert r.status == status
            document = await r.json()
        desired = w.desired()
        if code is None:
            assert isinstance(payload, dict)
            assert document == {"engine": "small", "desired": payload["desired"], "generation": 5}
            assert (desired.generation, desired.desired) == (5, payload["desired"])
        else:
            assert document["error"]["code"] == code
            assert desired is None
        assert not (w.data / "ghost").exists()

    run(tmp_path, scenario)


ENCODED = [
    # (method, path, caller, status): a path that names the host API (or another engine)
    # through encoding or dot segments reaches neither; the statuses as the gateway answers
    ("GET", "/page%2F..%2Fapi%2Fhost%2Fengines", None, 404),
    ("GET", "/page/..%2Fapi%2Fhost%2Fengines", None, 404),
    ("GET", "/page/../api/host/engines", None, 404),
    ("GET", "/page%2F../api/host/engines", None, 404),
    ("GET", "/page/%2E%2E/api/host/engines", None, 404),
    ("GET", "/page/api/..%2F..%2Fapi%2Fhost%2Fengines", None, 401),
    ("GET", "//api/host/engines", None, 401),
    ("GET", "/v1/../api/host/engines", "inference", 404),
    ("GET", "/v1/%2E%2E/api/host/engines", "inference", 404),
    ("GET", "/v1%2F..%2Fapi%2Fhost%2Fengines", "inference", 404),
    ("POST", "/v1/..%2Fapi%2Fhost%2Fengines%2Fsmall", "inference", 404),
    ("POST", "/v1/../api/host/engines/small", "inference", 404),
    ("POST", "/page/api/engines/..%2F..%2Fsmall", None, 401),
    ("POST", "/page/api/engines/small", None, 401),
    ("POST", "/api/host/engines/sm%2Fall", "owner", 400),
    ("POST", "/api/host/engines/..%2Fsmall", "owner", 400),
    ("POST", "/api/host/engines/%2E%2E", "owner", 400),
    ("POST", "/api/host/engines/small%2F..%2Fother", "owner", 400),
    ("POST", "/api/host/engines/%2Fetc", "owner", 400),
]


def test_encoded_paths_reach_nothing_on_the_real_gateway(tmp_path: Path) -> None:
    """Through real sockets to the gateway process, each path sent as written (http.client
    neither decodes nor folds dot segments): the role table and the engine names hold."""
    data = tmp_path / "data"
    write_status(data, "small", "stopped")
    write_status(data, "other", "stopped")
    before = sorted(p.relative_to(data).as_posix() for p in data.rglob("*"))
    with running_gateway(tmp_path / "gateway", data) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        keys = {None: None, "inference": gw.inference, "owner": gw.owner}
        found = []
        for method, path, caller, _ in ENCODED:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            headers = {"Content-Type": "application/json"}
            if keys[caller] is not None:
                headers["Authorization"] = f"Bearer {keys[caller]}"
            body = json.dumps({"desired": "running"}) if method == "POST" else None
            try:
                connection.request(method, path, body=body, headers=headers)
                answer = connection.getresponse()
                text = answer.read().decode(errors="replace")
            finally:
                connection.close()
            found.append((method, path, caller, answer.status))
            assert '"engines"' not in text and '"generation"' not in text, (path, text)
        assert gw.get("/api/host/engines", gw.owner)[0] == 200, "the plain path answers"
    assert found == ENCODED
    after = sorted(p.relative_to(data).as_posix() for p in data.rglob("*"))
    assert [
        p
        for p in after
        if p not in before and not p.startswith(("record", "telemetry", "inference-keys"))
    ] == []
    assert not list(data.rglob("desired.json")), "nothing was asked of any engine"
