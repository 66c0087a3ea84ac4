"""What the machine has: its memory limit and what is available now, host or GPU.

The host's figures come from /proc/meminfo (MemTotal, MemAvailable; kB there, bytes here). The
GPU's come from a GpuQuery: any function returning (total, free) bytes summed over the GPUs the
engines use; nvidia_smi_query() asks the GPU boundary (hw.gpu), which runs nvidia-smi.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from supervisor.hw import gpu
from supervisor.memplan.settings import MachineSettings
from supervisor.protocol.files import read_text

MEMINFO: Final = Path("/proc/meminfo")

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


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in {"MemTotal", "MemAvailable"}:
            number, _, unit = rest.strip().partition(" ")
            if not number.isdigit() or unit not in {"kB", ""}:
                raise ProbeFailed(f"/proc/meminfo: cannot read {key}: {rest.strip()!r}")
            found[key] = int(number) * (1024 if unit == "kB" else 1)
    if len(found) != 2:
        raise ProbeFailed("/proc/meminfo: MemTotal or MemAvailable is missing")
    return found["MemTotal"], found["MemAvailable"]


def host_memory(path: Path = MEMINFO) -> tuple[int, int]:
    return parse_meminfo(read_text(path, limit=1024 * 1024))


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
