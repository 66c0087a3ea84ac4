"""The vllm engine's GPU boundary through its recipe's `nvidia_smi` (a script printing recorded
outputs), what a passing preflight decides, and what a replaced engine gives back."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Image
from supervisor.engines.base import Endpoint, StepContext
from supervisor.engines.loader import parse
from supervisor.engines.look import EngineImage
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm import tier_image
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.model import ModelDownload
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.steps import reclaimable_mib
from supervisor.errors import Permanent
from supervisor.hw import gpu
from supervisor.protocol import files
from tests.gpu_recordings import fake_nvidia_smi

CACHE_KEY = "c0ffee" + "0123456789abcdef" * 3 + "fedcba9876"  # 64 hex digits


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
        (
            "b200",
            {"channel": "nightly", "nightly_commit": "e68efc685ab1" + "0" * 28},
            "vllm/vllm-openai:nightly-e68efc685ab1" + "0" * 28,
        ),
        (
            "h100",
            {"channel": "nightly", "nightly_commit": "e68efc685ab1" + "0" * 28},
            pf.NIGHTLY_NEEDS_CUDA13,
        ),
        ("a100", {"quantization": "fp8"}, pf.FP8_UNSUPPORTED),
        ("l4", {"quantization": "fp8"}, "vllm/vllm-openai:v0.32.0-cu129"),
    ],
)
def test_what_the_preflight_decides_for_each_recorded_card(
    tmp_path: Path, card: str, choices: dict[str, str], expected: str
) -> None:
    found = engine(tmp_path, card, **choices)
    decision = pf.decide(found.choices, found.probe())
    shown = decision.code if isinstance(decision, pf.PreflightRefusal) else decision.image
    assert shown == expected


def test_a_host_without_nvidia_smi_is_refused_as_no_gpu(tmp_path: Path) -> None:
    found = engine(tmp_path, "h100")
    found.recipe = found.recipe.model_copy(
        update={"vllm": found.recipe.vllm.model_copy(update={"nvidia_smi": "/nonexistent"})}
    )
    decision = pf.decide(found.choices, found.probe())
    assert isinstance(decision, pf.PreflightRefusal) and decision.code == pf.NO_GPU


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
models_dir = "{tmp_path / "library"}"
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


# -- the model step, the namespace's parts and the secrets as files -----------------------------


class _Images(Runtime):
    """The runtime boundary, for what these cases ask: an image that is there (a tier image
    built for it under the `-tiers` tag), no container."""

    def image(self, ref: str) -> Image | None:
        base = "sha256:" + "1" * 64
        if ref.endswith(tier_image.SUFFIX):
            plugin = tier_image.read_plugin()
            return Image(id="sha256:" + "2" * 64, labels=tier_image.labels(plugin, base))
        return Image(id=base, labels={})

    def container(self, name: str) -> None:
        return None

    def run_streamed(self, *args: object, **kwargs: object) -> tuple[int, list[str]]:
        raise AssertionError("no container may run for this case")


def _hf_engine(tmp: Path, extra: str = "", secrets: str = "") -> Vllm:
    smi = fake_nvidia_smi(tmp / "gpu", "h100")
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
[tiers]
nvme = {{ path = "{tmp / "nvme"}", max_bytes = "1g" }}
[secrets]
LUCIA_KV_KEY = "{tmp / "kv.key"}"
{secrets}
[run]
port = 8000
volumes = [{{ source = "{tmp / "hf"}", target = "/var/cache/huggingface" }}]
"""
    )
    assert isinstance(parsed, VllmRecipe)
    (tmp / "kv.key").write_text(CACHE_KEY + "\n")
    found = Vllm("v", parsed, _Images(), tmp / "state")
    (tmp / "state").mkdir(exist_ok=True)
    found._preflight(StepContext(threading.Event(), lambda _line: None))
    return found


def _downloaded(tmp: Path, config: dict[str, object]) -> Path:
    """What the hf CLI leaves in the cache, in huggingface_hub's layout."""
    snapshot = (
        tmp
        / "hf"
        / "hub"
        / "models--org--model"
        / "snapshots"
        / "0123456789abcdef0123456789abcdef01234567"
    )
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def test_a_hugging_face_model_is_a_download_step_after_the_pull(tmp_path: Path) -> None:
    found = _hf_engine(tmp_path)
    (step,) = found.prerequisites().missing
    assert step == ModelDownload("org/model", "0123456789abcdef0123456789abcdef01234567")
    assert "downloading org/model at 0123456789ab" in step.description


def test_the_kv_layout_comes_from_the_models_config(tmp_path: Path) -> None:
    found = _hf_engine(tmp_path)
    _downloaded(
        tmp_path,
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 128,
            "head_dim": 32,
        },
    )
    layout = found.identity(_Images().image("x")).layout  # type: ignore[arg-type]
    assert (layout.layers, layout.kv_heads, layout.head_dim) == (2, 2, 32)


def test_the_library_models_config_gives_the_layout_with_the_defaults(tmp_path: Path) -> None:
    files = tmp_path / "library" / "guid-1" / "files"
    files.mkdir(parents=True)
    (files / "config.json").write_text(
        json.dumps({"num_hidden_layers": 36, "num_attention_heads": 32, "hidden_size": 4096})
    )
    parsed = parse(
        f"""
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
[vllm.model.library]
models_dir = "{tmp_path / "library"}"
guid = "guid-1"
[run]
port = 8000
"""
    )
    assert isinstance(parsed, VllmRecipe)
    found = Vllm("v", parsed, _Images(), tmp_path / "state")
    layout = found.identity(Image("sha256:" + "1" * 64, {})).layout
    assert (layout.layers, layout.kv_heads, layout.head_dim) == (36, 32, 128)


@pytest.mark.parametrize("change", ['quantization = "fp8"', 'args = ["--dtype", "float16"]'])
def test_the_quantization_and_the_extra_arguments_change_the_namespace(
    tmp_path: Path, change: str
) -> None:
    image = Image("sha256:" + "1" * 64, {})
    plain = _hf_engine(tmp_path / "a")
    changed = _hf_engine(tmp_path / "b", change)
    # the same key and model (the key's file differs only by path)
    assert plain.key_id() == changed.key_id()
    assert plain.namespace(image) != changed.namespace(image)


def test_the_token_and_the_key_are_files_in_the_run_spec(tmp_path: Path) -> None:
    token = tmp_path / "hf-token"
    token.write_text("hf_secret_value\n")
    found = _hf_engine(tmp_path, secrets=f'HF_TOKEN = "{token}"')
    _downloaded(tmp_path, {})
    files.write_atomic(found._model_stamp, json.dumps({"key": found.files.download_key()}).encode())
    image = _Images().image("x")
    assert image is not None
    # with tiers the engine runs the tier image the prerequisites name
    spec = found.run_spec(
        EngineImage(tier_image.tag("vllm/vllm-openai:v0.32.0-cu129"), image),
        Endpoint("172.17.0.1", 8000),
    )
    assert "HF_TOKEN" not in spec.environment and "LUCIA_KV_KEY" not in spec.environment
    assert spec.environment["HF_TOKEN_PATH"] == "/run/lucia-secrets/HF_TOKEN/value"
    assert spec.environment["LUCIA_KV_KEY_FILE"] == "/run/lucia-secrets/LUCIA_KV_KEY/value"
    assert spec.environment["HF_HUB_OFFLINE"] == "1"
    shown = repr(spec)
    assert "hf_secret_value" not in shown and CACHE_KEY not in shown
    secret_mounts = {m.target: m for m in spec.mounts if m.target.startswith("/run/lucia-secrets")}
    assert set(secret_mounts) == {"/run/lucia-secrets/HF_TOKEN", "/run/lucia-secrets/LUCIA_KV_KEY"}
    assert all(m.read_only for m in secret_mounts.values())
    found.check_more(spec, StepContext(threading.Event(), lambda _line: None))  # writes them
    for name, value in (("HF_TOKEN", "hf_secret_value"), ("LUCIA_KV_KEY", CACHE_KEY)):
        path = Path(secret_mounts[f"/run/lucia-secrets/{name}"].source) / "value"
        assert path.read_text().strip() == value
        assert stat.S_IMODE(path.stat().st_mode) == 0o400
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_download_no_volume_would_keep_is_refused_before_any_container(tmp_path: Path) -> None:
    found = _hf_engine(tmp_path)
    found.recipe = found.recipe.model_copy(
        update={"run": found.recipe.run.model_copy(update={"volumes": []})}
    )
    with pytest.raises(Permanent) as refused:  # _Images has no run_streamed: none was made
        found.make(
            ModelDownload("org/model", "0123456789abcdef0123456789abcdef01234567"),
            StepContext(threading.Event(), lambda _line: None),
        )
    assert "no writable [run] volume holds the Hugging Face cache" in str(refused.value)
    assert 'target = "/var/cache/huggingface"' in str(refused.value)


class _Recording(_Images):
    """The engine image is there; the download's container is recorded, and ends well."""

    def __init__(self, tmp: Path) -> None:
        self.ran: list[str] = []
        self.tmp = tmp

    def run_streamed(self, image_id: str, *args: object, **kwargs: object) -> tuple[int, list[str]]:
        self.ran.append(image_id)
        _downloaded(self.tmp, {"num_hidden_layers": 2})
        return 0, ["done"]


def test_a_hugging_face_model_is_downloaded_on_a_cpu_server_with_its_image(
    tmp_path: Path,
) -> None:
    """No preflight runs on a CPU: the download takes the recipe's CPU image all the same."""
    parsed = parse(
        f"""
name = "v"
engine = "vllm"
[vllm]
device = "cpu"
image = "lucia-vllm-cpu:test"
served_name = "m"
max_model_len = 1024
kv_cache_gib = 1
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
memory = "4g"
shm_size = "512m"
volumes = [{{ source = "{tmp_path / "hf"}", target = "/var/cache/huggingface" }}]
"""
    )
    assert isinstance(parsed, VllmRecipe)
    runtime = _Recording(tmp_path)
    found = Vllm("v", parsed, runtime, tmp_path / "state")
    (tmp_path / "state").mkdir()
    (step,) = found.prerequisites().missing
    assert isinstance(step, ModelDownload)
    found.make(step, StepContext(threading.Event(), lambda _line: None))
    assert runtime.ran == [runtime.image("lucia-vllm-cpu:test").id]


class _ProgressLast(_Images):
    """The hf CLI's stream as seen in CI: the path it prints, shortened, then a redraw of the
    progress bar on stderr."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def run_streamed(self, image_id: str, *args: object, **kwargs: object) -> tuple[int, list[str]]:
        _downloaded(self.tmp, {"num_hidden_layers": 2})
        progress = kwargs["progress"]
        assert callable(progress)
        for line in (
            "✓ Downloaded",
            "  path: /var/cache/huggingface/hub/models--...napshots/0123",
            "Fetching 5 files: 100%|██████████| 5/5 [00:00<00:00, 138.44it/s]",
        ):
            progress(line)
        return 0, ["done"]


def test_the_downloads_last_line_names_the_snapshot_whatever_order_the_cli_prints(
    tmp_path: Path,
) -> None:
    found = _hf_engine(tmp_path)
    found.runtime = _ProgressLast(tmp_path)
    (step,) = found.prerequisites().missing
    lines: list[str] = []
    found.make(step, StepContext(threading.Event(), lines.append))
    snapshot = tmp_path / "hf" / "hub" / "models--org--model" / "snapshots"
    assert lines[-1] == (
        f"downloaded org/model at 0123456789ab into {snapshot}"
        "/0123456789abcdef0123456789abcdef01234567"
    )
