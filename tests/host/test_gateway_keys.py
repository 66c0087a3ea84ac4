"""A key works as soon as `keys create` has printed it, and a revoked one stops within a second:
the real CLI beside the real gateway process, in a loop, as an operator scripts it
(`KEY=$(lucia-supervisor keys create laptop)`, then a request with `$KEY` at once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway_proc import Gateway, running_gateway
from tests.system.harness import wait_for

ROUNDS = 10


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("keys-gateway")
    data = work / "data"
    data.mkdir()
    with running_gateway(work / "gateway", data) as running:
        yield running


def test_a_key_is_accepted_the_moment_keys_create_prints_it(gateway: Gateway) -> None:
    """Was: 7 of 10 refused with 401, since the gateway looked at keys.json at most once a
    second."""
    answers = []
    for round_ in range(ROUNDS):
        key = gateway.create_key(f"laptop-{round_}")
        answers.append(gateway.get("/v1/models", key)[0])
    assert answers == [200] * ROUNDS


def test_a_revoked_key_is_refused_within_a_second_and_a_bad_one_never_accepted(
    gateway: Gateway,
) -> None:
    key = gateway.create_key("revoked-soon")
    assert gateway.get("/v1/models", key)[0] == 200
    gateway.cli("keys", "revoke", "revoked-soon")
    wait_for(lambda: gateway.get("/v1/models", key)[0] == 401, 60, "the revoked key refused")
    # refused for good: neither a look again at the file nor a new key brings it back (401,
    # then 429 once this address has sent more invalid keys than the failure limit's 10)
    gateway.create_key("another")
    statuses = [gateway.get("/v1/models", key)[0] for _ in range(20)]
    assert statuses == sorted(statuses) and set(statuses) == {401, 429}, statuses
    assert gateway.get("/v1/models", "lucia_inf_" + "x" * 43)[0] == 429
    assert gateway.get("/v1/models", gateway.issued)[0] == 200, "a valid key from it still works"


def test_keys_never_reach_the_log(gateway: Gateway) -> None:
    key = gateway.create_key("logged")
    assert gateway.get("/v1/models", key)[0] == 200
    assert key not in gateway.log_text()
