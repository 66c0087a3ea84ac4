"""The vllm recipe: the channel, model and limits of `vllm serve`, and the KV cache tiers."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Final, Literal, Self

from pydantic import AfterValidator, Field, model_validator

from supervisor.engines.flags import flag_values
from supervisor.engines.vllm import account, cpu
from supervisor.engines.vllm.preflight import NIGHTLY_COMMIT, Choices
from supervisor.engines.vllm.tiers import DiskTier, Parallel, TierPlan, data_parallel
from supervisor.protocol import names
from supervisor.recipe import reference
from supervisor.recipe.schema import (
    ByteSize,
    Commit,
    HostPath,
    RecipeBase,
    Section,
    parse_bytes,
)

LIBRARY_MOUNT: Final = "/models"
BLOCK_SIZES: Final = {"cpu": 128, "gpu": 16}  # vLLM's default KV block (tokens) per device
CPU_BLOCK_MULTIPLE: Final = 32  # vLLM 0.32.0's CPU attention: get_supported_kernel_block_sizes
# vLLM 0.32.0's own max_num_seqs for its OpenAI server when none is given
# (EngineArgs.get_batch_defaults): on a CPU 128 per tensor x pipeline rank; on a GPU 256, or
# 1024 on cards of 70 GiB and more but A100s. The GPU figure here is the least of them (the
# worker does not read the card at each look): never more than the server runs at once.
CPU_DEFAULT_SEQS: Final = 128
GPU_DEFAULT_SEQS: Final = 256
_MAX_NUM_SEQS: Final = ("--max-num-seqs", "--max_num_seqs")
_BATCHED_TOKENS: Final = ("--max-num-batched-tokens", "--max_num_batched_tokens")
_PERFORMANCE_MODE: Final = ("--performance-mode", "--performance_mode")
_OTLP: Final = ("--otlp-traces-endpoint", "--otlp_traces_endpoint")
# The tier plugin's own defaults (kvplugin/lucia_kv/config.py `_DEFAULTS`), mirrored here only:
# the engine is given these whatever the plugin defaults to, and the memory plan counts them.
PLUGIN_BUFFER_BYTES: Final = 256 * 1024**2  # its staging buffer
PLUGIN_QUEUE_BYTES: Final = 256 * 1024**2  # the blocks waiting to be written to the tiers


class HfModel(Section):
    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the Hugging Face repository, owner/name",
    )
    revision: Commit = Field(description="the pinned commit (a tag or branch can move)")


class LibraryRef(Section):
    models_dir: str = Field(description="the host's model library: <guid>/model.json + files/")
    guid: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="a Ready model")


class VllmModel(Section):
    hf: HfModel | None = None
    library: LibraryRef | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.hf is None) == (self.library is None):
            raise ValueError("give exactly one of model.hf (id + revision) or model.library")
        return self


class DiskTierSpec(Section):
    path: HostPath = Field(
        description="tier root on the host (absolute, or under ~ of the worker's user); "
        "namespaces are created in it"
    )
    max_bytes: ByteSize


class Tiers(Section):
    shm_bytes: ByteSize | None = Field(default=None, description="offload cap in /dev/shm")
    nvme: DiskTierSpec | None = None
    hdd: DiskTierSpec | None = None
    key_secret: str = Field(default="LUCIA_KV_KEY", description="the [secrets] entry of the key")
    buffer_bytes: ByteSize = Field(
        default=PLUGIN_BUFFER_BYTES, description="the plugin's staging buffer in host memory"
    )
    queue_bytes: ByteSize = Field(
        default=PLUGIN_QUEUE_BYTES,
        description="the blocks waiting to be written to the tiers, each counted once",
    )
    kv_dtype: str = "auto"
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="KV block size in tokens; none: the device's (128 on cpu, 16 on gpu)",
    )

    @property
    def any(self) -> bool:
        return self.shm_bytes is not None or self.nvme is not None or self.hdd is not None

    @property
    def host_bytes(self) -> int:
        """What the plugin holds in the container's memory besides the shm tier (its staging
        buffer and write queue); 0 with the tiers off."""
        return self.buffer_bytes + self.queue_bytes if self.any else 0


class VllmSettings(Section):
    device: Literal["gpu", "cpu"] = Field(
        default="gpu",
        description="gpu: the GPU preflight picks a vllm/vllm-openai image; cpu: `image` runs "
        "on the CPU (no GPU is read), its KV cache sized by kv_cache_gib",
    )
    image: str = Field(
        default=cpu.IMAGE,
        min_length=1,
        description="device cpu: the vLLM CPU image (scripts/vllm-cpu-image.sh builds the "
        "default; a registry's copy is pulled when it is not on this host)",
    )
    kv_cache_gib: int = Field(
        default=4, ge=1, description="device cpu: VLLM_CPU_KVCACHE_SPACE, the KV cache in GiB"
    )
    channel: Literal["stable", "nightly"] = "stable"
    quantization: Literal["none", "fp8"] = "none"
    memory: int = Field(default=90, ge=10, le=95, description="percent of each GPU")
    nightly_commit: Commit | None = Field(default=None, description="the full pinned main commit")
    served_name: Annotated[str, AfterValidator(names.check)] = Field(
        description="the name requests give (protocol.names: a served name)"
    )
    max_model_len: int = Field(ge=256)
    prefix_caching: bool = True
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")
    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="--otlp-traces-endpoint: where vLLM exports its spans, as its container "
        "reaches it (the network's gateway address): http://172.18.0.1:4318/v1/traces",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] = Field(
        default="http/protobuf", description="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (vLLM's: grpc)"
    )
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
    def _served_names(self) -> Self:
        """What `--served-model-name` of the extra arguments gives keeps the rule too."""
        for name in flag_values(self.args, "--served-model-name", many=True):
            try:
                names.check(name)
            except ValueError as exc:
                raise ValueError(f"args --served-model-name: {exc}") from None
        return self

    @model_validator(mode="after")
    def _one_traces_endpoint(self) -> Self:
        parts = urllib.parse.urlsplit(self.otlp_traces_endpoint or "http://none")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
            raise ValueError("otlp_traces_endpoint: an http(s) URL with no credentials in it")
        if self.otlp_traces_endpoint and any(a.split("=")[0] in _OTLP for a in self.args):
            raise ValueError("otlp_traces_endpoint: give it there only, not in args too")
        return self

    @model_validator(mode="after")
    def _nightly_pinned(self) -> Self:
        if self.device == "cpu" and (self.channel, self.quantization) != ("stable", "none"):
            raise ValueError(
                "device cpu runs vllm.image: channel nightly and quantization fp8 choose GPU "
                "images; leave them out"
            )
        if self.channel == "nightly" and self.nightly_commit is None:
            raise ValueError("channel nightly needs nightly_commit (the full 40-hex commit)")
        commit = self.nightly_commit
        if commit is not None and not commit.startswith(NIGHTLY_COMMIT):
            raise ValueError(
                f"nightly_commit {commit[:12]} is not the guide's pinned nightly: it must be the "
                f"full 40-hex commit of vLLM main {NIGHTLY_COMMIT} (the one nightly this "
                "project is proven on)"
            )
        return self


class VllmRecipe(RecipeBase):
    engine: Literal["vllm"]
    vllm: VllmSettings
    tiers: Tiers = Field(default_factory=Tiers)

    @model_validator(mode="after")
    def _cpu_limits(self) -> Self:
        """On a CPU the container's memory limit is the engine's need: it must be given, and
        hold the KV cache and /dev/shm (which vLLM's CPU worker needs over 160 MiB of)."""
        if self.vllm.device != "cpu":
            return self
        shm = parse_bytes(self.run.shm_size) if self.run.shm_size else None
        memory = parse_bytes(self.run.memory) if self.run.memory else None
        if not isinstance(shm, int) or shm <= cpu.MIN_SHM_BYTES:
            raise ValueError('device cpu needs run.shm_size over 160 MiB (say "512m")')
        kv = self.vllm.kv_cache_gib * 1024**3
        if not isinstance(memory, int) or memory <= kv + shm:
            raise ValueError(
                "device cpu needs run.memory (the engine's memory need) larger than "
                "vllm.kv_cache_gib plus run.shm_size"
            )
        return self

    @property
    def memory_limit(self) -> int | None:
        """The container's memory limit in bytes, when the recipe gives one: run.memory (which
        holds /dev/shm and so the shm tier) plus the tier plugin's host buffers."""
        found = parse_bytes(self.run.memory) if self.run.memory else None
        return found + self.tiers.host_bytes if isinstance(found, int) else None

    @model_validator(mode="after")
    def _tiers_fit(self) -> Self:
        tiers = self.tiers
        if tiers.any and tiers.key_secret not in self.secrets:  # every tier's blocks are sealed
            raise ValueError(
                f'the KV tiers need the cache key: add [secrets] {tiers.key_secret} = "<file>" '
                "(a 0600 file holding 64 hex digits: openssl rand -hex 32)"
            )
        if tiers.shm_bytes is not None:
            if self.run.ipc == "host":  # the host's /dev/shm: shared, outlives it, never pruned
                raise ValueError(
                    'tiers.shm_bytes with run.ipc = "host" puts the offload in the /dev/shm of '
                    "the host, never pruned: remove run.ipc or tiers.shm_bytes"
                )
            shm = parse_bytes(self.run.shm_size) if self.run.shm_size else None
            memory = parse_bytes(self.run.memory) if self.run.memory else None
            if not isinstance(shm, int) or shm <= tiers.shm_bytes:
                raise ValueError("tiers.shm_bytes needs run.shm_size larger than the offload")
            if not isinstance(memory, int) or memory <= shm:
                raise ValueError(
                    "tiers.shm_bytes needs run.memory larger than run.shm_size "
                    "(shared memory counts against the container's limit)"
                )
        return self

    @model_validator(mode="after")
    def _not_root(self) -> Self:
        """The engine runs as the service user (account.py): nothing it needs may be in /root."""
        targets = [volume.target for volume in self.run.volumes]
        why = account.refused_paths(targets, self.environment)
        if why is not None:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _cpu_block(self) -> Self:
        size = self.tiers.block_size
        if self.vllm.device == "cpu" and size is not None and size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"tiers.block_size {size}: vLLM's CPU attention takes multiples of "
                f"{CPU_BLOCK_MULTIPLE} tokens only; leave it out for the CPU default "
                f"({BLOCK_SIZES['cpu']})"
            )
        return self

    @property
    def block_size(self) -> int:
        """The KV block size the engine runs with: the recipe's, else the device's default."""
        return self.tiers.block_size or BLOCK_SIZES[self.vllm.device]

    def layout_args(self) -> tuple[str, ...]:
        """The parallel configuration and KV layout the namespace names, as vLLM flags (each
        only where it differs from vLLM's default on this device)."""
        args: list[str] = []
        vllm, tiers = self.vllm, self.tiers
        if vllm.tensor_parallel > 1:
            args += ["--tensor-parallel-size", str(vllm.tensor_parallel)]
        if vllm.pipeline_parallel > 1:
            args += ["--pipeline-parallel-size", str(vllm.pipeline_parallel)]
        if tiers.kv_dtype != "auto":
            args += ["--kv-cache-dtype", tiers.kv_dtype]
        if self.block_size != BLOCK_SIZES[vllm.device]:
            args += ["--block-size", str(self.block_size)]
        return tuple(args)

    def otlp_args(self) -> tuple[str, ...]:
        """vLLM's own spans, when the recipe names their receiver."""
        url = self.vllm.otlp_traces_endpoint
        return (_OTLP[0], url) if url is not None else ()

    def otlp_environment(self) -> dict[str, str]:
        """Its span exporter's protocol and service.name (the recipe's, unless [settings]
        gives OTEL_SERVICE_NAME), when the recipe names a receiver."""
        if self.vllm.otlp_traces_endpoint is None:
            return {}
        service = self.environment.get("OTEL_SERVICE_NAME", self.name)
        protocol = self.vllm.otlp_protocol
        return {"OTEL_SERVICE_NAME": service, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}

    def parallel(self) -> Parallel:
        """The parallel configuration the namespace names: tensor and pipeline sizes, and the
        data-parallel size the extra arguments give."""
        v = self.vllm
        return Parallel(v.tensor_parallel, v.pipeline_parallel, data_parallel(v.args))

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
        shm = parse_bytes(self.run.shm_size) if self.run.shm_size else 0
        return TierPlan(
            t.shm_bytes or 0,
            int(shm),  # type: ignore[call-overload]
            self.memory_limit or 0,
            disks,
            data_parallel(self.vllm.args),
            t.buffer_bytes,
            t.queue_bytes,
        )


def served_names(recipe: VllmRecipe) -> tuple[str, ...]:
    """Pure: the names vLLM serves the model under, as its run spec passes them: the recipe's
    served_name, or what its extra arguments' `--served-model-name` (nargs "+") give."""
    args = ("--served-model-name", recipe.vllm.served_name, *recipe.vllm.args)
    return flag_values(args, "--served-model-name", many=True)


def _last(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value the last of these flags gives (`--flag V` or `--flag=V`), as argparse reads."""
    found = None
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in names:
            found = value if equals else (args[at + 1] if at + 1 < len(args) else "")
    return found


def _number(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and int(value) >= 1 else None


def max_num_seqs(recipe: VllmRecipe) -> int:
    """Pure: how many requests the vLLM server runs at once: `--max-num-seqs` of the extra
    arguments, else vLLM 0.32.0's own default on the device (doubled by `--performance-mode
    throughput`, capped by `--max-num-batched-tokens`, as vLLM does), per data-parallel rank,
    times the ranks (each has a scheduler of its own). vLLM reports it over no HTTP route."""
    v = recipe.vllm
    seqs = _number(_last(v.args, _MAX_NUM_SEQS))
    if seqs is None:
        world = v.tensor_parallel * v.pipeline_parallel
        seqs = CPU_DEFAULT_SEQS * world if v.device == "cpu" else GPU_DEFAULT_SEQS
        if _last(v.args, _PERFORMANCE_MODE) == "throughput":
            seqs *= 2
        batched = _number(_last(v.args, _BATCHED_TOKENS))
        if batched is not None:
            seqs = min(seqs, batched)
    return seqs * data_parallel(v.args)
