"""What every recipe has: the field types, the run section, settings and secrets (RecipeBase)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from string import Template
from typing import Annotated, Final, Literal, Self, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from supervisor.protocol.documents import Capability
from supervisor.protocol.files import FileRefused, read_text
from supervisor.recipe import reference

RUN_ARGUMENTS: Final = "$@"  # in run.check: the run command's arguments after its program
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path")
    return value


def _home(value: object) -> object:
    """`~` and `~/...` as [secrets] paths take them: the home of the user loading the recipe
    (the worker's own user; install.sh and the CLI load it as that user too)."""
    if isinstance(value, str) and value.startswith("~"):
        expanded = os.path.expanduser(value)
        if expanded.startswith("~"):
            raise ValueError(f"{value!r}: no such user's home directory")
        return expanded
    return value


ImageRef = Annotated[str, AfterValidator(reference.image_reference)]  # an image to pull
BuildTag = Annotated[str, AfterValidator(reference.image_tag)]  # an image to build
AbsolutePath = Annotated[str, AfterValidator(_absolute)]
# a path on the host: absolute, or under `~`, expanded when the recipe is loaded
HostPath = Annotated[str, BeforeValidator(_home), AfterValidator(_absolute)]
Commit = Annotated[str, Field(pattern=r"^[0-9a-f]{40}$", description="a full 40-hex commit id")]
Port = Annotated[int, Field(ge=1, le=65535)]


class RecipeError(ValueError):
    """A recipe that cannot be used; str() names the file and the problem."""


class Section(BaseModel):
    """A recipe table: unknown keys are refused, values never change after loading."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_SIZE = re.compile(r"(\d+)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_UNITS: Final = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_bytes(value: object) -> object:
    """An int of bytes, or "16GiB" / "10g" (binary units, as Docker reads shm_size)."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if not match:
            raise ValueError(f"{value!r} is not a size such as 16GiB")
        return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()[:1]]
    return value


ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(ge=1)]


class Volume(Section):
    source: str
    target: AbsolutePath
    read_only: bool = False


class Run(Section):
    network: str = Field(default="lucia", description="Docker network whose gateway gets the port")
    port: Port = Field(description="host port, published on the network's gateway only")
    container_port: Port | None = Field(default=None, description="defaults to port")
    ready_path: str = "/health"
    metrics_path: str = "/metrics"
    ready_timeout: float = Field(default=900.0, gt=0, le=86_400, allow_inf_nan=False)
    stop_grace: float = Field(default=60.0, ge=0, le=3_600, allow_inf_nan=False)
    gpus: Literal["all", "none"] | Annotated[int, Field(ge=1)] = "none"
    shm_size: str | None = None
    memory: str | None = Field(default=None, description="container memory limit, e.g. 120g")
    ipc: Literal["host", "private", "shareable"] | None = None
    ulimits: dict[str, Annotated[int, Field(ge=-1, le=2**63 - 1)]] = Field(default_factory=dict)
    volumes: list[Volume] = Field(default_factory=list)
    command: list[str] = Field(default_factory=list, description="${SETTING} is expanded")
    check: list[str] = Field(
        default_factory=list,
        description="run in a throwaway container (no GPU, mounts or network) before a start; "
        'the first item is the entrypoint, ${SETTING} is expanded, an item "$@" stands for '
        "run.command's arguments after its program; non-zero refuses the start",
    )

    @field_validator("ready_path", "metrics_path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} must start with '/'")
        return value

    @property
    def inner_port(self) -> int:
        return self.container_port or self.port


class RecipeBase(Section):
    """What every engine's recipe has: a name, its engine kind, settings (the environment) and a
    run spec. Each kind's schema (in its engine folder) extends it."""

    name: str
    engine: str = Field(description="the engine kind (the registry names the known ones)")
    model: str = Field(default="", description="the model it serves, for labels and messages")
    settings: dict[str, str | int] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(
        default_factory=dict,
        description="environment variable -> file holding its value (a token); read when used, "
        "passed only through the environment, never logged or shown",
    )
    run: Run
    capabilities: tuple[Capability, ...] | None = Field(
        default=None,
        description="what each model it serves serves, of chat, completion, embedding and "
        "responses (status.json's capabilities); unset: the engine kind's own rule, from its "
        "arguments, its model and what the running engine says",
    )

    @field_validator("capabilities")
    @classmethod
    def _once_each(cls, value: tuple[Capability, ...] | None) -> tuple[Capability, ...] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("each capability is named once")
        return value

    @field_validator("settings", "secrets")
    @classmethod
    def _env_names(cls, value: dict[str, str | int]) -> dict[str, str | int]:
        bad = [key for key in value if not _ENV_NAME.fullmatch(key)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return value

    @model_validator(mode="after")
    def _command_expands(self) -> Self:
        fields = (
            ("run.command", self.run.command),
            ("run.check", [arg for arg in self.run.check if arg != RUN_ARGUMENTS]),
            ("run.volumes", [volume.source for volume in self.run.volumes]),
        )
        for where, values in fields:
            for arg in values:
                try:
                    Template(arg).substitute(self.environment)
                except (KeyError, ValueError) as exc:
                    raise ValueError(f"{where} {arg!r} names an unknown setting {exc}") from None
        return self

    def expand(self, text: str) -> str:
        """${SETTING} replaced by the setting's value (validated at load)."""
        return Template(text).substitute(self.environment)

    @property
    def environment(self) -> dict[str, str]:
        return {key: str(value) for key, value in self.settings.items()}

    def secret_values(self) -> dict[str, str]:
        """Read each secret from its file (first line, stripped)."""
        values = {}
        for key, raw in self.secrets.items():
            path = Path(raw).expanduser()
            try:
                text = read_text(path, limit=16 * 1024)
            except FileNotFoundError:
                raise RecipeError(
                    f"secret {key}: {path} does not exist; put the value in that file (mode 600)"
                ) from None
            except FileRefused as exc:
                raise RecipeError(f"secret {key}: {exc}") from None
            value = text.strip().splitlines()[0].strip() if text.strip() else ""
            if not value:
                raise RecipeError(f"secret {key}: {path} is empty")
            values[key] = value
        return values

    @property
    def command(self) -> list[str]:
        return [self.expand(arg) for arg in self.run.command]

    @property
    def check_command(self) -> list[str]:
        """run.check expanded; "$@" becomes the run command's arguments (what start.sh checks)."""
        out: list[str] = []
        for arg in self.run.check:
            out.extend(self.command[1:] if arg == RUN_ARGUMENTS else [self.expand(arg)])
        return out


Recipe: TypeAlias = RecipeBase  # any engine's recipe; each kind's schema extends it
