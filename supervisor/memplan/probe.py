"""What the machine has: its memory limit and what is available now, host or GPU.

The host's figures come from /proc/meminfo (MemTotal, MemAvailable, read by hw.meminfo). The
GPU's come from a GpuQuery: any function returning (total, free) bytes summed over the GPUs the
engines use; nvidia_smi_query() asks the GPU boundary (hw.gpu), which runs nvidia-smi.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.hw import gpu
from supervisor.hw.meminfo import MEMINFO, MeminfoUnreadable, read_meminfo
from supervisor.memplan.settings import MachineSettings

GpuQuery = Callable[[], tuple[int, int]]


class ProbeFailed(RuntimeError):
    """The machine's memory could not be measured; str() says what was tried."""


@dataclass(frozen=True)
class Memory:
    """The limit the plan divides, and what is free now (MemAvailable, or the GPUs' free)."""

    source: Literal["host", "gpu", "fixed"]
    limit: int
    available: int

    @property
    def host(self) -> bool:
        """Whether the limit is host memory (MemTotal or a fixed figure), not the GPUs'."""
        return self.source != "gpu"


def host_memory(path: Path = MEMINFO) -> tuple[int, int]:
    """The host's (MemTotal, MemAvailable); ProbeFailed when /proc/meminfo does not say them."""
    try:
        return read_meminfo(path)
    except MeminfoUnreadable as exc:
        raise ProbeFailed(str(exc)) from None


def parse_nvidia_smi(text: str) -> tuple[int, int]:
    """(total, free) bytes summed over the lines `total, free` (MiB) nvidia-smi prints."""
    try:
        return gpu.parse_memory(text)
    except gpu.GpuParseError as exc:
        raise ProbeFailed(str(exc)) from None


def nvidia_smi_query(timeout: float = 10.0, nvidia_smi: str = "nvidia-smi") -> tuple[int, int]:
    """The GPUs' (total, free) from the GPU boundary (hw.gpu); nvidia_smi: the program to run."""
    found = gpu.memory(gpu.with_program(nvidia_smi), timeout)
    if isinstance(found, gpu.GpuUnavailable):
        raise ProbeFailed(found.reason)
    return found


def measure(
    settings: MachineSettings,
    host: Callable[[], tuple[int, int]] = host_memory,
    gpu: GpuQuery = nvidia_smi_query,
) -> Memory:
    """The limit and the memory free now, as the settings say to measure them."""
    if settings.limit == "gpu":
        total, free = gpu()
        return Memory("gpu", total, free)
    total, available = host()
    if settings.limit == "unified":
        return Memory("host", total, available)
    return Memory("fixed", settings.limit, min(available, settings.limit))
