"""The vllm engine's GPU boundary through its recipe's `nvidia_smi` (a script printing recorded
outputs), what a passing preflight decides, and what a replaced engine gives back."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.docker.runtime import Runtime
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm.engine import Vllm, reclaimable_mib
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.hw import gpu
from supervisor.recipe.loader import parse
from tests.gpu_recordings import fake_nvidia_smi


def recipe(tmp: Path, card: str, **vllm: str) -> VllmRecipe:
    smi = fake_nvidia_smi(tmp, card)
    extra = "\n".join(f'{key} = "{value}"' for key, value in vllm.items())
    parsed = parse(
        f"""
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
nvidia_smi = "{smi}"
{extra}
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
"""
    )
    assert isinstance(parsed, VllmRecipe)
    return parsed


def engine(tmp: Path, card: str, **vllm: str) -> Vllm:
    return Vllm("v", recipe(tmp, card, **vllm), Runtime(), tmp / "state")


@pytest.mark.parametrize(
    ("card", "gpus", "capability", "cuda", "free"),
    [
        ("h100", 2, (9, 0), gpu.CudaVersion(12, 8), 81559),
        ("a100", 2, (8, 0), gpu.CudaVersion(13, 0), 40960 - 598),
        ("b200", 2, (10, 0), gpu.CudaVersion(13, 3), 183359),
        ("l4", 1, (8, 9), gpu.CudaVersion(12, 8), None),
    ],
)
def test_the_engine_reads_the_recorded_card_through_its_nvidia_smi(
    tmp_path: Path,
    card: str,
    gpus: int,
    capability: tuple[int, int],
    cuda: gpu.CudaVersion,
    free: int | None,
) -> None:
    facts = engine(tmp_path, card).probe()
    assert isinstance(facts, gpu.GpuFacts), facts
    assert len(facts.gpus) == gpus and facts.cuda == cuda
    assert facts.gpus[0].compute_capability == capability
    if free is not None:
        assert facts.gpus[0].memory_free_mib == free


@pytest.mark.parametrize(
    ("card", "choices", "expected"),
    [
        ("h100", {}, "vllm/vllm-openai:v0.32.0-cu129"),
        ("b200", {}, "vllm/vllm-openai:v0.32.0"),
        ("h100", {"repository": "mirror.local/vllm"}, "mirror.local/vllm:v0.32.0-cu129"),
        ("b200", {"channel": "nightly", "nightly_commit": "e68efc685ab1" + "0" * 28},
         "vllm/vllm-openai:nightly-e68efc685ab1" + "0" * 28),
        ("h100", {"channel": "nightly", "nightly_commit": "e68efc685ab1" + "0" * 28},
         pf.NIGHTLY_NEEDS_CUDA13),
        ("a100", {"quantization": "fp8"}, pf.FP8_UNSUPPORTED),
        ("l4", {"quantization": "fp8"}, "vllm/vllm-openai:v0.32.0-cu129"),
    ],
)
def test_what_the_preflight_decides_for_each_recorded_card(
    tmp_path: Path, card: str, choices: dict[str, str], expected: str
) -> None:
    found = engine(tmp_path, card, **choices)
    decision = pf.decide(found.choices, found.probe())
    shown = decision.code if isinstance(decision, pf.Refusal) else decision.image
    assert shown == expected


def test_a_host_without_nvidia_smi_is_refused_as_no_gpu(tmp_path: Path) -> None:
    found = engine(tmp_path, "h100")
    found.recipe = found.recipe.model_copy(
        update={"vllm": found.recipe.vllm.model_copy(update={"nvidia_smi": "/nonexistent"})}
    )
    decision = pf.decide(found.choices, found.probe())
    assert isinstance(decision, pf.Refusal) and decision.code == pf.NO_GPU


def test_the_replaced_engines_share_of_the_smallest_gpu_counts_as_free(tmp_path: Path) -> None:
    facts = engine(tmp_path, "a100").probe()
    assert reclaimable_mib(facts, 90) == 40960 * 90 // 100
    assert reclaimable_mib(facts, None) == 0
    assert reclaimable_mib(gpu.GpuUnavailable("absent", "none"), 90) == 0


def test_a_library_model_is_mounted_read_only_and_its_files_name_the_manifest(
    tmp_path: Path,
) -> None:
    files = tmp_path / "library" / "guid-1" / "files"
    files.mkdir(parents=True)
    (files / "config.json").write_text("{}")
    parsed = parse(
        f"""
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
[vllm.model.library]
models_dir = "{tmp_path / 'library'}"
guid = "guid-1"
[run]
port = 8000
"""
    )
    assert isinstance(parsed, VllmRecipe)
    found = Vllm("v", parsed, Runtime(), tmp_path / "state")
    (mount,) = found.mounts()
    assert (mount.source, mount.target, mount.read_only) == (str(files), "/models/guid-1", True)
    assert found.choices.model == "/models/guid-1" and found.choices.revision is None
    before = found.model_manifest()
    revision = found.extra_labels()["lucia.model.revision"]
    (files / "model.safetensors").write_bytes(b"weights")
    assert found.model_manifest() != before
    assert found.extra_labels()["lucia.model.revision"] != revision
