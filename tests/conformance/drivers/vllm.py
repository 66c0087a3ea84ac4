"""The conformance driver of the vllm kind (the stand-in image, tagged as the preflight picks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conformance.driver import Kind, dies_with_3_saying
from tests.fixtures import Engine


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    images = request.getfixturevalue("vllm_images")

    def change(engine: Engine) -> None:
        engine.vllm_repository = images[1]  # another vLLM image (a mirror's newer build)

    return Kind(
        "vllm",
        make=lambda **knobs: make_engine(kind="vllm", **knobs),
        slow_step=lambda s: ({"settings": {"LOAD_DELAY": str(s)}}, "non-default args"),
        slow_ready=lambda s: ({"settings": {"LOAD_DELAY": str(s)}}, "non-default args"),
        change_image=change,
        die=dies_with_3_saying("fatal error"),
        image=lambda engine: engine.vllm_repository + ":v0.32.0-cu129",
    )
