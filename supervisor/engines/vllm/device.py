"""How vLLM runs on the recipe's device: a CPU's image as it is, or a GPU's preflight's pick.

Chosen once, when the engine is made (`choose`), so the engine asks the same questions of either
and never which one it has. A CPU runs the recipe's image with the CPU entrypoint's arguments,
reads no GPU, checks run.memory against the machine before a pull and plans run.memory; a GPU
runs what its last passed preflight picked, reads the GPU again before each start, and plans
its share of the memory the plan measures, through the recipe's nvidia-smi.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from supervisor.engines.base import StepContext
from supervisor.engines.vllm import cpu, tier_image
from supervisor.engines.vllm import memory as vllm_memory
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.steps import reclaimable_mib, refused
from supervisor.hw import gpu
from supervisor.memplan import guard, probe
from supervisor.memplan.need import EngineNeed
from supervisor.memplan.probe import Memory
from supervisor.memplan.settings import MachineSettings


class Device(Protocol):
    """What differs between vLLM on a CPU and on a GPU."""

    @property
    def choices(self) -> pf.Choices:
        """The recipe's choices, read once: what the arguments are built from."""
        ...

    @property
    def site_packages(self) -> str:
        """Where the image has vLLM's packages: the tier plugin goes beside them."""
        ...

    @property
    def environment(self) -> Mapping[str, str]:
        """The container's environment of this device's own."""
        ...

    def measure(self, machine: MachineSettings) -> Memory:
        """The memory the plan measures for this engine."""
        ...

    def launch(self, passed: Callable[[], pf.Launch | None]) -> pf.Launch | None:
        """What runs; None until a preflight has passed (passed reads the last one's record)."""
        ...

    def fit_before_pull(self, planned: bool) -> int | None:
        """The need checked against the machine before the image is pulled; None: no check."""
        ...

    def need(self, planned: bool) -> EngineNeed | None:
        """What a start needs; None: the start is not planned."""
        ...

    def recheck(self, ctx: StepContext, share: Callable[[], int | None]) -> pf.Launch | None:
        """Just before a start, the launch decided again on the device as it is now (a refusal
        raises); share reads the replaced engine's memory share. None: nothing is read again."""
        ...


def choose(recipe: VllmRecipe) -> Device:
    """The recipe's device, once: `vllm.device`."""
    choices = recipe.preflight_choices()
    if recipe.vllm.device == "cpu":
        return CpuDevice(recipe, choices)
    return GpuDevice(recipe, choices)


def probe_gpu(nvidia_smi: str) -> gpu.GpuFacts | gpu.GpuUnavailable:
    """The GPU as the recipe's nvidia-smi reports it."""
    return gpu.probe(gpu.with_program(nvidia_smi))


@dataclass(frozen=True)
class CpuDevice:
    """The recipe's CPU image (cpu.py); no GPU is read, run.memory is the need."""

    recipe: VllmRecipe
    choices: pf.Choices

    @property
    def site_packages(self) -> str:
        return tier_image.SITE_PACKAGES

    @property
    def environment(self) -> Mapping[str, str]:
        return cpu.environment(self.recipe.vllm.kv_cache_gib)

    def measure(self, machine: MachineSettings) -> Memory:
        return guard.measure(machine)

    def launch(self, passed: Callable[[], pf.Launch | None]) -> pf.Launch:
        return cpu.launch(self.choices, self.recipe.vllm.image)

    def fit_before_pull(self, planned: bool) -> int | None:
        """run.memory, when the machine plans: a pull only for a start that fits."""
        return self.recipe.memory_limit if planned else None

    def need(self, planned: bool) -> EngineNeed | None:
        """The container's limit, planned or not (the plan's own preview asks for it too)."""
        return vllm_memory.cpu_need(self.recipe)

    def recheck(self, ctx: StepContext, share: Callable[[], int | None]) -> None:
        return None


@dataclass(frozen=True)
class GpuDevice:
    """The image the preflight picks for the GPU; the GPU read again before each start."""

    recipe: VllmRecipe
    choices: pf.Choices

    @property
    def site_packages(self) -> str:
        return tier_image.GPU_SITE_PACKAGES

    @property
    def environment(self) -> Mapping[str, str]:
        return {}

    def measure(self, machine: MachineSettings) -> Memory:
        """The plan's limit read through the recipe's nvidia-smi, not the one on PATH."""
        smi = self.recipe.vllm.nvidia_smi
        return guard.measure(machine, gpu=lambda: probe.nvidia_smi_query(nvidia_smi=smi))

    def launch(self, passed: Callable[[], pf.Launch | None]) -> pf.Launch | None:
        return passed()

    def fit_before_pull(self, planned: bool) -> int | None:
        return None  # the preflight decides before the pull

    def need(self, planned: bool) -> EngineNeed | None:
        """The recipe's share of the limit the plan measures: the GPUs' memory on a GPU
        server, the unified memory on a Spark (its GPU reports none)."""
        if not planned:
            return None
        measured = self.measure(guard.load_settings())
        return vllm_memory.gpu_need(self.recipe, measured.limit, host=measured.host)

    def recheck(self, ctx: StepContext, share: Callable[[], int | None]) -> pf.Launch:
        """The guide's refusals, and the memory share free once the replaced engine stops."""
        ctx.progress("checking the GPU again before the start")
        facts = probe_gpu(self.recipe.vllm.nvidia_smi)
        return refused(pf.decide(self.choices, facts, reclaimable_mib(facts, share())))
