"""The operator's word stands, on the real parts: the real llama-server router serving `tiny`,
its real worker, and the real gateway process with idle stop on, chatting with an issued
inference key through the official `openai` client.

In this order, one engine and one gateway for the module (the demo's measured case: the owner
stopped demo-router, and the next chat for tiny started it again):

1. a worker nobody asked anything of: a chat starts the engine on demand (the gateway's
   request), and idle stop stops it again (the gateway's too);
2. a chat starts the engine the gateway stopped for idling again;
3. `lucia-supervisor request NAME stopped --wait`, then chats: 503 naming the operator, when
   and the generation, and the engine stays stopped (desired.json's generation unchanged);
4. an operator's start, then a chat: served, and never stopped for idling;
5. a second engine naming tiny whose worker is gone (its heartbeat 126 s old, first by name):
   the chats go to the router, none is refused "worker unavailable";
6. the owner's stop through the host API while its worker is away (desired.json `stopped`,
   status.json still `running`): 503, no new `running`, and the router not forwarded to; the
   worker, back, carries the stop out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import docker
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from supervisor.protocol.documents import Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from tests.fixtures import CLI, ROOT, Engine, own_recipe_factory
from tests.gateway_proc import Gateway, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

IDLE_S = 4
SETTINGS = f"""[limits]
load_wait_s = 300
[idle]
stop_after_s = {IDLE_S}
"""
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine serving `tiny`, its worker running, nothing asked of it yet."""
    directory = tmp_path_factory.mktemp("gateway-owner")
    factory = own_recipe_factory(client, base_image, directory, request)
    engine = factory(kind="llama-router", models_max=1, defaults={"ctx-size": 1024})
    engine.models_dir.mkdir(exist_ok=True)
    write_llama(add_model(engine.models_dir, "Ready") / "tiny.gguf", TinyLlama(context=256))
    engine.start_worker()
    engine.wait_status(
        lambda s: s["generation"] == 0 and s["state"] == "stopped" and s["models"] == ["tiny"],
        timeout=60,
        what="the fresh worker's models",
    )
    assert not (engine.dir / "desired.json").exists()
    yield engine
    factory.close()


@pytest.fixture(scope="module")
def gateway(router: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("gateway"), router.data_dir, SETTINGS) as gw:
        yield gw


def desired(router: Engine) -> dict[str, Any]:
    return dict(json.loads((router.dir / "desired.json").read_text()))


def served(gateway: Gateway) -> None:
    """A chat for tiny with the issued inference key, answered by the engine."""
    answer = gateway.client(timeout=300).chat.completions.create(
        model="tiny", messages=HI, max_tokens=4
    )
    assert answer.choices and answer.usage is not None and answer.usage.completion_tokens > 0


def chat(gateway: Gateway) -> tuple[int, dict[str, Any]]:
    """The same chat as plain HTTP: its status and its whole JSON body."""
    request = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        method="POST",
        data=json.dumps({"model": "tiny", "messages": HI, "max_tokens": 4}).encode(),
        headers={"Authorization": f"Bearer {gateway.issued}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, dict(json.loads(answer.read()))
    except urllib.error.HTTPError as error:
        return error.code, dict(json.loads(error.read()))


def refused_by_operator(gateway: Gateway, router: Engine, generation: int) -> None:
    """A chat is answered 503 naming the operator, when and the generation."""
    code, body = chat(gateway)
    assert code == 503, body
    asked = desired(router)
    assert asked["requestedBy"] == "operator" and asked["generation"] == generation
    error = body["error"]
    assert error["code"] == "model_not_loaded"
    assert error["message"].startswith(
        f"engine {router.name} is not loaded: stopped by an operator at {asked['requestedAt']} "
        f"(generation {generation})"
    ), error["message"]
    assert f"lucia-supervisor request {router.name} running" in error["message"]
    assert body["stoppedBy"] == {
        "requestedBy": "operator",
        "requestedAt": asked["requestedAt"],
        "generation": generation,
    }


def test_a_chat_starts_an_engine_nobody_asked_to_stop_and_idle_stop_is_the_gateways(
    router: Engine, gateway: Gateway
) -> None:
    served(gateway)
    started = desired(router)
    assert (started["desired"], started["requestedBy"]) == ("running", "gateway")
    wait_for(lambda: desired(router)["desired"] == "stopped", 60, "the idle stop")
    stop = desired(router)
    assert (stop["requestedBy"], stop["generation"]) == ("gateway", started["generation"] + 1)
    router.wait_state(stop["generation"], "stopped", timeout=120)


def test_the_engine_the_gateway_stopped_for_idling_is_started_again(
    router: Engine, gateway: Gateway
) -> None:
    stop = desired(router)
    assert (stop["desired"], stop["requestedBy"]) == ("stopped", "gateway")
    served(gateway)
    again = desired(router)
    assert (again["desired"], again["requestedBy"]) == ("running", "gateway")
    assert again["generation"] > stop["generation"]


def test_an_operators_stop_is_kept(router: Engine, gateway: Gateway) -> None:
    """`lucia-supervisor request NAME stopped --wait`, as measured on the demo."""
    generation = router.request("stopped", wait_s=120)
    stopped = router.status()
    assert stopped is not None and (stopped["generation"], stopped["state"]) == (
        generation,
        "stopped",
    )
    for _ in range(3):
        refused_by_operator(gateway, router, generation)
    with pytest.raises(openai.InternalServerError) as refused:  # the official client, too
        served(gateway)
    assert refused.value.status_code == 503 and "stopped by an operator" in refused.value.message
    time.sleep(3)  # long enough for a start the gateway wrote to show in both files
    assert (desired(router)["generation"], desired(router)["desired"]) == (generation, "stopped")
    now = router.status()
    assert now is not None and (now["generation"], now["state"]) == (generation, "stopped")
    # `status` says who asked
    rows = json.loads(
        subprocess.run(
            [*CLI, "status", router.name, "--json", "--data-dir", str(router.data_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    )
    assert (rows[0]["requestedBy"], rows[0]["requested"]) == ("operator", generation)


def test_an_operators_start_then_a_chat_is_served_and_never_idled(
    router: Engine, gateway: Gateway
) -> None:
    generation = router.request("running")
    router.wait_state(generation, "running", timeout=120)
    served(gateway)
    time.sleep(IDLE_S + 3)  # past the idle time: the operator's start is never the gateway's
    assert (desired(router)["generation"], desired(router)["desired"]) == (generation, "running")
    assert desired(router)["requestedBy"] == "operator"


def test_a_second_engine_whose_worker_is_gone_never_takes_the_chats(
    router: Engine, gateway: Gateway
) -> None:
    """As measured on the demo: another engine serving tiny, its worker gone 126 s ago."""
    gone = router.data_dir / "a-gone"  # before the router's name: the engine routed to first
    assert gone.name < router.name
    at = utc_now() - timedelta(seconds=126)
    status = Status(
        generation=3,
        state="running",
        since=at,
        message="serving",
        url="http://127.0.0.1:9",
        checked_at=at,
        models=("tiny",),
    )
    write_atomic(ensure_dir(gone) / "status.json", dump(status))
    try:
        for _ in range(5):
            served(gateway)
        listed = {(m.id, m.model_dump()["engine"]) for m in gateway.client().models.list()}
        assert listed == {("tiny", "a-gone"), ("tiny", router.name)}
        assert not (gone / "desired.json").exists()  # nothing asked of it either
    finally:
        shutil.rmtree(gone)


def test_a_stop_still_in_progress_is_not_undone(router: Engine, gateway: Gateway) -> None:
    """The owner stops the engine through the host API while its worker is away: desired.json
    says `stopped`, status.json still `running` with a fresh heartbeat, the router serving."""
    running = router.status()
    assert running is not None and running["state"] == "running"
    assert router.stop_worker(router.procs[-1]) == 0  # the engine is left as it is
    request = urllib.request.Request(
        gateway.url + f"/api/host/engines/{router.name}",
        method="POST",
        data=b'{"desired": "stopped"}',
        headers={"Authorization": f"Bearer {gateway.owner}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 202
        generation = json.loads(answer.read())["generation"]
    still = router.status()
    assert still is not None and (still["state"], still["generation"]) == (
        "running",
        running["generation"],
    )
    checked = datetime.fromisoformat(still["checkedAt"].replace("Z", "+00:00")).timestamp()
    refused_by_operator(gateway, router, generation)
    assert time.time() - checked < 60, "the heartbeat went stale: the case did not hold"
    assert (desired(router)["generation"], desired(router)["desired"]) == (generation, "stopped")
    with urllib.request.urlopen(running["url"] + "/health", timeout=10) as answer:
        assert answer.status == 200  # the router still runs: the gateway chose not to use it
    router.start_worker()  # back: it carries the owner's stop out
    router.wait_state(generation, "stopped", timeout=120)
    assert (desired(router)["generation"], desired(router)["desired"]) == (generation, "stopped")
    refused_by_operator(gateway, router, generation)
