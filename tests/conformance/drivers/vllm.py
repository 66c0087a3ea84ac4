"""The conformance driver of the vllm kind: the real vLLM 0.32.0 CPU server on a tiny model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance.driver import Kind, killed_saying
from tests.fixtures import Engine


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
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
