"""What every engine shares: one container, published on its network's gateway, with the
recipe's settings and secrets as environment. Engine modules add how their image and
prerequisites are made and how readiness is judged."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

from .. import redaction
from ..errors import Permanent
from ..protocol import TargetGroup
from ..recipe import RecipeBase, RecipeError
from ..runtime import MANAGED, Mount, RunSpec, Runtime
from .base import Endpoint


class ContainerEngine:
    kind = "engine"

    def __init__(self, name: str, recipe: RecipeBase, runtime: Runtime, state_dir: Path) -> None:
        self.name = name
        self.base_recipe = recipe
        self.runtime = runtime
        self.state_dir = state_dir
        self.container_name = f"lucia-{name}"
        self.stop_grace = recipe.run.stop_grace
        self.ready_timeout = recipe.run.ready_timeout
        self._endpoint: Endpoint | None = None
        with contextlib.suppress(RecipeError):  # mask an adopted engine's output from the start
            redaction.register(recipe.secret_values().values())

    def endpoint(self) -> Endpoint:
        """The network's gateway and the recipe's port; looked up (and the network created)
        once per recipe load."""
        if self._endpoint is None:
            run = self.base_recipe.run
            gateway = self.runtime.gateway(run.network, {MANAGED: "true"})
            self._endpoint = Endpoint(gateway, run.port)
        return self._endpoint

    def secrets(self) -> dict[str, str]:
        """Read when used (a rotated token is picked up), registered for masking."""
        try:
            values = self.base_recipe.secret_values()
        except RecipeError as exc:
            raise Permanent(str(exc)) from None
        redaction.register(values.values())
        return values

    def container_spec(
        self,
        image_id: str,
        generation: int,
        endpoint: Endpoint,
        *,
        command: tuple[str, ...],
        labels: Mapping[str, str] = {},
        mounts: tuple[Mount, ...] = (),
    ) -> RunSpec:
        recipe, run = self.base_recipe, self.base_recipe.run
        return RunSpec(
            name=self.container_name,
            image=image_id,
            network=run.network,
            host_ip=endpoint.host,
            host_port=endpoint.port,
            container_port=run.inner_port,
            environment={**recipe.environment, **self.secrets()},
            labels={
                MANAGED: "true",
                "lucia.name": self.name,
                "lucia.engine": self.kind,
                "lucia.generation": str(generation),
                "lucia.image.id": image_id,
                **labels,
            },
            command=command,
            gpus=run.gpus,
            shm_size=run.shm_size,
            memory=run.memory,
            ipc_mode=run.ipc,
            ulimits=run.ulimits,
            mounts=(
                *mounts,
                *(
                    Mount(str(Path(v.source).expanduser()), v.target, v.read_only)
                    for v in run.volumes
                ),
            ),
        )

    def target_group(self, endpoint: Endpoint, labels: Mapping[str, str]) -> TargetGroup:
        return TargetGroup(
            targets=[f"{endpoint.host}:{endpoint.port}"],
            labels={
                "__metrics_path__": self.base_recipe.run.metrics_path,
                "engine": self.kind,
                "name": self.name,
                **labels,
            },
        )
