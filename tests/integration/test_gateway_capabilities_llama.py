"""What a model serves, against the real llama-server router through the gateway's real process,
with the official `openai` client: a chat GGUF and an embedding GGUF (its header declares mean
pooling) in one library. The worker declares each model's capabilities while the engine is
stopped; an embedding asked of the chat model, and a chat asked of the embedding model, are
refused 400 `capability_not_served` and the stopped engine is not started; an embedding asked
of the embedding model starts it and is answered by llama-server (the worker gave its preset
section `embeddings = true`), as a chat of the chat model is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import docker
import gguf
import openai
import pytest

from tests.fixtures import REPO_TEMPLATE, Engine, EngineFactory, RecipeRepo
from tests.gateway_proc import Gateway, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama
from tests.standin import recipe_repository

pytestmark = pytest.mark.docker

GENERATES = ["chat", "completion", "responses"]
HI: Any = [{"role": "user", "content": "hi"}]
SETTINGS = '[tiers]\nfast = "chat"\ndefault = "fast"\n[limits]\nload_wait_s = 300\n'


@pytest.fixture(scope="module")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine with `chat` and `emb`, synced by one run, then stopped as the
    gateway stops an idle engine it started (traffic may start it again)."""
    directory = tmp_path_factory.mktemp("gateway-capabilities")
    recipe_repository(directory / "recipe-repo", REPO_TEMPLATE, "recipe 0.7.0")
    repo = RecipeRepo(directory / "recipe-repo")
    factory = EngineFactory(client, base_image, directory, lambda: repo, request)
    engine = factory(kind="llama-router", models_max=2)
    engine.models_dir.mkdir(exist_ok=True)
    write_llama(add_model(engine.models_dir, "Ready") / "chat.gguf", TinyLlama())
    write_llama(
        add_model(engine.models_dir, "Ready") / "emb.gguf",
        TinyLlama(seed=3),
        pooling=gguf.PoolingType.MEAN,
    )
    engine.start_worker()
    engine.wait_state(engine.request("running"), "running", timeout=120)
    engine.wait_state(engine.request("stopped", by="gateway"), "stopped", timeout=120)
    yield engine
    factory.close()


@pytest.fixture(scope="module")
def gateway(router: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("gateway"), router.data_dir, SETTINGS) as gw:
        yield gw


def test_a_stopped_router_declares_what_each_model_serves(router: Engine) -> None:
    status = router.status()
    assert status is not None and status["state"] == "stopped"
    assert status["capabilities"] == {"chat": GENERATES, "emb": ["embedding"]}


@pytest.mark.parametrize(
    ("model", "ask", "serves"),
    [
        ("chat", lambda c, m: c.embeddings.create(model=m, input="hello"), "chat"),
        ("fast", lambda c, m: c.embeddings.create(model=m, input="hello"), "chat"),
        ("emb", lambda c, m: c.chat.completions.create(model=m, messages=HI), "embedding"),
        ("emb", lambda c, m: c.completions.create(model=m, prompt="a"), "embedding"),
        ("emb", lambda c, m: c.responses.create(model=m, input="a"), "embedding"),
    ],
)
def test_a_route_a_model_does_not_serve_is_refused_and_nothing_is_started(
    router: Engine, gateway: Gateway, model: str, ask: Any, serves: str
) -> None:
    before = router.status()
    assert before is not None and before["state"] == "stopped"
    with pytest.raises(openai.BadRequestError) as refused:
        ask(gateway.client(), model)
    assert refused.value.code == "capability_not_served"
    assert f"it serves {serves}" in refused.value.message
    after = router.status()
    assert after is not None and after["state"] == "stopped"
    assert after["generation"] == before["generation"], "no start was asked for"


def test_the_embedding_model_starts_and_embeds_and_the_chat_model_chats(
    router: Engine, gateway: Gateway
) -> None:
    client = gateway.client(timeout=300)
    answer = client.embeddings.create(model="emb", input="hello")
    assert len(answer.data) == 1 and len(answer.data[0].embedding) == TinyLlama().n_embd
    running = router.status()
    assert running is not None and running["state"] == "running"
    chat = client.chat.completions.create(model="chat", messages=HI, max_tokens=2)
    assert chat.choices and chat.usage is not None
    status, listing = gateway.get("/v1/models", gateway.issued)
    shown = {m["id"]: m for m in listing["data"]}
    assert status == 200
    assert shown["chat"]["capabilities"] == GENERATES and shown["chat"]["default"] is True
    assert shown["emb"]["capabilities"] == ["embedding"]
    # the loaded children's own arguments say the same
    assert router.status()["capabilities"] == {"chat": GENERATES, "emb": ["embedding"]}
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="chat", input="hello")
    assert refused.value.code == "capability_not_served"


def test_a_request_naming_no_model_goes_to_the_default_tier(gateway: Gateway) -> None:
    answer = gateway.client(timeout=300).chat.completions.create(
        model=openai.NOT_GIVEN,  # type: ignore[arg-type]
        messages=HI,
        max_tokens=2,
    )
    assert answer.model == "chat" and answer.choices
