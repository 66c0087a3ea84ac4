"""The bearer key's failure limit, per client address: past it, an address's invalid keys get
429 with Retry-After; a valid key works from every address, that one too; a request with no key
is not counted (a web page elsewhere can send one from the owner's browser). In process, and on
the real gateway process from 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import asyncio
import http.client
from pathlib import Path

from supervisor.host.failures import FailureLimit
from supervisor.host.gateway.app import GATEWAY
from supervisor.host.web.auth import check_bearer
from supervisor.host.web.refusal import Refusal
from tests.gateway_proc import running_gateway
from tests.host.gateway_world import INFERENCE_KEY, KEYS, OWNER_KEY, SETTINGS, world
from tests.host.test_page import Clock
from tests.host.test_page_signin import session_from

WRONG = "wrong-key-" + "w" * 32


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_limit_counts_invalid_keys_and_never_refuses_a_valid_one() -> None:
    clock = Clock()
    failures = FailureLimit(allowed=2, window_s=60, clock=clock)

    def status(key: str | None, address: str, path: str = "/v1/models") -> int:
        try:
            check_bearer(KEYS, failures, path, None if key is None else f"Bearer {key}", address)
        except Refusal as refusal:
            return refusal.status
        return 200

    assert [status(WRONG, "a") for _ in range(3)] == [401, 401, 429]
    assert status(INFERENCE_KEY, "a") == 200 and status(OWNER_KEY, "a") == 200
    assert status(INFERENCE_KEY, "a", "/api/host/engines") == 403
    assert status(WRONG, "b") == 401, "each address counts its own"
    assert [status(None, "c") for _ in range(5)] == [401] * 5
    assert failures.blocked("c") == 0, "no key is not counted"
    clock.now += 60
    assert status(WRONG, "a") == 401, "the window moved on"


def test_an_address_past_the_limit_gets_429_and_valid_keys_still_work(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            world(tmp_path, SETTINGS) as w,
            session_from("127.0.0.2") as noisy,
            session_from("127.0.0.1") as owner,
        ):
            failures = FailureLimit(allowed=3, window_s=60, clock=Clock())
            w.gateway.app[GATEWAY].failures = failures
            models = str(w.gateway.make_url("/v1/models"))
            claims = {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}
            for _ in range(3):
                async with noisy.get(models, headers={**bearer(WRONG), **claims}) as answer:
                    assert answer.status == 401
            async with noisy.get(models, headers=bearer(WRONG)) as answer:
                assert answer.status == 429
                assert int(answer.headers["Retry-After"]) >= 1
                assert (await answer.json())["error"]["code"] == "too_many_failures"
            assert failures.blocked("127.0.0.2") > 0 and failures.blocked("127.0.0.1") == 0
            for session, key in ((owner, OWNER_KEY), (noisy, INFERENCE_KEY), (noisy, OWNER_KEY)):
                async with session.get(models, headers=bearer(key)) as answer:
                    assert answer.status == 200
            for _ in range(10):
                async with owner.get(models) as answer:
                    assert answer.status == 401
            assert failures.blocked("127.0.0.1") == 0, "requests without a key are not counted"

    asyncio.run(main())


def get_from(address: str, port: int, key: str | None, **headers: str) -> tuple[int, str | None]:
    """GET /v1/models over a connection from `address`: the status and its Retry-After."""
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=30, source_address=(address, 0)
    )
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request("GET", "/v1/models", headers=headers)
        answer = connection.getresponse()
        answer.read()
        return answer.status, answer.getheader("Retry-After")
    finally:
        connection.close()


def test_the_real_gateway_limits_invalid_keys_per_address(tmp_path: Path) -> None:
    """Through real sockets, the gateway process's default limit (10 a minute)."""
    data = tmp_path / "data"
    data.mkdir()
    with running_gateway(tmp_path / "gateway", data) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        claims = {"X-Forwarded-For": "127.0.0.1"}
        for _ in range(10):
            assert get_from("127.0.0.2", port, WRONG, **claims)[0] == 401
        status, wait = get_from("127.0.0.2", port, WRONG)
        assert status == 429 and wait is not None and int(wait) >= 1
        assert get_from("127.0.0.2", port, gw.issued)[0] == 200, "a valid key still works"
        assert get_from("127.0.0.1", port, gw.owner)[0] == 200
        assert get_from("127.0.0.1", port, WRONG)[0] == 401, "another address counts its own"
        assert 'reason="too_many_failures"' in gw.metrics()
        assert gw.owner not in gw.log_text() and WRONG not in gw.log_text()
