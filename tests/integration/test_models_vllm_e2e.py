"""End to end for an HF-layout model: `models add` of a tiny llama (config.json, safetensors, a
tokenizer) from the tests' hub with the real hf CLI, Ready with its inspection; the real vLLM CPU
engine, under its worker, serves that library model; the gateway routes a completion to it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.host.models import manifest as mf
from tests.fixtures import Engine
from tests.gateway_proc import running_gateway
from tests.host.library_world import add_served, hub_of
from tests.vllm_cpu import library_revision
from tests.vllm_model import write_tiny_llama

pytestmark = pytest.mark.docker

SETTINGS = "[limits]\nrunning = 1\nwaiting = 0\nload_wait_s = 900\n"


def test_an_hf_model_added_from_the_hub_is_served_by_vllm_and_the_gateway(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(kind="vllm", vllm_device="cpu")
    shutil.rmtree(engine.models_dir / engine.vllm_guid)  # the fixture's copy: ours replaces it
    write_tiny_llama(tmp_path / "hub")
    with hub_of(tmp_path / "hub") as hub:
        added = add_served(engine.models_dir, hub, "--name", "tiny-hf")
    assert added.returncode == 0, added.stderr
    (model,) = mf.load_all(engine.models_dir)
    assert model.state == "Ready" and model.inspection is not None
    assert (model.inspection.format, model.inspection.architecture) == ("hf", "LlamaForCausalLM")

    engine.vllm_guid = model.id
    engine.write_recipe()
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "running", timeout=900)
    files = engine.models_dir / model.id / "files"
    assert status["engine"]["modelRevision"] == library_revision(files, model.id), status
    with running_gateway(tmp_path / "gateway", engine.data_dir, SETTINGS) as gateway:
        # a completion: the tiny model has no chat template
        answer = gateway.client().completions.create(
            model="tiny", prompt="the quick brown fox", max_tokens=4, temperature=0
        )
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
