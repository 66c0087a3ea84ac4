"""The KV tier connector on a real GPU: saves and loads through CUDA, then reuse after a restart.

    LUCIA_VLLM_GPU_MODEL=Qwen/Qwen2.5-0.5B-Instruct@<40-hex commit> \\
        PYTHONPATH=$PWD .venv/bin/python -m pytest -m gpu tests/gpu/test_kv_tiers_gpu.py

The worker runs the stable `vllm/vllm-openai` image the preflight picks for this driver, with
the tier layer (`<image>-tiers`) and the recipe's shared-memory, NVMe and HDD tiers (tests/
fixtures.py), the small model given, prefix caching off, so that a repeat of a prompt can only
come from the tiers. A 2000-token prompt is answered cold (every full block saved from the GPU's
KV cache: on the old per-block `.numpy()` copy the engine died here), the engine is stopped and
started again through the protocol, and the same prompt is answered warm: the same tokens, at
least 90 % of the prompt from `external_kv_transfer` (loaded into the GPU's cache), the engine
still running, and no KV transfer error in its log. Skipped where nvidia-smi or
LUCIA_VLLM_GPU_MODEL is missing (so: on every machine without a GPU). tests/kv/test_transfer.py
checks the bytes on CUDA on such a machine too, with torch alone.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest
from lucia_kv.tier import NAME as BLOCK_NAME

from supervisor.engines.vllm import account
from supervisor.engines.vllm import preflight as pf
from tests import http_json
from tests.fixtures import Engine
from tests.vllm_cpu import PROMPT_SOURCE

MODEL = os.environ.get("LUCIA_VLLM_GPU_MODEL", "")
pytestmark = [
    pytest.mark.docker,
    pytest.mark.gpu,
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is None,
        reason="no nvidia-smi on this host: the tier connector's CUDA path needs an NVIDIA GPU",
    ),
    pytest.mark.skipif(
        "@" not in MODEL,
        reason="LUCIA_VLLM_GPU_MODEL=<hf id>@<commit> unset: no model to serve on the GPU",
    ),
]

PROMPT = [random.Random(25).randrange(3, 5000) for _ in range(2000)]  # token ids, any vocab
BLOCK_TOKENS = 16  # the recipe's default block on a GPU (supervisor.engines.vllm.recipe)
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS
MAX_TOKENS = 16
SERVED = "gpu-tiers"


def complete(url: str) -> tuple[list[int], str]:
    answer = http_json.post(
        url + "/v1/completions",
        {
            "model": SERVED,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=600,
    )
    assert answer.status == 200, answer.body[-2000:]
    (choice,) = answer.json()["choices"]
    return list(choice["token_ids"]), str(choice["text"])


def from_tiers(url: str) -> float:
    answer = http_json.get(url + "/metrics", 30)
    assert answer.status == 200, answer.body[-500:]
    return sum(
        float(match.group(2))
        for match in PROMPT_SOURCE.finditer(answer.body.decode())
        if match.group(1) == "external_kv_transfer"
    )


def block_files(root: Path) -> list[Path]:
    """The block files under a tier root (not temp files, not the owner lock)."""
    return [p for p in root.rglob("*") if p.is_file() and BLOCK_NAME.fullmatch(p.name)]


def wait_for(check: Callable[[], bool], what: str, limit: float = 300) -> None:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < limit, f"gave up waiting for {what}"
        time.sleep(0.5)


def running(engine: Engine) -> dict[str, Any]:
    return engine.wait_state(engine.request("running"), "running", timeout=2400)


def test_a_repeat_after_a_restart_is_loaded_from_the_tiers_into_the_gpu(
    make_engine: Callable[..., Engine], client: docker.DockerClient
) -> None:
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
        vllm={"served_name": SERVED, "max_model_len": 4096, "memory": 80, "prefix_caching": False},
        run_extra={
            "gpus": "all",
            "shm_size": "10g",
            "memory": "26g",
            "volumes": [{"source": str(hf_cache), "target": account.HF_HOME}],
        },
    )
    engine.start_worker()
    status = running(engine)
    first = client.containers.get(engine.container).id
    cold = complete(status["url"])
    assert from_tiers(status["url"]) == 0.0
    for tier in ("kv-nvme", "kv-hdd"):  # every full block saved from the GPU, on both disks
        wait_for(
            lambda tier=tier: len(block_files(engine.root / tier)) >= FULL_BLOCKS,
            f"{FULL_BLOCKS} blocks on {tier}",
        )
    engine.wait_state(engine.request("stopped"), "stopped", timeout=180)
    status = running(engine)
    assert client.containers.get(engine.container).id != first, "stopped, then started again"
    warm = complete(status["url"])
    external = from_tiers(status["url"])
    print(f"\nafter the restart: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external >= 0.9 * len(PROMPT)
    assert warm == cold
    container = client.containers.get(engine.container)
    assert container.status == "running"
    logs = container.logs().decode(errors="replace")
    assert "KV blocks not" not in logs and "can't convert" not in logs, logs[-3000:]
    engine.wait_state(engine.request("stopped"), "stopped", timeout=180)
