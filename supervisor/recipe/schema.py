"""Recipe files (TOML): what an engine is, where its source and image come from, how it runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from string import Template
from typing import Annotated, Final, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from supervisor import paths
from supervisor.engines.vllm.preflight import Choices
from supervisor.engines.vllm.tiers import DiskTier, TierPlan
from supervisor.protocol.files import FileRefused, read_text
from supervisor.recipe import reference

RECIPES_ENV: Final = paths.RECIPES_ENV
RUN_ARGUMENTS: Final = "$@"  # in run.check: the run command's arguments after its program
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path")
    return value


ImageRef = Annotated[str, AfterValidator(reference.image_reference)]  # an image to pull
BuildTag = Annotated[str, AfterValidator(reference.image_tag)]  # an image to build
AbsolutePath = Annotated[str, AfterValidator(_absolute)]
Commit = Annotated[str, Field(pattern=r"^[0-9a-f]{40}$", description="a full 40-hex commit id")]
Port = Annotated[int, Field(ge=1, le=65535)]


class RecipeError(ValueError):
    """A recipe that cannot be used; str() names the file and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Section):
    repository: str = Field(min_length=1, description="git URL of the recipe repository")
    commit: Commit


class ImageBuild(_Section):
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


class Prepare(_Section):
    commands: list[list[str]] = Field(
        default_factory=list, description="run in the checkout with the settings as environment"
    )

    @field_validator("commands")
    @classmethod
    def _nonempty(cls, value: list[list[str]]) -> list[list[str]]:
        if any(not command for command in value):
            raise ValueError("a prepare command must not be empty")
        return value


class Grammar(_Section):
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


class Volume(_Section):
    source: str
    target: AbsolutePath
    read_only: bool = False


class Run(_Section):
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
        "the first item is the entrypoint, ${SETTING} is expanded, an item \"$@\" stands for "
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


class RecipeBase(_Section):
    """What every engine's recipe has: a name, settings (the environment) and a run spec."""

    name: str
    model: str = Field(default="", description="the model it serves, for labels and messages")
    settings: dict[str, str | int] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(
        default_factory=dict,
        description="environment variable -> file holding its value (a token); read when used, "
        "passed only through the environment, never logged or shown",
    )
    run: Run

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


class MemoryFigures(_Section):
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
    source: Source
    image: ImageBuild
    prepare: Prepare = Field(default_factory=Prepare)
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
    def _prepare_makes_image(self) -> Self:
        if self.image_from_prepare and not self.prepare.commands:
            raise ValueError('image.from = "prepare" needs prepare.commands that make the image')
        return self


class Library(_Section):
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


class Router(_Section):
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
    library: Library
    router: Router


_SIZE = re.compile(r"(\d+)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
LIBRARY_MOUNT: Final = "/models"
_UNITS: Final = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _bytes(value: object) -> object:
    """An int of bytes, or "16GiB" / "10g" (binary units, as Docker reads shm_size)."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if not match:
            raise ValueError(f"{value!r} is not a size such as 16GiB")
        return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()[:1]]
    return value


ByteSize = Annotated[int, BeforeValidator(_bytes), Field(ge=1)]


class HfModel(_Section):
    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the Hugging Face repository, owner/name",
    )
    revision: Commit = Field(description="the pinned commit (a tag or branch can move)")


class LibraryRef(_Section):
    models_dir: str = Field(description="the host's model library: <guid>/model.json + files/")
    guid: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="a Ready model")


class VllmModel(_Section):
    hf: HfModel | None = None
    library: LibraryRef | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.hf is None) == (self.library is None):
            raise ValueError("give exactly one of model.hf (id + revision) or model.library")
        return self


class DiskTierSpec(_Section):
    path: AbsolutePath = Field(description="tier root on the host; namespaces are created in it")
    max_bytes: ByteSize


class Tiers(_Section):
    shm_bytes: ByteSize | None = Field(default=None, description="offload cap in /dev/shm")
    nvme: DiskTierSpec | None = None
    hdd: DiskTierSpec | None = None
    key_secret: str = Field(default="LUCIA_KV_KEY", description="the [secrets] entry of the key")
    plugin_version: str = Field(default="", description="the tier plugin's version (namespace)")
    kv_dtype: str = "auto"
    block_size: int = Field(default=16, ge=1)

    @property
    def any(self) -> bool:
        return self.shm_bytes is not None or self.nvme is not None or self.hdd is not None


class Vllm(_Section):
    channel: Literal["stable", "nightly"] = "stable"
    quantization: Literal["none", "fp8"] = "none"
    memory: int = Field(default=90, ge=10, le=95, description="percent of each GPU")
    nightly_commit: Commit | None = Field(default=None, description="the full pinned main commit")
    served_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    max_model_len: int = Field(ge=256)
    prefix_caching: bool = True
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")
    model: VllmModel
    repository: Annotated[str, AfterValidator(reference.repository)] = Field(
        default="vllm/vllm-openai",
        description="where the vLLM images come from: a mirror or an air-gapped registry holding "
        "the same tags (v0.32.0, v0.32.0-cu129, nightly-<commit>); the preflight picks the tag",
    )
    nvidia_smi: str = Field(
        default="nvidia-smi",
        min_length=1,
        description="the nvidia-smi the GPU preflight runs: a path where it is not on PATH; "
        "tests point it at a script printing a recorded card's outputs",
    )

    @model_validator(mode="after")
    def _nightly_pinned(self) -> Self:
        if self.channel == "nightly" and self.nightly_commit is None:
            raise ValueError("channel nightly needs nightly_commit (the full 40-hex commit)")
        return self


class VllmRecipe(RecipeBase):
    engine: Literal["vllm"]
    vllm: Vllm
    tiers: Tiers = Field(default_factory=Tiers)

    @model_validator(mode="after")
    def _tiers_fit(self) -> Self:
        tiers = self.tiers
        if (tiers.nvme or tiers.hdd) and tiers.key_secret not in self.secrets:
            raise ValueError(
                f'disk tiers need the cache key: add [secrets] {tiers.key_secret} = "<file>"'
            )
        if tiers.shm_bytes is not None:
            shm = _bytes(self.run.shm_size) if self.run.shm_size else None
            memory = _bytes(self.run.memory) if self.run.memory else None
            if not isinstance(shm, int) or shm <= tiers.shm_bytes:
                raise ValueError("tiers.shm_bytes needs run.shm_size larger than the offload")
            if not isinstance(memory, int) or memory <= shm:
                raise ValueError(
                    "tiers.shm_bytes needs run.memory larger than run.shm_size "
                    "(shared memory counts against the container's limit)"
                )
        return self

    @property
    def model_argument(self) -> str:
        """What `vllm serve` loads: the HF id, or the library model mounted at /models/<guid>."""
        model = self.vllm.model
        return model.hf.id if model.hf else f"{LIBRARY_MOUNT}/{model.library.guid}"  # type: ignore[union-attr]

    @property
    def model_revision(self) -> str | None:
        return self.vllm.model.hf.revision if self.vllm.model.hf else None

    def preflight_choices(self) -> Choices:
        v = self.vllm
        return Choices(
            channel=v.channel,
            quantization=v.quantization,
            memory_share=v.memory,
            model=self.model_argument,
            revision=self.model_revision,
            served_name=v.served_name,
            max_model_len=v.max_model_len,
            nightly_commit=v.nightly_commit,
            prefix_caching=v.prefix_caching,
            port=self.run.inner_port,
            extra_args=tuple(v.args),
            repository=v.repository,
        )

    def tier_plan(self) -> TierPlan:
        t = self.tiers
        disks = tuple(
            DiskTier(name, Path(spec.path), spec.max_bytes)
            for name, spec in (("nvme", t.nvme), ("hdd", t.hdd))
            if spec is not None
        )
        shm = _bytes(self.run.shm_size) if self.run.shm_size else 0
        memory = _bytes(self.run.memory) if self.run.memory else 0
        return TierPlan(t.shm_bytes or 0, int(shm), int(memory), disks)  # type: ignore[call-overload]


Recipe = Annotated[TensorFoldRecipe | LlamaRouterRecipe | VllmRecipe, Field(discriminator="engine")]
_RECIPE: TypeAdapter[TensorFoldRecipe | LlamaRouterRecipe | VllmRecipe] = TypeAdapter(Recipe)


_MESSAGE: Final = 300  # a recipe error is one line; keys and values in it are clipped
_ENGINES: Final = ("tensorfold", "llama-router", "vllm")


def _clip(text: str, limit: int = 60) -> str:
    escaped = repr(text[:limit])[1:-1]  # control characters and newlines become escapes
    return escaped + ("…" if len(text) > limit else "")


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        where = ".".join(_clip(str(p)) for p in err["loc"][1:] or err["loc"])
        what = "unknown key" if err["type"] == "extra_forbidden" else _clip(err["msg"], 200)
        parts.append(f"{where}: {what}" if where else what)
    return "; ".join(parts)


def _nul(value: object, where: str = "") -> str | None:
    """Where a NUL character hides in the data (it cannot be an argument, a path or a value)."""
    if isinstance(value, str):
        return (where or "a value") if "\x00" in value else None
    items: list[tuple[str, object]] = []
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
        if any("\x00" in key for key, _ in items):
            return where or "a key"
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    for key, item in items:
        found = _nul(item, f"{where}.{key}" if where else key)
        if found:
            return found
    return None


def parse(text: str, origin: str = "<recipe>") -> TensorFoldRecipe | LlamaRouterRecipe | VllmRecipe:
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        # ValueError: an integer beyond int()'s digit limit; RecursionError: absurd nesting
        detail = _clip(str(exc) or type(exc).__name__, 200)
        raise RecipeError(f"{origin}: not valid TOML: {detail}") from None
    engine = data.get("engine")
    if engine not in _ENGINES:
        shown = f"'{_clip(engine)}'" if isinstance(engine, str) else "missing"
        raise RecipeError(f"{origin}: engine: must be one of {', '.join(_ENGINES)} ({shown})")
    try:
        parsed = _RECIPE.validate_python(data)
    except ValidationError as exc:  # an unknown key is named as such, NUL in it or not
        raise RecipeError(f"{origin}: {_format(exc)}"[:_MESSAGE]) from None
    where = _nul(data)
    if where:
        raise RecipeError(f"{origin}: {_clip(where)}: contains a NUL character")
    return parsed


def load(path: Path) -> TensorFoldRecipe | LlamaRouterRecipe | VllmRecipe:
    try:
        return parse(read_text(path), str(path))
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except FileRefused as exc:
        raise RecipeError(str(exc)) from None


def recipes_dir(value: str | None = None) -> Path:
    """Where recipes live (paths.recipes_dir: the one place the default is resolved)."""
    return paths.recipes_dir(value)


def locate(name: str, recipe: str | None = None, recipes: str | None = None) -> Path:
    return paths.recipe_file(name, recipe, recipes)
