"""End to end: `models add` of a tiny GGUF repo from the tests' hub with the real hf CLI, Ready
with its inspection; the real llama-server router, under its worker, lists it; the gateway
routes a chat completion to it by name (the official openai client)."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest

from supervisor.host.models import manifest as mf
from tests.fixtures import REPO_TEMPLATE, EngineFactory, RecipeRepo
from tests.gateway_proc import running_gateway
from tests.gguf_fixtures import TinyLlama, write_llama
from tests.host.library_world import add_served, hub_of
from tests.standin import recipe_repository

pytestmark = pytest.mark.docker

MODEL = "tiny-chat-Q8_0"
SETTINGS = "[limits]\nrunning = 1\nwaiting = 0\nload_wait_s = 300\n"


def test_a_model_added_from_the_hub_is_served_by_the_router_and_the_gateway(
    client: docker.DockerClient, base_image: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    recipe_repository(tmp_path / "recipe-repo", REPO_TEMPLATE, "recipe 0.7.0")
    recipes = RecipeRepo(tmp_path / "recipe-repo")
    factory = EngineFactory(client, base_image, tmp_path, lambda: recipes, request)
    try:
        engine = factory(kind="llama-router", models_max=1, defaults={"ctx-size": 256})
        engine.models_dir.mkdir(exist_ok=True)
        write_llama(tmp_path / "hub" / f"{MODEL}.gguf", TinyLlama(context=256))
        (tmp_path / "hub" / "README.md").write_text("a tiny chat model\n")
        with hub_of(tmp_path / "hub") as hub:
            added = add_served(engine.models_dir, hub, "--include", "*.gguf")
        assert added.returncode == 0, added.stderr
        (model,) = mf.load_all(engine.models_dir)
        assert model.state == "Ready" and model.inspection is not None
        assert (model.inspection.architecture, model.inspection.context) == ("llama", 256)

        engine.start_worker()
        engine.wait_state(engine.request("running"), "running", timeout=180)
        status = engine.status()
        assert status is not None and MODEL in status["models"], status
        with running_gateway(tmp_path / "gateway", engine.data_dir, SETTINGS) as gateway:
            answer = gateway.client().chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
    finally:
        factory.close()
