"""vLLM's preflight as decision tables: every channel x quantization x card x CUDA combination."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from supervisor.engines.vllm import preflight as pf
from supervisor.hw.gpu import CudaVersion, Gpu, GpuFacts, GpuUnavailable

COMMIT = "e68efc685ab1" + "0" * 28  # shape of the full pin; the real one comes from the recipe

# compute capabilities: huggingface/huggingface.js PR #2010 (see tests/data/nvidia-smi/README.md)
CARDS = {
    "H100": ("NVIDIA H100 80GB HBM3", (9, 0), 81559),
    "A100": ("NVIDIA A100-SXM4-40GB", (8, 0), 40960),
    "L4": ("NVIDIA L4", (8, 9), 23034),
    "GB10": ("NVIDIA GB10", (12, 1), None),
}
CUDAS = {
    "12.8": CudaVersion(12, 8),
    "13.0": CudaVersion(13, 0),
    "11.4": CudaVersion(11, 4),
    "none": None,
}


def facts(card: str, cuda: str, count: int = 1, free: int | None = None) -> GpuFacts:
    name, capability, total = CARDS[card]
    gpus = tuple(
        Gpu(i, name, capability, total, total if free is None else free, "580.95.05")
        for i in range(count)
    )
    return GpuFacts(gpus, CUDAS[cuda])


def choices(
    channel: pf.Channel = "stable", quantization: pf.Quantization = "none", **kw: object
) -> pf.Choices:
    base = pf.Choices(
        channel=channel,
        quantization=quantization,
        memory_share=90,
        model="Qwen/Qwen3-8B",
        revision="a" * 40,
        served_name="qwen3-8b",
        max_model_len=32768,
        nightly_commit=COMMIT,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def expected(channel: str, quantization: str, card: str, cuda: str) -> str:
    """The guide's rules, written independently of the module: image code or refusal code."""
    version = CUDAS[cuda]
    if channel == "nightly":
        if version is None or version.major < 13:
            return "vllm_nightly_needs_cuda13"
        image = f"vllm/vllm-openai:nightly-{COMMIT}"
    elif version is None or version.major < 12:
        return "vllm_cuda_unsupported"
    else:
        image = "vllm/vllm-openai:v0.32.0" + ("-cu129" if version.major == 12 else "")
    if quantization == "fp8" and CARDS[card][1] < (8, 9):
        return "vllm_fp8_unsupported"
    return image


COMBINATIONS = list(itertools.product(("stable", "nightly"), ("none", "fp8"), CARDS, CUDAS))


@pytest.mark.parametrize(
    ("channel", "quantization", "card", "cuda"),
    COMBINATIONS,
    ids=["-".join(c) for c in COMBINATIONS],
)
def test_every_combination(
    channel: pf.Channel, quantization: pf.Quantization, card: str, cuda: str
) -> None:
    result = pf.decide(choices(channel, quantization), facts(card, cuda))
    want = expected(channel, quantization, card, cuda)
    if isinstance(result, pf.PreflightRefusal):
        assert result.code == want, result
        assert "\n" not in result.message
    else:
        assert result.image == want
        assert ("--quantization" in result.args) is (quantization == "fp8")


@pytest.mark.parametrize(
    ("code", "result", "text"),
    [
        (
            "vllm_nightly_needs_cuda13",
            pf.decide(choices("nightly"), facts("H100", "12.8")),
            "nightly on a host without CUDA 13 (the driver supports CUDA 12.8). Use stable, or "
            "move the model to a CUDA 13 host.",
        ),
        (
            "vllm_fp8_unsupported",
            pf.decide(choices("stable", "fp8"), facts("A100", "13.0", 2)),
            "fp8 on a GPU below 8.9 (GPU 0 NVIDIA A100-SXM4-40GB is 8.0, GPU 1 NVIDIA "
            "A100-SXM4-40GB is 8.0). Use none.",
        ),
    ],
)
def test_the_guides_refusals_name_the_code_and_the_fix(
    code: str, result: object, text: str
) -> None:
    assert isinstance(result, pf.PreflightRefusal)
    assert result.code == code
    assert result.message == text
    assert str(result) == f"{code}: {text}"


def test_fp8_on_a_mixed_host_is_refused_for_the_older_card() -> None:
    mixed = GpuFacts(
        (
            Gpu(0, "NVIDIA L4", (8, 9), 23034, 23034, None),
            Gpu(1, "NVIDIA A100-SXM4-40GB", (8, 0), 40960, 40960, None),
        ),
        CudaVersion(13, 0),
    )
    result = pf.decide(choices(quantization="fp8"), mixed)
    assert isinstance(result, pf.PreflightRefusal) and "GPU 1" in result.message
    assert "GPU 0" not in result.message


def test_no_gpu_is_a_refusal_with_the_probes_reason() -> None:
    result = pf.decide(
        choices(),
        GpuUnavailable("absent", "no NVIDIA GPU/driver: nvidia-smi is not installed on this host"),
    )
    assert isinstance(result, pf.PreflightRefusal) and result.code == "vllm_no_gpu"
    assert result.message.startswith("no NVIDIA GPU/driver")


def test_a_nightly_without_its_full_commit_is_refused() -> None:
    result = pf.decide(choices("nightly", nightly_commit=None), facts("GB10", "13.0"))
    assert isinstance(result, pf.PreflightRefusal) and result.code == "vllm_nightly_unpinned"


@pytest.mark.parametrize(
    ("share", "quantization", "revision", "prefix", "tail"),
    [
        (90, "none", "a" * 40, True, ["--enable-prefix-caching"]),
        (10, "fp8", "a" * 40, True, ["--quantization", "fp8", "--enable-prefix-caching"]),
        (95, "none", None, False, ["--no-enable-prefix-caching"]),
    ],
)
def test_arguments(
    share: int, quantization: pf.Quantization, revision: str | None, prefix: bool, tail: list[str]
) -> None:
    result = pf.decide(
        choices(
            quantization=quantization, memory_share=share, revision=revision, prefix_caching=prefix
        ),
        facts("H100", "13.0"),
    )
    assert isinstance(result, pf.Launch)
    head = ["Qwen/Qwen3-8B", *(["--revision", revision] if revision else [])]
    assert list(result.args) == [
        *head,
        "--served-model-name",
        "qwen3-8b",
        "--max-model-len",
        "32768",
        "--gpu-memory-utilization",
        f"0.{share:02d}" if share < 100 else "1.00",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        *tail,
    ]


@pytest.mark.parametrize(
    ("free", "reclaimable", "refused"),
    [
        (81559, 0, False),
        (81559 * 90 // 100, 0, False),
        (81559 * 90 // 100 - 1, 0, True),  # one MiB short: vLLM's own start-up check would fail
        (1000, 80000, False),  # the engine this start replaces holds the rest
        (1000, None, False),  # no reclaimable figure: the memory plan decides, not the preflight
    ],
)
def test_free_gpu_memory(free: int, reclaimable: int | None, refused: bool) -> None:
    result = pf.decide(choices(), facts("H100", "13.0", free=free), reclaimable)
    assert isinstance(result, pf.PreflightRefusal) is refused
    if isinstance(result, pf.PreflightRefusal):
        assert result.code == "vllm_gpu_memory_busy" and "GPU 0 has" in result.message


def test_unified_memory_is_not_checked_here() -> None:
    assert pf.decide(choices(), facts("GB10", "13.0"), 0) == pf.Launch(
        "vllm/vllm-openai:v0.32.0", pf.arguments(choices())
    )
