"""vLLM's launch: one builder makes both command lines, exactly as the CPU and GPU builders did
before they were one (the tables pin their outputs), and the recipe's device is chosen once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from supervisor.docker import labels
from supervisor.docker.spec import Container, RunSpec
from supervisor.engines.base import StepContext
from supervisor.engines.vllm import cpu, tier_image
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm.device import CpuDevice, GpuDevice, choose
from supervisor.engines.vllm.engine import MEMORY_LABEL, Vllm
from supervisor.errors import Permanent
from supervisor.memplan import guard, settings
from tests.unit.test_vllm_cpu_device import NoDocker, cpu_recipe, parsed
from tests.unit.test_vllm_engine import engine as gpu_engine
from tests.unit.test_vllm_engine import recipe as gpu_recipe

REVISION = "0123456789abcdef0123456789abcdef01234567"
HOST = ("--host", "0.0.0.0", "--port")  # what the container is told: inside it, any address

CHOICES = {
    "plain": pf.Choices("stable", "none", 90, "Qwen/Qwen3-0.6B", "qwen", 4096),
    "revision": pf.Choices(
        "stable", "none", 50, "Qwen/Qwen3-0.6B", "qwen", 8192, revision="a" * 40
    ),
    "fp8, no prefix cache": pf.Choices(
        "nightly", "fp8", 35, "/models/m", "m", 2048, prefix_caching=False, nightly_commit="b" * 40
    ),
    "a path, a port, extras": pf.Choices(
        "stable",
        "none",
        95,
        "/models/x",
        "x",
        1024,
        port=8001,
        extra_args=("--enforce-eager", "--seed", "7"),
    ),
    "small share, fp8, extras": pf.Choices(
        "stable",
        "fp8",
        10,
        "org/m",
        "served",
        32768,
        revision="c" * 40,
        extra_args=("--dtype", "bfloat16"),
    ),
}

# what the GPU builder (preflight.arguments) and the CPU builder (cpu.arguments) made for each
GPU_BEFORE = {
    "plain": (
        "Qwen/Qwen3-0.6B",
        "--served-model-name",
        "qwen",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.90",
        *HOST,
        "8000",
        "--enable-prefix-caching",
    ),
    "revision": (
        "Qwen/Qwen3-0.6B",
        "--revision",
        "a" * 40,
        "--served-model-name",
        "qwen",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.50",
        *HOST,
        "8000",
        "--enable-prefix-caching",
    ),
    "fp8, no prefix cache": (
        "/models/m",
        "--served-model-name",
        "m",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.35",
        *HOST,
        "8000",
        "--quantization",
        "fp8",
        "--no-enable-prefix-caching",
    ),
    "a path, a port, extras": (
        "/models/x",
        "--served-model-name",
        "x",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.95",
        *HOST,
        "8001",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--seed",
        "7",
    ),
    "small share, fp8, extras": (
        "org/m",
        "--revision",
        "c" * 40,
        "--served-model-name",
        "served",
        "--max-model-len",
        "32768",
        "--gpu-memory-utilization",
        "0.10",
        *HOST,
        "8000",
        "--quantization",
        "fp8",
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
    ),
}
CPU_BEFORE = {
    "plain": (
        "--model",
        "Qwen/Qwen3-0.6B",
        "--served-model-name",
        "qwen",
        "--max-model-len",
        "4096",
        *HOST,
        "8000",
        "--enable-prefix-caching",
    ),
    "revision": (
        "--model",
        "Qwen/Qwen3-0.6B",
        "--revision",
        "a" * 40,
        "--served-model-name",
        "qwen",
        "--max-model-len",
        "8192",
        *HOST,
        "8000",
        "--enable-prefix-caching",
    ),
    "fp8, no prefix cache": (
        "--model",
        "/models/m",
        "--served-model-name",
        "m",
        "--max-model-len",
        "2048",
        *HOST,
        "8000",
        "--no-enable-prefix-caching",
    ),
    "a path, a port, extras": (
        "--model",
        "/models/x",
        "--served-model-name",
        "x",
        "--max-model-len",
        "1024",
        *HOST,
        "8001",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--seed",
        "7",
    ),
    "small share, fp8, extras": (
        "--model",
        "org/m",
        "--revision",
        "c" * 40,
        "--served-model-name",
        "served",
        "--max-model-len",
        "32768",
        *HOST,
        "8000",
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
    ),
}
# aligned tables read better than the formatter's one item a line


@pytest.mark.parametrize("case", sorted(CHOICES))
def test_the_one_builder_makes_the_gpu_command_line_as_before(case: str) -> None:
    assert pf.arguments(CHOICES[case]) == GPU_BEFORE[case]
    assert pf.arguments(CHOICES[case], "gpu") == GPU_BEFORE[case]


@pytest.mark.parametrize("case", sorted(CHOICES))
def test_the_one_builder_makes_the_cpu_command_line_as_before(case: str) -> None:
    assert pf.arguments(CHOICES[case], "cpu") == CPU_BEFORE[case]
    assert cpu.launch(CHOICES[case], "reg.example/cpu:1") == pf.Launch(
        "reg.example/cpu:1", CPU_BEFORE[case]
    )


@pytest.mark.parametrize(
    ("card", "vllm", "image", "share", "fp8"),
    [
        ("h100", {}, "vllm/vllm-openai:v0.32.0-cu129", "0.90", False),
        ("b200", {"quantization": "fp8", "memory": "35"}, "vllm/vllm-openai:v0.32.0", "0.35", True),
        ("l4", {}, "vllm/vllm-openai:v0.32.0-cu129", "0.90", False),
    ],
)
def test_a_gpu_engine_runs_its_preflights_launch_as_before(
    tmp_path: Path, card: str, vllm: dict[str, str], image: str, share: str, fp8: bool
) -> None:
    found = gpu_engine(tmp_path, card, **vllm)
    assert found.command() == ()  # no preflight has passed: nothing runs yet
    (tmp_path / "state").mkdir()
    found._preflight(StepContext(threading.Event(), lambda _line: None))
    before = (
        "org/model",
        "--revision",
        REVISION,
        "--served-model-name",
        "m",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        share,
        *HOST,
        "8000",
        *(("--quantization", "fp8") if fp8 else ()),
        "--enable-prefix-caching",
    )
    assert found._launch() == pf.Launch(image, before)
    assert found.command() == before


def test_a_cpu_engine_runs_the_recipes_image_with_the_cpu_command_line_as_before(
    tmp_path: Path,
) -> None:
    text = cpu_recipe(tmp_path, 'image = "reg.example/vllm-cpu:1"\nargs = ["--dtype", "bfloat16"]')
    found = Vllm("c", parsed(text), NoDocker(), tmp_path / "state")
    before = (
        "--model",
        "/models/g1",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
        *HOST,
        "8000",
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
    )
    assert found._launch() == pf.Launch("reg.example/vllm-cpu:1", before)
    assert found.command() == before


@pytest.mark.parametrize(
    ("device", "kind", "site", "environment"),
    [
        ("cpu", CpuDevice, tier_image.SITE_PACKAGES, {cpu.KV_CACHE_ENV: "4"}),
        ("gpu", GpuDevice, tier_image.GPU_SITE_PACKAGES, {}),
    ],
)
def test_the_recipes_device_is_chosen_once_with_its_differences(
    tmp_path: Path, device: str, kind: type, site: str, environment: dict[str, str]
) -> None:
    recipe = parsed(cpu_recipe(tmp_path)) if device == "cpu" else gpu_recipe(tmp_path, "h100")
    chosen = choose(recipe)
    assert type(chosen) is kind
    assert chosen.choices == recipe.preflight_choices()
    assert chosen.site_packages == site
    assert dict(chosen.environment) == environment
    made = Vllm("v", recipe, NoDocker(), tmp_path / "state", tmp_path / "data")
    assert made.device == chosen
    assert made.guard is not None and made.guard.measure == made.device.measure  # given, once


def test_only_a_cpu_checks_run_memory_before_a_pull_and_plans_it_unplanned_too(
    tmp_path: Path,
) -> None:
    on_cpu = choose(parsed(cpu_recipe(tmp_path)))
    assert on_cpu.fit_before_pull(planned=True) == 6 * 1024**3
    assert on_cpu.fit_before_pull(planned=False) is None
    assert on_cpu.need(planned=False) is not None
    on_gpu = choose(gpu_recipe(tmp_path, "h100"))
    assert on_gpu.fit_before_pull(planned=True) is None
    assert on_gpu.need(planned=False) is None


def test_a_cpu_reads_nothing_again_before_a_start(tmp_path: Path) -> None:
    asked: list[str] = []
    lines: list[str] = []

    def share() -> int | None:
        asked.append("share")
        return None

    on_cpu = choose(parsed(cpu_recipe(tmp_path)))
    assert on_cpu.recheck(StepContext(threading.Event(), lines.append), share) is None
    assert asked == [] and lines == []


def test_a_gpu_reads_the_card_and_the_replaced_share_again_before_a_start(tmp_path: Path) -> None:
    lines: list[str] = []
    on_gpu = choose(gpu_recipe(tmp_path, "h100"))
    launch = on_gpu.recheck(StepContext(threading.Event(), lines.append), lambda: 90)
    assert launch == pf.Launch("vllm/vllm-openai:v0.32.0-cu129", pf.arguments(on_gpu.choices))
    assert lines == ["checking the GPU again before the start"]


def test_a_gpu_measures_through_the_recipes_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(
        guard.probe, "nvidia_smi_query", lambda nvidia_smi: seen.append(nvidia_smi) or ""
    )
    monkeypatch.setattr(guard.probe, "measure", lambda machine, gpu: gpu())
    recipe = gpu_recipe(tmp_path, "h100")
    choose(recipe).measure(settings.defaults())
    assert seen == [recipe.vllm.nvidia_smi]


class Replaced(NoDocker):
    """A running engine of this name, started with a memory share of 70."""

    def container(self, name: str) -> Container:
        marks = {labels.MANAGED: "true", MEMORY_LABEL: "70"}
        return Container("c1", name, "sha256:" + "a" * 64, "running", 0, False, "", marks, ())


def test_the_engine_passes_the_replaced_share_to_the_gpus_recheck(tmp_path: Path) -> None:
    found = Vllm("v", gpu_recipe(tmp_path, "h100"), Replaced(), tmp_path / "state")
    assert found._replaced_share() == 70
    spec = RunSpec(found.container_name, "x", "lucia", "172.17.0.1", 8123, 8000)
    with pytest.raises(Permanent, match="the GPU changed since the preflight"):
        found.check_more(spec, StepContext(threading.Event(), lambda _line: None))
