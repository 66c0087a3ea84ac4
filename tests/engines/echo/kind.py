"""A test-only engine kind, registered through LUCIA_ENGINE_MODULES: busybox httpd in a container.

It is the proof that an engine is one folder and one recipe: nothing outside tests/engines/echo
names it, and it passes the conformance suite.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Literal

from supervisor.docker.runtime import Runtime
from supervisor.engines.container import ContainerEngine
from supervisor.engines.kind import EngineKind
from supervisor.engines.look import EngineImage, Prerequisites, PulledImage
from supervisor.memplan.fit import Budget
from supervisor.memplan.overview import EnginePlan
from supervisor.recipe.schema import ImageRef, RecipeBase, Section


class EchoSection(Section):
    image: ImageRef


class EchoRecipe(RecipeBase):
    engine: Literal["echo"]
    echo: EchoSection


class Echo(ContainerEngine[EchoRecipe, Prerequisites]):
    kind = "echo"
    poll_interval = 5.0

    def __init__(
        self,
        name: str,
        recipe: EchoRecipe,
        runtime: Runtime,
        state_dir: Path,
        data_dir: Path | None = None,
    ) -> None:
        super().__init__(name, recipe, runtime, state_dir, data_dir)

    def prerequisites(self) -> Prerequisites:
        ref = self.recipe.echo.image
        image = self.runtime.image(ref)
        if image is None:
            return Prerequisites((PulledImage(ref),))
        return Prerequisites((), EngineImage(ref, image))

    def ready(self) -> bool:
        if self.endpoint is None:
            return False
        url = self.endpoint.url + self.recipe.run.ready_path
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, ValueError):
            return False

    def private_files(self) -> tuple[Path, ...]:
        return ()


def _memory(recipe: EchoRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    return EnginePlan(recipe.name, None, "the echo engine is not planned")


KIND = EngineKind(
    name="echo",
    recipe=EchoRecipe,
    engine="tests.engines.echo.kind:Echo",
    memory=_memory,
    conformance="tests.engines.echo.conformance",
)
