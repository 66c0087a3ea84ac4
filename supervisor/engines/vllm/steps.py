"""The vllm engine's own prerequisites, as values, and the pure rules its steps apply."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.engines.look import Prerequisites
from supervisor.engines.vllm import preflight as pf
from supervisor.errors import Blocked, Permanent
from supervisor.hw import gpu


@dataclass(frozen=True)
class VllmLook(Prerequisites):
    """What one look at vLLM adds: the KV-cache namespace its spec mounts, the labels of the
    tier image it runs on, the model's architectures and Sentence Transformers pooling as its
    files say (None: not readable yet), and while it runs the version, the tiers' note and the
    routes it states."""

    namespace: str | None = None
    tier_labels: Mapping[str, str] = field(default_factory=dict)
    version: str | None = None
    tiers_note: str = ""
    architectures: tuple[str, ...] | None = None
    pooling_config: bool = False
    routes: tuple[str, ...] | None = None  # its /openapi.json paths, while it runs


@dataclass(frozen=True)
class Preflight:
    """Read the GPU and decide the image and arguments (or refuse) before any pull."""

    @property
    def description(self) -> str:
        return "checking the GPU for vLLM (nvidia-smi)"


@dataclass(frozen=True)
class MemoryFit:
    """On a CPU, before the image is pulled: does run.memory fit this machine at all?"""

    need: int  # bytes: a recipe with another run.memory is checked again

    @property
    def description(self) -> str:
        return "checking that vLLM's run.memory fits this machine"


@dataclass(frozen=True)
class TierDirectories:
    """The namespace's directory under each disk tier, owner-only."""

    namespace: str

    @property
    def description(self) -> str:
        return f"creating the KV-cache tier directories for namespace {self.namespace[:12]}"


@dataclass(frozen=True)
class TierImage:
    """`<vllm image>-tiers`: the engine image with the KV tier plugin, built FROM the base."""

    tag: str

    @property
    def description(self) -> str:
        return "Adding the KV cache tiers to the vLLM image"


def refused(decision: pf.Launch | pf.PreflightRefusal) -> pf.Launch:
    # GPU memory another container holds may come free
    if isinstance(decision, pf.PreflightRefusal):
        busy = decision.code == pf.GPU_MEMORY_BUSY
        raise (Blocked if busy else Permanent)(str(decision))
    return decision


def reclaimable_mib(facts: gpu.GpuFacts | gpu.GpuUnavailable, share: int | None) -> int:
    """What an engine started with `share` percent holds on the smallest GPU: free once it
    is stopped. 0 when nothing is replaced."""
    if share is None or isinstance(facts, gpu.GpuUnavailable):
        return 0
    totals = [g.memory_total_mib for g in facts.gpus if g.memory_total_mib is not None]
    return min(totals) * share // 100 if totals else 0
