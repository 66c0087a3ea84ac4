"""The vllm engine on a real GPU server with the real image: the one run a stand-in cannot make.

    LUCIA_VLLM_GPU_MODEL=Qwen/Qwen2.5-0.5B-Instruct@<40-hex commit> \\
        PYTHONPATH=$PWD .venv/bin/python -m pytest -m gpu tests/gpu/test_vllm_gpu.py

It runs the worker with the real nvidia-smi and `vllm/vllm-openai` (pulled by the worker: the
tag the preflight picks for this host's CUDA), GPUs `all`, the Hugging Face cache of the user
running it mounted, tiers under the test's directory, and checks: the preflight's image for this
driver, `running` only once `/health` and `/v1/models` answer, a completion, vLLM's /metrics
through file_sd, the status naming the image id and the model revision, the tier directories
(0700, mounted by namespace, the plugin's `LUCIA_KV_*` environment), and a clean stop. Skipped
where nvidia-smi or LUCIA_VLLM_GPU_MODEL is missing (so: on every machine without a GPU).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import urllib.request
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from supervisor.engines.vllm import account
from supervisor.engines.vllm import preflight as pf
from supervisor.hw import gpu
from tests.fixtures import Engine

MODEL = os.environ.get("LUCIA_VLLM_GPU_MODEL", "")
pytestmark = [
    pytest.mark.docker,
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi on this host"),
    pytest.mark.skipif("@" not in MODEL, reason="LUCIA_VLLM_GPU_MODEL=<hf id>@<commit> unset"),
]


def test_the_real_vllm_image_serves_on_this_gpu(
    make_engine: Callable[..., Engine], client: docker.DockerClient
) -> None:
    facts = gpu.probe()
    assert isinstance(facts, gpu.GpuFacts), facts
    model, revision = MODEL.split("@", 1)
    hf_cache = Path("~/.cache/huggingface").expanduser()
    hf_cache.mkdir(parents=True, exist_ok=True)
    engine = make_engine(
        kind="vllm",
        vllm_repository=pf.REPOSITORY,
        nvidia_smi="nvidia-smi",
        vllm_model=model,
        revision=revision,
        ready_timeout=1800,
        vllm={"served_name": "gpu-check", "max_model_len": 2048, "memory": 80},
        run_extra={
            "gpus": "all",
            "shm_size": "10g",
            "memory": "26g",
            "volumes": [{"source": str(hf_cache), "target": account.HF_HOME}],
        },
    )
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "running", timeout=2400)
    expected = pf.image(engine_choices(engine), facts)
    assert status["engine"]["image"] == expected, status
    container = client.containers.get(engine.container)
    assert status["engine"]["imageId"] == container.image.id
    assert status["engine"]["modelRevision"] == revision
    assert container.attrs["HostConfig"]["DeviceRequests"], "no GPU given to the container"
    body = json.dumps(
        {"model": "gpu-check", "prompt": "The capital of France is", "max_tokens": 8}
    ).encode()
    request = urllib.request.Request(
        f"{status['url']}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert json.loads(answer.read())["choices"][0]["text"]
    (group,) = engine.file_sd()
    with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=10) as answer:
        assert "vllm:num_requests_running" in answer.read().decode()
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    space = env["LUCIA_KV_NAMESPACE"]
    for tier in ("kv-nvme", "kv-hdd"):
        info = os.stat(engine.root / tier / space)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    engine.wait_state(engine.request("stopped"), "stopped", timeout=180)


def engine_choices(engine: Engine) -> pf.Choices:
    from supervisor.engines.loader import load
    from supervisor.engines.vllm.recipe import VllmRecipe

    recipe = load(engine.recipe_path)
    assert isinstance(recipe, VllmRecipe)
    return recipe.preflight_choices()
