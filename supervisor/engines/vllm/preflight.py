"""vLLM's preflight: from the recipe's choices and the GPU facts, the image and arguments, or a
refusal with the operators' guide's code and fix. Pure: nothing is pulled or started here.

Images (vLLM's release pipeline, `.buildkite/scripts/publish-release-images.sh`): the default
`vllm/vllm-openai:vX.Y.Z` is built on CUDA 13.0, `vX.Y.Z-cu129` on CUDA 12.9. Nightly builds of
main are published as `vllm/vllm-openai:nightly-<full commit>`
(`.buildkite/scripts/push-nightly-builds.sh`); old nightly tags are pruned from Docker Hub, so
the pinned nightly is named by its full 40-hex commit and, once pulled, recorded by digest.

Arguments follow the image's entrypoint, `vllm serve`: the model comes first. `arguments` is the
one builder of vLLM's command line, a CPU image's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from supervisor.hw.gpu import GpuFacts, GpuUnavailable

STABLE_VERSION: Final = "v0.32.0"
REPOSITORY: Final = "vllm/vllm-openai"
STABLE_IMAGE: Final = f"{REPOSITORY}:{STABLE_VERSION}"
STABLE_CUDA12_IMAGE: Final = f"{STABLE_IMAGE}-cu129"
NIGHTLY_COMMIT: Final = "e68efc685ab1"  # vLLM main, 2026-10-19 (the guide's pin, abbreviated)
FP8_MIN_CAPABILITY: Final = (8, 9)  # Ada and Hopper or newer
CONTAINER_PORT: Final = 8000

Channel = Literal["stable", "nightly"]
Quantization = Literal["none", "fp8"]


@dataclass(frozen=True)
class Choices:
    """What the recipe chose; `model` is what `vllm serve` loads (an HF id or a mounted path)."""

    channel: Channel
    quantization: Quantization
    memory_share: int  # percent of each GPU, 10..95
    model: str
    served_name: str
    max_model_len: int
    revision: str | None = None  # the pinned HF commit; None for a library model (a path)
    nightly_commit: str | None = None  # the full 40-hex commit of the pinned nightly
    prefix_caching: bool = True
    port: int = CONTAINER_PORT
    extra_args: tuple[str, ...] = ()
    repository: str = REPOSITORY  # a mirror of vllm/vllm-openai: the tags are chosen the same


@dataclass(frozen=True)
class PreflightRefusal:
    code: str
    message: str  # the problem, the detail, then the guide's fix: one line

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class Launch:
    image: str
    args: tuple[str, ...]


NIGHTLY_NEEDS_CUDA13: Final = "vllm_nightly_needs_cuda13"
FP8_UNSUPPORTED: Final = "vllm_fp8_unsupported"
# not in the guide; what a start also cannot survive
NO_GPU: Final = "vllm_no_gpu"
CUDA_UNSUPPORTED: Final = "vllm_cuda_unsupported"
GPU_MEMORY_BUSY: Final = "vllm_gpu_memory_busy"
NIGHTLY_UNPINNED: Final = "vllm_nightly_unpinned"


def _refuse(code: str, problem: str, detail: str, fix: str) -> PreflightRefusal:
    return PreflightRefusal(code, f"{problem} ({detail}). {fix}")


def image(choices: Choices, facts: GpuFacts) -> str | PreflightRefusal:
    cuda = facts.cuda
    shown = f"the driver supports CUDA {cuda}" if cuda else "the driver reports no CUDA version"
    if choices.channel == "nightly":
        if cuda is None or cuda.major < 13:
            return _refuse(
                NIGHTLY_NEEDS_CUDA13,
                "nightly on a host without CUDA 13",
                shown,
                "Use stable, or move the model to a CUDA 13 host.",
            )
        if not choices.nightly_commit:
            return _refuse(
                NIGHTLY_UNPINNED,
                "nightly without its commit",
                "vllm.nightly_commit is unset",
                f"Set it to the full 40-hex commit of {NIGHTLY_COMMIT}.",
            )
        return f"{choices.repository}:nightly-{choices.nightly_commit}"
    if cuda is None or cuda.major < 12:
        return _refuse(
            CUDA_UNSUPPORTED,
            f"vLLM {STABLE_VERSION} on a host without CUDA 12 or 13",
            shown,
            "Update the NVIDIA driver to one that supports CUDA 12.9 or 13.",
        )
    tag = f"{STABLE_VERSION}-cu129" if cuda.major == 12 else STABLE_VERSION
    return f"{choices.repository}:{tag}"


def fp8_refusal(facts: GpuFacts) -> PreflightRefusal | None:
    below = [g for g in facts.gpus if g.compute_capability < FP8_MIN_CAPABILITY]
    if not below:
        return None
    shown = ", ".join(f"GPU {g.index} {g.name} is {g.capability}" for g in below)
    return _refuse(FP8_UNSUPPORTED, "fp8 on a GPU below 8.9", shown, "Use none.")


def memory_refusal(
    facts: GpuFacts, share: int, reclaimable_mib: int = 0
) -> PreflightRefusal | None:
    """vLLM checks at start that `share` of each GPU is free; other containers holding GPU
    memory make it fail. `reclaimable_mib`: what the engine this start replaces holds (it is
    stopped first). A GPU that reports no memory (unified memory) is left to the memory plan."""
    short = []
    for g in facts.gpus:
        if g.memory_total_mib is None or g.memory_free_mib is None:
            continue
        needed = g.memory_total_mib * share // 100
        free = g.memory_free_mib + reclaimable_mib
        if free < needed:
            short.append(f"GPU {g.index} has {free} MiB free of the {needed} MiB needed")
    if not short:
        return None
    return _refuse(
        GPU_MEMORY_BUSY,
        f"{share} % of the GPU memory is not free",
        "; ".join(short),
        "Stop what holds GPU memory, or lower the memory share.",
    )


def arguments(choices: Choices, device: Literal["gpu", "cpu"] = "gpu") -> tuple[str, ...]:
    """vLLM's command line, for either image: a GPU image's `vllm serve` takes the model first,
    then the GPU's memory share and fp8; the CPU image's server takes the model as `--model` and
    has neither (cpu.py). The order is fixed: a start compares a running engine's command to it."""
    gpu = device == "gpu"
    args = [choices.model] if gpu else ["--model", choices.model]
    if choices.revision:
        args += ["--revision", choices.revision]
    args += [
        "--served-model-name",
        choices.served_name,
        "--max-model-len",
        str(choices.max_model_len),
    ]
    if gpu:
        args += ["--gpu-memory-utilization", f"{choices.memory_share / 100:.2f}"]
    args += [
        "--host",
        "0.0.0.0",  # noqa: S104 - inside the container; published on the gateway only
        "--port",
        str(choices.port),
    ]
    if gpu and choices.quantization == "fp8":
        args += ["--quantization", "fp8"]
    args.append(
        "--enable-prefix-caching" if choices.prefix_caching else "--no-enable-prefix-caching"
    )
    return (*args, *choices.extra_args)


def decide(
    choices: Choices, facts: GpuFacts | GpuUnavailable, reclaimable_mib: int | None = None
) -> Launch | PreflightRefusal:
    """The first refusal in the order GPU, image, quantization, memory; else the launch.

    The memory check runs only when `reclaimable_mib` is given (the worker knows what its own
    running engine holds); without it the memory plan decides.
    """
    if isinstance(facts, GpuUnavailable):
        fix = "Run the vLLM engine on a host with an NVIDIA GPU."
        return PreflightRefusal(NO_GPU, f"{facts.reason}. {fix}")
    if not facts.gpus:
        fix = "Run it on a host with an NVIDIA GPU."
        return PreflightRefusal(NO_GPU, f"nvidia-smi lists no GPU. {fix}")
    chosen = image(choices, facts)
    if isinstance(chosen, PreflightRefusal):
        return chosen
    if choices.quantization == "fp8":
        refused = fp8_refusal(facts)
        if refused:
            return refused
    if reclaimable_mib is not None:
        busy = memory_refusal(facts, choices.memory_share, reclaimable_mib)
        if busy:
            return busy
    return Launch(chosen, arguments(choices))


def refusal_codes() -> Sequence[str]:
    return (
        NIGHTLY_NEEDS_CUDA13,
        FP8_UNSUPPORTED,
        NO_GPU,
        CUDA_UNSUPPORTED,
        GPU_MEMORY_BUSY,
        NIGHTLY_UNPINNED,
    )
