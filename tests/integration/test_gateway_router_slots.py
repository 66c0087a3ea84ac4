"""Admission follows the engine, on the real parts: the real llama-server router (Debian sid's)
with a context small for its slots, its worker publishing the model's slots in status.json,
and the real gateway process admitting that many at once.

The router is the demo's before issue 35: `ctx-size = 256` for a model whose own context is 256,
and llama-server's auto slots (4 of them, sharing one cache of 256 cells). A chat of the demo's
takes 67 tokens, so 4 at once overflow the shared cache ("Context size has been exceeded", 500);
the worker publishes 1 slot (the cache holds one slot's whole context), and the gateway, with no
`[limits] running` set, sends one at a time: 16 chats at once are all answered. The demo's
recipe since (`ctx-size = 1024`) holds 4 slots' whole contexts: 4 at once, all answered too.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import docker
import openai
import pytest

from tests.fixtures import Engine, own_recipe_factory
from tests.gateway_proc import Gateway, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama

pytestmark = pytest.mark.docker

CONTEXT = 256  # the tiny model's own context: each slot's
# the router's ctx-size (its shared cache) -> the slots the worker publishes
SLOTS = {256: 1, 1024: 4}
SETTINGS = """[limits]
waiting = 64
load_wait_s = 300
"""  # running unset: the engine's slots
HELLO = [{"role": "user", "content": "hello"}]  # the demo's chat
MOST = 8  # the tokens each chat may generate (the model may end one sooner)
AT_ONCE = 16


@pytest.fixture(scope="module", params=sorted(SLOTS), ids=lambda ctx: f"ctx-size-{ctx}")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine serving `tiny` with llama-server's auto slots in a cache of
    ctx-size cells, running."""
    directory = tmp_path_factory.mktemp("gateway-slots")
    factory = own_recipe_factory(client, base_image, directory, request)
    engine = factory(
        kind="llama-router",
        models_max=1,
        load_on_startup=("tiny",),
        defaults={"ctx-size": request.param},
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


def _props(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/props?model=tiny&autoload=false", timeout=10) as answer:
        return dict(json.loads(answer.read()))


def _chat(gateway: Gateway) -> tuple[int, str]:
    """One demo chat through the gateway: its status, and the error message when not 200."""
    try:
        answer = gateway.client(timeout=120).chat.completions.with_raw_response.create(
            model="tiny", messages=HELLO, max_tokens=MOST
        )
    except openai.APIStatusError as error:
        return error.status_code, error.message
    return answer.http_response.status_code, ""


def _slots(router: Engine) -> int:
    return SLOTS[router.defaults["ctx-size"]]


def test_the_worker_publishes_the_slots_the_routers_cache_holds(router: Engine) -> None:
    status = router.wait_status(
        lambda s: s["state"] == "running" and bool(s.get("slots")),
        timeout=60,
        what="the model's slots",
    )
    props = _props(status["url"])
    # llama-server's own figures: 4 slots, each of a 256-token context, in one shared cache
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (4, CONTEXT)
    assert status["slots"] == {"tiny": _slots(router)}


def test_sixteen_chats_at_once_through_the_gateway_are_all_answered(
    router: Engine, gateway: Gateway
) -> None:
    first = gateway.client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=MOST)
    assert first.usage is not None
    # a chat may take more than a quarter of the cache (its prompt and what it may generate;
    # the tiny model ends some sooner): the 4 slots cannot all hold one at once
    assert 4 * (first.usage.prompt_tokens + MOST) > CONTEXT, first.usage
    with ThreadPoolExecutor(AT_ONCE) as pool:
        answers = list(pool.map(lambda _: _chat(gateway), range(AT_ONCE)))
    codes = Counter(code for code, _ in answers)
    refused = sorted({message for code, message in answers if code != 200})
    assert codes == Counter({200: AT_ONCE}), (codes, refused)
    code, body = gateway.get("/api/host/engines", gateway.owner)
    assert code == 200
    (row,) = [row for row in body["engines"] if row["name"] == router.name]
    assert row["bound"] == _slots(router) and row["status"]["slots"] == {"tiny": _slots(router)}
