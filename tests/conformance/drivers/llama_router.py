"""The conformance driver of the llama-router kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conformance.driver import Kind, killed
from tests.fixtures import Engine
from tests.gguf_fixtures import add_model, write_llama


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    """The real llama-server with a tiny llama model. A slow load is the stand-in's
    (LOAD_DELAY): the real router loads a tiny model in well under a second, and nothing makes
    it take 12 or 300 seconds on demand (the heartbeat, cancel and readiness-message cases)."""
    images = request.getfixturevalue("router_images")

    def make(**knobs: Any) -> Engine:
        settings = knobs.pop("settings", {})
        engine = make_engine(
            kind="llama-router", load_on_startup=("tiny",), settings=settings, **knobs
        )
        files = add_model(engine.models_dir, "Ready")
        write_llama(files / "tiny.gguf")
        return engine

    def change(engine: Engine) -> None:
        engine.router_image = images[1]  # an upgraded llama-server image

    def slow(seconds: int) -> tuple[dict[str, Any], str]:
        standin = request.getfixturevalue("router_standin")
        return {"settings": {"LOAD_DELAY": str(seconds)}, "router_image": standin}, (
            "router listening"
        )

    return Kind(
        "llama-router",
        make=make,
        slow_step=slow,
        slow_ready=slow,
        change_image=change,
        die=killed,
        image=lambda engine: engine.router_image,
    )
