"""The conformance driver of the vllm kind: the real vLLM 0.32.0 CPU server on a tiny model."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import pytest

from supervisor.engines.vllm import tier_image
from tests.conformance.driver import Kind, dies_with_3_saying, killed_saying
from tests.fixtures import Engine

# "cpu" (the default, and what .ci/run runs): every case the real server can do on demand runs
# on it, one engine handed from case to case where the cases allow (tests/conformance/relay.py);
# "gpu": every case on the busybox stand-in on the GPU path with a recorded card, as the GPU
# image cannot run here (165 s on this 2-core machine beside other test runs; on the real
# server the cases took 266 s in a whole CI run, five loads of 38 to 96 s).
DEVICES: Final = ("cpu", "gpu")
DEVICE: Final = os.environ.get("LUCIA_CONFORMANCE_VLLM_DEVICE", "cpu")
START_TIMEOUT: Final = 900  # seconds to running: 40 to 220 s on a loaded 2-core machine


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    if DEVICE not in DEVICES:
        pytest.fail(f"LUCIA_CONFORMANCE_VLLM_DEVICE={DEVICE!r}: it is one of {DEVICES}")
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
    the tiny random Llama), started with --enforce-eager (the fixture's recipe: no torch.compile
    warm-up, 77 s to /health on a loaded machine against 104 s without).

    Four cases stay on the stand-in (tests/vllm-standin, LOAD_DELAY, on the GPU path with a
    recorded card), because the real server's load cannot be made to take a chosen time: the
    heartbeat during a step held for 12 s, the cancel of a step held for 300 s, the readiness
    message (a load whose output line stays the last one for seconds), and the
    acknowledgement (a step held for 3 s; on the real server it would cost a load of its own,
    171 s on a loaded machine, for a status the worker writes before the engine says anything,
    and the real engine's stop is proven by the file_sd case). Every other case
    runs the real server. The cases that look at a running engine or replace it take the one
    the case before handed on (tests/conformance/relay.py); the cases that stop it (file_sd) or
    kill it (death, the last) hand nothing on, so the next starts a fresh one; the lease case
    starts no engine at all. The five run-spec edits come in one reload (the `every field`
    case). Five loads in all: two fresh engines and three replacements (another image, the
    run-spec edits, the replacement that could not start)."""
    images = request.getfixturevalue("vllm_cpu_images")
    relay = request.getfixturevalue("relays").of("vllm")

    def change(engine: Engine) -> None:  # the same server rebuilt: another image id
        engine.vllm_image = images[1] if engine.vllm_image == images[0] else images[0]

    def slow(seconds: int) -> tuple[dict[str, Any], str]:
        return {"vllm_device": "gpu", "settings": {"LOAD_DELAY": str(seconds)}}, (
            "non-default args"
        )

    def make(**knobs: Any) -> Engine:
        knobs.setdefault("vllm_device", "cpu")
        return make_engine(kind="vllm", **knobs)

    def take(knobs: dict[str, Any]) -> tuple[Engine, dict[str, Any]]:
        if knobs:  # an engine of its own: the one handed on was made without these
            engine = make(**knobs)
            _, status = engine.up(timeout=START_TIMEOUT)
            return engine, status
        return relay.take(lambda: relay.factory(kind="vllm", vllm_device="cpu"), START_TIMEOUT)

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
        start_timeout=START_TIMEOUT,
        edited_memory="5g",
        edited_shm="768m",
        slow_stop={},  # the replacement's grace is shown by its exit code 0 after SIGTERM
        take=take,
        hand=relay.hand_on,
    )
