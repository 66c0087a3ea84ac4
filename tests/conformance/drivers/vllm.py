"""The conformance driver of the vllm kind: the real vLLM 0.32.0 CPU server on a tiny model."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import pytest

from supervisor.engines.vllm import tier_image
from tests.conformance.driver import Kind, dies_with_3_saying, killed_saying
from tests.fixtures import Engine

# "cpu": every case that the real server can do on demand runs on it (14 of 18; 35 to 45 min
# on a loaded 2-core machine); "gpu" (the default, and what .ci/run runs): the busybox stand-in
# on the GPU path with a recorded card, as before. The real server's own proofs in CI are
# tests/integration/test_vllm_cpu_engine.py, test_vllm_cpu_image.py and test_kv_tiers_vllm.py.
DEVICE: Final = os.environ.get("LUCIA_CONFORMANCE_VLLM_DEVICE", "gpu")


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    return (_real if DEVICE == "cpu" else _standin)(make_engine, request)


def _standin(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    """The stand-in image, tagged as the GPU preflight picks for a recorded CUDA 12 card."""
    images = request.getfixturevalue("vllm_images")

    def change(engine: Engine) -> None:
        engine.vllm_repository = images[1]  # another vLLM image (a mirror's newer build)

    return Kind(
        "vllm",
        make=lambda **knobs: make_engine(kind="vllm", vllm_device="gpu", **knobs),
        slow_step=lambda s: ({"settings": {"LOAD_DELAY": str(s)}}, "non-default args"),
        slow_ready=lambda s: ({"settings": {"LOAD_DELAY": str(s)}}, "non-default args"),
        change_image=change,
        die=dies_with_3_saying("fatal error"),
        # the recipe has tiers: what runs is the tier image built FROM the preflight's pick
        image=lambda engine: tier_image.tag(engine.vllm_repository + ":v0.32.0-cu129"),
    )


def _real(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    """`device = "cpu"` on the real server (tests/vllm_cpu.py's image, a Ready library model of
    the tiny random Llama). A slow step is the stand-in's (tests/vllm-standin, LOAD_DELAY, on
    the GPU path with a recorded card): the real server's load cannot be made to take 3, 12 or
    300 seconds on demand, so acknowledgement, heartbeat, cancel and the readiness message stay
    on it; every other case runs the real server, started with --enforce-eager (the fixture's
    recipe: no torch.compile warm-up, 77 s to /health here against 104 s without)."""
    images = request.getfixturevalue("vllm_cpu_images")

    def change(engine: Engine) -> None:
        engine.vllm_image = images[1]  # the same server rebuilt: another image id

    def slow(seconds: int) -> tuple[dict[str, Any], str]:
        return {"vllm_device": "gpu", "settings": {"LOAD_DELAY": str(seconds)}}, (
            "non-default args")

    def make(**knobs: Any) -> Engine:
        knobs.setdefault("vllm_device", "cpu")
        return make_engine(kind="vllm", **knobs)

    def image(engine: Engine) -> str:
        if engine.vllm_device == "cpu":
            return engine.vllm_image
        return engine.vllm_repository + ":v0.32.0-cu129"

    return Kind(
        "vllm",
        make=make,
        slow_step=slow,
        slow_ready=slow,
        change_image=change,
        die=killed_saying('"GET /'),  # its last lines: the worker's readiness probes
        image=image,
        start_timeout=900,
        edited_memory="5g",
        edited_shm="768m",
    )
