"""Callers exempt from the budget, and one key's share of the waiting, on the real parts: the
real llama-server router (Debian sid's) serving a tiny llama model, the real gateway process
with a daily budget and a share of one waiting place per key, keys made with the real CLI, and
the official `openai` client.

An exempt key spends past the budget and is served on; its rows and tokens are in the record
as any key's. Then, while its long stream holds the engine's one slot and its next request
waits, its third is refused with 429 `key_busy`, and another key's request is still admitted
to wait, and answered once the slot comes free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import docker
import openai
import pytest

from tests.fixtures import Engine, own_recipe_factory
from tests.gateway_proc import Gateway, metric, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

CONTEXT = 32768  # a long answer: a slow reader holds the one slot while the engine writes on
BUDGET = 100  # tokens a day for every key that is not exempt
SETTINGS = f"""[limits]
running = 1
waiting = 4
per_key_waiting = 1
load_wait_s = 300
[budget]
daily_tokens = {BUDGET}
"""
HI = [{"role": "user", "content": "hi"}]
WHOLE = {"ignore_eos": True}  # llama-server's own: as many tokens as asked, whatever is drawn
ANSWER = 40  # completion tokens of each of the exempt key's chats


@pytest.fixture(scope="module")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine serving `tiny`, running."""
    factory = own_recipe_factory(client, base_image, tmp_path_factory.mktemp("exempt"), request)
    engine = factory(
        kind="llama-router",
        models_max=1,
        load_on_startup=("tiny",),
        defaults={"ctx-size": CONTEXT},
    )
    engine.models_dir.mkdir(exist_ok=True)
    write_llama(add_model(engine.models_dir, "Ready") / "tiny.gguf", TinyLlama(context=CONTEXT))
    engine.start_worker()
    engine.wait_state(engine.request("running"), "running", timeout=120)
    yield engine
    factory.close()


@pytest.fixture(scope="module")
def gateway(router: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("gateway"), router.data_dir, SETTINGS) as gw:
        yield gw


@pytest.fixture(scope="module")
def radar(gateway: Gateway) -> str:
    """An issued key exempt from the daily budget, as an operator makes one."""
    key = gateway.create_key("radar", "--exempt")
    wait_for(lambda: gateway.get("/v1/models", key)[0] == 200, 10, "the new key accepted")
    return key


def _by_key(gateway: Gateway) -> dict[str, dict[str, Any]]:
    """The record's figures by key name, as `lucia-supervisor usage --by key --json` gives."""
    settings = str(gateway.log.parent / "gateway.toml")
    done = gateway.cli("usage", "--since", "1h", "--by", "key", "--json", "--settings", settings)
    return {group["name"]: group for group in json.loads(done.stdout)["groups"]}


def _spent(gateway: Gateway, key: str) -> int | None:
    code, body = gateway.get("/v1/budget", key)
    assert code == 200, body
    spent: int | None = body["spent_tokens"]
    return spent


def test_an_exempt_key_past_the_budget_is_served_and_recorded(gateway: Gateway, radar: str) -> None:
    chats = 0
    while (_spent(gateway, radar) or 0) <= BUDGET or chats < 4:
        answer = gateway.client(radar).chat.completions.create(
            model="tiny", messages=HI, max_tokens=ANSWER, extra_body=WHOLE
        )
        assert answer.usage is not None and answer.usage.completion_tokens == ANSWER
        chats += 1
        assert chats <= 10, "each chat is counted: the spending passes the budget"
    answer = gateway.client(radar).chat.completions.create(
        model="tiny", messages=HI, max_tokens=ANSWER, extra_body=WHOLE
    )
    assert answer.usage is not None, "served past the budget"
    chats += 1
    code, stood = gateway.get("/v1/budget", radar)
    assert code == 200
    assert (stood["enforced"], stood["exempt"], stood["budget_tokens"]) == (False, True, None)
    # the budget is enforced in this gateway all the same: a key held to one token a day
    person = gateway.create_key("person", "--budget", "1")
    with pytest.raises(openai.RateLimitError) as refused:
        gateway.client(person).chat.completions.create(model="tiny", messages=HI, max_tokens=4)
    assert refused.value.response.json()["error"]["code"] == "budget_exceeded"

    def recorded() -> dict[str, Any] | None:
        group = _by_key(gateway).get("radar")
        return group if group is not None and group["ok"] == chats else None

    wait_for(lambda: recorded() is not None, 30, "the exempt key's rows committed")
    group = recorded()
    assert group is not None
    assert group["requests"] == chats and group["completionTokens"] == chats * ANSWER
    assert group["promptTokens"] > 0 and group["refusals"] == {}
    assert _spent(gateway, radar) == group["promptTokens"] + group["completionTokens"]


def test_one_key_past_its_share_is_refused_key_busy_while_another_is_admitted(
    router: Engine, gateway: Gateway, radar: str
) -> None:
    owner = gateway.owner

    def waiting() -> int:
        code, body = gateway.get("/api/host/engines", owner)
        assert code == 200
        (row,) = [row for row in body["engines"] if row["name"] == router.name]
        return int(row["waiting"])

    def chat(key: str) -> int:
        answer = gateway.client(key, timeout=300).chat.completions.with_raw_response.create(
            model="tiny", messages=HI, max_tokens=4, extra_body=WHOLE
        )
        return answer.http_response.status_code

    stream = gateway.client(radar, timeout=300).chat.completions.create(
        model="tiny", messages=HI, max_tokens=CONTEXT - 64, stream=True, extra_body=WHOLE
    )
    next(iter(stream))  # the radar's long answer holds the one slot
    with ThreadPoolExecutor(2) as pool:
        try:
            queued: list[Future[int]] = [pool.submit(chat, radar)]
            wait_for(lambda: waiting() == 1, 30, "the radar's second request waiting")
            with pytest.raises(openai.RateLimitError) as refused:
                gateway.client(radar).chat.completions.create(
                    model="tiny", messages=HI, max_tokens=4
                )
            response = refused.value.response
            assert int(response.headers["retry-after"]) >= 1
            body = response.json()
            assert body["error"]["code"] == "key_busy"
            assert (body["engine"], body["key_waiting"], body["per_key_waiting"]) == (
                router.name,
                1,
                1,
            )
            other = gateway.create_key("other")  # another key, the default budget
            queued.append(pool.submit(chat, other))
            wait_for(lambda: waiting() == 2, 30, "the other key's request admitted to wait")
        finally:
            stream.close()  # the client goes: the slot comes free
        assert [future.result(timeout=300) for future in queued] == [200, 200]
    refusals = metric(gateway.metrics(), "lucia_gateway_refusals_total", reason="key_busy")
    assert refusals == 1
    wait_for(
        lambda: _by_key(gateway)["radar"]["refusals"] == {"key_busy": 1},
        30,
        "the refusal recorded as refused:key_busy",
    )
