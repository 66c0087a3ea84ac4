"""The machine's memory settings: one TOML file every worker of the machine reads.

Where: `$LUCIA_MACHINE_FILE` when set (it must then exist), else
`$XDG_CONFIG_HOME/lucia/machine.toml` (`~/.config/lucia/machine.toml`), else the defaults.
`machine_file()` is the one place that decides. The format, every key optional:

    limit = "unified"          # "unified": the host's MemTotal; "gpu": the GPUs' memory
                               # (nvidia-smi); or a number of GiB, e.g. 121.7
    profile = "workstation"    # reserve defaults: "workstation" 4/3/8/3, "production" 8 each,
                               # "gpu-server" 0/0/0/2; default "gpu-server" when limit = "gpu"
    weight_multiplier = 2.0    # weights count this many times (a calibration knob)

    [reserves]                 # GiB; any left out takes the profile's value
    os = 4
    services = 3
    voice = 8                  # never below 8, except with profile "gpu-server"
    runtime = 3

A voice reserve below 8 GiB is refused (a validation error naming the file), not raised
silently to 8: an operator who wrote 6 learns that it does not hold. Only "gpu-server", where
the limit is the GPU's memory and voice lives in host RAM, may set it lower.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from supervisor.protocol.files import FileRefused, read_text

GIB: Final = 1024**3
MACHINE_ENV: Final = "LUCIA_MACHINE_FILE"
MACHINE_NAME: Final = "lucia/machine.toml"
VOICE_FLOOR_GIB: Final = 8.0
Profile = Literal["workstation", "production", "gpu-server"]
LimitKind = Literal["unified", "gpu"]
# profile -> (os, services, voice, runtime) in GiB
PROFILES: Final[dict[str, tuple[float, float, float, float]]] = {
    "workstation": (4, 3, 8, 3),
    "production": (8, 8, 8, 8),
    "gpu-server": (0, 0, 0, 2),
}

_BRANCHES: Final = ("literal[", "constrained-", "function-", "float", "int", "str")
_GiB = Annotated[float, Field(ge=0, le=1_048_576, allow_inf_nan=False)]


class MachineError(ValueError):
    """A settings file that cannot be used; str() is one line naming the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _ReservesFile(_Strict):
    os: _GiB | None = None
    services: _GiB | None = None
    voice: _GiB | None = None
    runtime: _GiB | None = None


class _MachineFile(_Strict):
    limit: str | float = "unified"
    profile: Profile | None = None
    weight_multiplier: float = Field(default=2.0, ge=1, le=10, allow_inf_nan=False)
    reserves: _ReservesFile = Field(default_factory=_ReservesFile)

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: str | float) -> str | float:
        if isinstance(value, str):
            if value in {"unified", "gpu"}:
                return value
        elif math.isfinite(value) and 0 < value <= 1_048_576:
            return value
        raise ValueError(f'must be "unified", "gpu" or a number of GiB above 0, not {value!r}')


@dataclass(frozen=True)
class MachineReserves:
    """The four reserves, in bytes."""

    os: int
    services: int
    voice: int
    runtime: int

    @property
    def total(self) -> int:
        return self.os + self.services + self.voice + self.runtime


@dataclass(frozen=True)
class MachineSettings:
    """The resolved settings: the limit (a kind to measure, or bytes), reserves in bytes."""

    limit: LimitKind | int
    profile: Profile
    reserves: MachineReserves
    weight_multiplier: float
    source: Path | None = None  # the file they came from; None: the defaults


def gib(value: float) -> int:
    return round(value * GIB)


def machine_file(environ: dict[str, str] | None = None) -> tuple[Path, bool]:
    """Where the settings file is, and whether it must exist (it must when named by the env)."""
    env = os.environ if environ is None else environ
    named = env.get(MACHINE_ENV)
    if named:
        return Path(named).expanduser().absolute(), True
    config = env.get("XDG_CONFIG_HOME") or str(Path("~/.config").expanduser())
    return Path(config).expanduser().absolute() / MACHINE_NAME, False


def parse(text: str, origin: str = "<machine settings>") -> MachineSettings:
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        raise MachineError(f"{origin}: not valid TOML: {str(exc)[:200]}") from None
    try:
        parsed = _MachineFile.model_validate(data)
    except ValidationError as exc:
        raise MachineError(f"{origin}: {_message(exc)}"[:300]) from None
    return _resolve(parsed, Path(origin) if origin.startswith("/") else None)


def _message(exc: ValidationError) -> str:
    """The first problem per key, as `key: what`; union branch names are left out."""
    seen: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        parts = [str(p) for p in err["loc"] if not str(p).startswith(_BRANCHES)]
        where = ".".join(part[:60] for part in parts) or "file"
        what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"][:120]
        what = what.removeprefix("Value error, ")
        seen.setdefault(where, what)
    return "; ".join(f"{where}: {what}" for where, what in list(seen.items())[:3])


def _resolve(parsed: _MachineFile, source: Path | None = None) -> MachineSettings:
    where = str(source) if source else "<machine settings>"
    profile: Profile = parsed.profile or ("gpu-server" if parsed.limit == "gpu" else "workstation")
    defaults = PROFILES[profile]
    given = parsed.reserves
    chosen = [
        default if value is None else value
        for value, default in zip(
            (given.os, given.services, given.voice, given.runtime), defaults, strict=True
        )
    ]
    if profile != "gpu-server" and chosen[2] < VOICE_FLOOR_GIB:
        raise MachineError(
            f"{where}: reserves.voice: {chosen[2]:g} GiB is below the voice floor of "
            f'{VOICE_FLOOR_GIB:g} GiB (only profile "gpu-server" may set it lower)'
        )
    limit: LimitKind | int
    if parsed.limit == "gpu":
        limit = "gpu"
    elif parsed.limit == "unified":
        limit = "unified"
    else:
        limit = gib(float(parsed.limit))
    return MachineSettings(
        limit=limit,
        profile=profile,
        reserves=MachineReserves(*(gib(value) for value in chosen)),
        weight_multiplier=parsed.weight_multiplier,
        source=source,
    )


def defaults() -> MachineSettings:
    return _resolve(_MachineFile())


def load(path: Path | None = None, environ: dict[str, str] | None = None) -> MachineSettings:
    """The settings from path, else from machine_file(); the defaults when no file is there."""
    required = path is not None
    if path is None:
        path, required = machine_file(environ)
    try:
        return parse(read_text(path), str(path))
    except FileNotFoundError:
        if required:
            raise MachineError(f"{path}: no such machine settings file") from None
        return defaults()
    except FileRefused as exc:
        raise MachineError(str(exc)) from None
