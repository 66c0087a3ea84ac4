"""The tensorfold recipe: its git source, the image build, prepare, the grammar layer, memory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final, Literal, Self

from pydantic import Field, field_validator, model_validator

from supervisor.engines.flags import flag_values
from supervisor.protocol import names
from supervisor.recipe.schema import BuildTag, Commit, RecipeBase, Section

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class RecipeSource(Section):
    repository: str = Field(min_length=1, description="git URL of the recipe repository")
    commit: Commit


class ImageBuild(Section):
    tag: BuildTag = Field(description="the recipe image, built from the checkout")
    from_: Literal["dockerfile", "prepare"] = Field(
        default="dockerfile",
        alias="from",
        description="dockerfile: built from the checkout; prepare: the prepare commands make it",
    )
    context: str = Field(default=".", description="build context, relative to the checkout")
    dockerfile: str = Field(default="Dockerfile", description="relative to the context")
    build_args: dict[str, str] = Field(default_factory=dict)

    @field_validator("context", "dockerfile")
    @classmethod
    def _relative(cls, value: str) -> str:
        if Path(value).is_absolute() or ".." in Path(value).parts:
            raise ValueError(f"{value!r} must be a path inside the checkout")
        return value


class PrepareCommands(Section):
    commands: list[list[str]] = Field(
        default_factory=list, description="run in the checkout with the settings as environment"
    )

    @field_validator("commands")
    @classmethod
    def _nonempty(cls, value: list[list[str]]) -> list[list[str]]:
        if any(not command for command in value):
            raise ValueError("a prepare command must not be empty")
        return value


class Grammar(Section):
    requirement: str = Field(min_length=1, description="pip requirement, e.g. xgrammar>=0.2.8,<0.3")
    modules: list[str] = Field(min_length=1, description="modules that must import afterwards")
    python: str = Field(default="python", description="the image's python executable")

    @field_validator("modules")
    @classmethod
    def _modules(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not _MODULE.fullmatch(name)]
        if bad:
            raise ValueError(f"not module names: {bad}")
        return value


class MemoryFigures(Section):
    """What a start needs, from the recipe's own measurements (GiB): the engine's startup
    estimate (weights and buffers, counted as measured) and its KV cache, either whole for the
    recipe's CONTEXT x PARALLEL or per token of CONTEXT x PARALLEL."""

    weights_gib: float = Field(ge=0, le=1_048_576, allow_inf_nan=False)
    kv_gib: float | None = Field(default=None, ge=0, le=1_048_576, allow_inf_nan=False)
    kv_bytes_per_token: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_kv(self) -> Self:
        if (self.kv_gib is None) == (self.kv_bytes_per_token is None):
            raise ValueError("give exactly one of kv_gib and kv_bytes_per_token")
        return self


class TensorFoldRecipe(RecipeBase):
    engine: Literal["tensorfold"]
    model: str = Field(min_length=1, description="the model it serves, for labels and messages")
    source: RecipeSource
    image: ImageBuild
    prepare: PrepareCommands = Field(default_factory=PrepareCommands)
    grammar: Grammar
    memory: MemoryFigures | None = Field(
        default=None, description="what a start needs; without it the start is not planned"
    )

    @property
    def grammar_tag(self) -> str:
        return f"{self.image.tag}-grammar"

    @property
    def image_from_prepare(self) -> bool:
        return self.image.from_ == "prepare"

    @model_validator(mode="after")
    def _served_name(self) -> Self:
        """The name it serves under (`served_names`) is a served name (protocol.names)."""
        for name in served_names(self):
            try:
                names.check(name)
            except ValueError as exc:
                raise ValueError(f"the name it serves under (--name, else model): {exc}") from None
        return self

    @model_validator(mode="after")
    def _prepare_makes_image(self) -> Self:
        if self.image_from_prepare and not self.prepare.commands:
            raise ValueError('image.from = "prepare" needs prepare.commands that make the image')
        return self


_NAME_FLAGS: Final = ("--name", "--served-model-name")
PARALLEL_FLAG: Final = "--parallel"
PARALLEL_SETTING: Final = "PARALLEL"


def served_names(recipe: TensorFoldRecipe) -> tuple[str, ...]:
    """Pure: the name TensorFold serves under: the last `--name` (or `--served-model-name`)
    of its run command, else the model it loads."""
    command = recipe.command
    found: tuple[str, ...] = ()
    for index, arg in enumerate(command):
        flag = arg.split("=", 1)[0]
        if flag in _NAME_FLAGS:
            found = flag_values(command[index:], flag)[:1] or found
    return found or (recipe.model,)


def parallel(recipe: TensorFoldRecipe) -> int | None:
    """Pure: the conversations TensorFold serves at once: the last `--parallel` of its run
    command (start.sh passes `--parallel "$PARALLEL"`), else the PARALLEL setting; None when
    neither gives a positive number (TensorFold's own default is not assumed)."""
    found = flag_values(recipe.command, PARALLEL_FLAG)
    raw = found[0] if found else str(recipe.settings.get(PARALLEL_SETTING, ""))
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None
