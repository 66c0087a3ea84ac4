"""What a model serves, against the real vLLM 0.32.0 CPU server through the gateway's real
process, with the official `openai` client. The stopped engine declares what vLLM resolves for
its arguments and its model's config.json (LlamaForCausalLM: generate); an embedding asked of
it is refused 400 `capability_not_served` and nothing is started; a completion starts it, and
the running server's own routes (its /openapi.json) then say the same."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.fixtures import Engine
from tests.gateway_proc import running_gateway

pytestmark = pytest.mark.docker

GENERATES = ["chat", "completion", "responses"]


def test_an_embedding_asked_of_a_vllm_generate_model_is_refused_before_any_start(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine: Engine = make_engine(kind="vllm", vllm_device="cpu")
    engine.start_worker()
    stopped = engine.wait_state(engine.request("stopped", by="gateway"), "stopped", timeout=120)
    assert stopped["capabilities"] == {"tiny": GENERATES}, "from its recipe and config.json"
    with running_gateway(
        tmp_path / "gateway", engine.data_dir, "[limits]\nload_wait_s = 900\n"
    ) as gateway:
        client = gateway.client(timeout=1200)
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="tiny", input="the quick brown fox")
        assert refused.value.code == "capability_not_served"
        assert "completion (/v1/completions)" in refused.value.message
        still = engine.status()
        assert still is not None and still["state"] == "stopped"
        assert still["generation"] == stopped["generation"], "no start was asked for"

        answer = client.completions.create(model="tiny", prompt="the quick", max_tokens=2)
        assert answer.choices
        running = engine.status()
        assert running is not None and running["state"] == "running"
        with urllib.request.urlopen(running["url"] + "/openapi.json", timeout=10) as r:
            paths = set(json.loads(r.read())["paths"])
        assert {"/v1/chat/completions", "/v1/completions", "/v1/responses"} <= paths
        assert "/v1/embeddings" not in paths
        assert running["capabilities"] == {"tiny": GENERATES}
        status, listing = gateway.get("/v1/models", gateway.issued)
        assert status == 200
        assert [m["capabilities"] for m in listing["data"] if m["id"] == "tiny"] == [GENERATES]
        with pytest.raises(openai.BadRequestError) as again:
            client.embeddings.create(model="tiny", input="the quick brown fox")
        assert again.value.code == "capability_not_served"
    engine.request("stopped")
    assert engine.wait_status(lambda s: s["state"] == "stopped", timeout=120)["engine"] is None
