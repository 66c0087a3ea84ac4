"""The conformance driver of the tensorfold kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance.driver import Kind, dies_with_3_saying
from tests.fixtures import Engine


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    """The shipped recipe on the real layout (tests/tensorfold-recipe), driven by its knobs."""

    def make(**knobs: Any) -> Engine:
        return make_engine(layout="real", **knobs)

    def change(engine: Engine) -> None:
        engine.requirement = "xgrammar>=0.2.9,<0.3"  # a new pin: a new grammar image

    return Kind(
        "tensorfold",
        make=make,
        slow_step=lambda s: ({"settings": {"TEST_DOWNLOAD_SECONDS": str(s)}}, "model.safetensors"),
        slow_ready=lambda s: (
            {"settings": {"TENSORFOLD_TEST_READY_DELAY": str(s)}},
            "loading weights",
        ),
        change_image=change,
        die=dies_with_3_saying("exiting with 3"),
        image=lambda engine: engine.image_tag + "-grammar",
        step_processes=True,
    )
