"""The llama-router recipe: the model library it serves and the router's preset."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from supervisor.recipe.schema import AbsolutePath, ImageRef, RecipeBase, Section


class LibrarySettings(Section):
    models_dir: str = Field(description="the host's model library: <guid>/model.json + files/")
    cache_dir: str = Field(description="local GGUF cache (fast disk), mounted read-only")
    container_dir: AbsolutePath = Field(default="/models", description="where it is mounted")
    poll_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3_600,
        allow_inf_nan=False,
        description="how often the library is re-checked while settled",
    )

    @property
    def models_path(self) -> Path:
        return Path(self.models_dir).expanduser()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


class Router(Section):
    image: ImageRef = Field(description="the llama.cpp server image (llama-server in router mode)")
    models_max: int = Field(default=1, ge=1, description="--models-max: models loaded at once")
    load_on_startup: list[str] = Field(default_factory=list)
    defaults: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="the preset's [*] section (ctx-size, n-gpu-layers...)"
    )
    args: list[str] = Field(default_factory=list, description="extra llama-server arguments")

    @model_validator(mode="after")
    def _startup_fits(self) -> Self:
        if len(self.load_on_startup) > self.models_max:
            raise ValueError(
                f"{len(self.load_on_startup)} load-on-startup models but models_max is "
                f"{self.models_max}; raise models_max or load fewer at start"
            )
        return self


class LlamaRouterRecipe(RecipeBase):
    engine: Literal["llama-router"]
    library: LibrarySettings
    router: Router
