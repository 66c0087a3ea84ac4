"""The conformance driver of the test-only echo kind: its two images and its recipe writer."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from string import Template
from typing import Any

import docker
import pytest

from tests.conformance.driver import Kind
from tests.fixtures import RUN_ID, TEST_LABEL, Engine
from tests.standin import toml_text

HERE = Path(__file__).resolve().parent
_IMAGES: dict[str, tuple[str, str]] = {}  # per test run: built once, removed with the run's


def _images(request: pytest.FixtureRequest) -> tuple[str, str]:
    """The echo image twice (other ids, a label apart): an upgrade."""
    if RUN_ID not in _IMAGES:
        client: docker.DockerClient = request.getfixturevalue("client")
        base: str = request.getfixturevalue("base_image")
        tags = []
        for version in (1, 2):
            tag = f"lucia-test-echo{version}-{RUN_ID}:1"
            client.images.build(
                path=str(HERE / "image"),
                tag=tag,
                rm=True,
                buildargs={"BASE": base},
                labels={TEST_LABEL: RUN_ID, "version": str(version)},
            )
            tags.append(tag)
        _IMAGES[RUN_ID] = (tags[0], tags[1])
    return _IMAGES[RUN_ID]


CAUSE = "echo.tier.TierError: /kv/nvme has owner 1001 and mode 0700"
# how vLLM fails: the cause, then a re-raise in another process, more than 5 lines below it
WHY = (
    "Traceback (most recent call last):",
    '  File "/echo/tier.py", line 67, in open_directory',
    "    raise TierError(path)",
    CAUSE,
    "Traceback (most recent call last):",
    '  File "/echo/engine.py", line 12, in main',
    "    start()",
    '  File "/echo/engine.py", line 9, in start',
    "    raise RuntimeError(message)",
    "RuntimeError: Engine core initialization failed. See root cause above.",
)


def dies_after_a_traceback(container: Any) -> tuple[str, str]:
    """It prints a traceback whose cause is far above its last lines, then exits with 3."""
    why = "".join(f"{line}\n" for line in WHY)
    container.exec_run(["sh", "-c", 'printf %s "$1" > /tmp/why && echo 3 > /tmp/die', "sh", why])
    return "exited with code 3", CAUSE


def recipe(engine: Engine) -> str:
    """echo.toml with the engine's fields, settings, secrets and run extras."""
    text = Template((HERE / "echo.toml").read_text()).substitute(
        name=engine.name,
        image=engine.image,
        network=engine.network,
        port=engine.port,
        ready_timeout=engine.ready_timeout,
        stop_grace=engine.stop_grace,
    )
    data = tomllib.loads(text)
    data["settings"] = dict(engine.settings)
    data["secrets"] = dict(engine.secrets)
    data["run"].update(engine.run_extra)
    return toml_text(data)


def kind(make_engine: Callable[..., Engine], request: pytest.FixtureRequest) -> Kind:
    images = _images(request)

    def make(**knobs: Any) -> Engine:
        return make_engine(kind="echo", image=images[0], writer=recipe, **knobs)

    def change(engine: Engine) -> None:
        engine.image = images[1]

    def slow(seconds: int) -> tuple[dict[str, Any], str]:
        return {"settings": {"READY_DELAY": str(seconds)}}, "echo: warming up"

    return Kind(
        "echo",
        make=make,
        slow_step=slow,
        slow_ready=slow,
        change_image=change,
        die=dies_after_a_traceback,
        image=lambda engine: engine.image,
    )
