"""The KV tier plugin wired into the vllm engine: the tier image as a prerequisite after the base
image (built from a fresh context, rebuilt for another base or plugin version), the connector in
the command, the plugin's version and the device's block size in the namespace."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.docker import labels
from supervisor.docker.runtime import Progress, Runtime
from supervisor.docker.spec import BuildRequest, Container, Image, RunSpec
from supervisor.engines.base import Endpoint, StepContext
from supervisor.engines.loader import parse
from supervisor.engines.look import EngineImage, Look, PulledImage
from supervisor.engines.vllm import tier_image
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.steps import TierDirectories, TierImage
from supervisor.errors import BuildFailed, Permanent
from supervisor.recipe.schema import RecipeError

BASE = "lucia-vllm-cpu:0.32.0-torch2.13.0"
BASE_ID = "sha256:" + "b" * 64
KEY = "5ab1e" + "0123456789abcdef" * 3 + "c0ffeeabcde"  # 64 hex digits


def recipe_text(tmp: Path, tiers: str | None = None, extra: str = "") -> str:
    if tiers is None:
        tiers = f"""
[tiers]
nvme = {{ path = "{tmp / "nvme"}", max_bytes = "64m" }}
hdd = {{ path = "{tmp / "hdd"}", max_bytes = "256m" }}
{extra}
[secrets]
LUCIA_KV_KEY = "{tmp / "kv.key"}"
"""
    return f"""
name = "c"
engine = "vllm"
model = "tiny"
[vllm]
device = "cpu"
image = "{BASE}"
served_name = "tiny"
max_model_len = 1024
[vllm.model.library]
models_dir = "{tmp / "library"}"
guid = "g1"
{tiers}
[run]
port = 8000
shm_size = "512m"
memory = "6g"
"""


def parsed(text: str) -> VllmRecipe:
    found = parse(text)
    assert isinstance(found, VllmRecipe)
    return found


class Images(Runtime):
    """The runtime boundary: images by reference, builds recorded (with the context they were
    given, read while it exists), nothing running."""

    def __init__(self, images: dict[str, Image] | None = None, fail: bool = False) -> None:
        super().__init__()
        self.images = dict(images or {})
        self.fail = fail
        self.builds: list[tuple[BuildRequest, str, list[str]]] = []

    def image(self, ref: str) -> Image | None:
        return self.images.get(ref)

    def container(self, name: str) -> None:
        return None

    def containers(self, label: str | list[str], running: bool = True) -> list[Container]:
        return []

    def build(self, request: BuildRequest, progress: Progress, cancel: threading.Event) -> Image:
        assert request.context is not None
        context = Path(request.context)
        dockerfile = (context / "Dockerfile").read_text()
        self.builds.append(
            (
                request,
                dockerfile,
                sorted(str(p.relative_to(context)) for p in context.rglob("*") if p.is_file()),
            )
        )
        progress("Step 1/3 : FROM " + dockerfile.split()[1])
        if self.fail:
            raise BuildFailed(
                f"build of {request.tag}", ["ModuleNotFoundError: No module named 'vllm'"]
            )
        image = Image("sha256:" + "7" * 64, dict(request.labels))
        self.images[request.tag] = image
        return image


def engine(tmp: Path, runtime: Runtime, text: str | None = None, key: str = KEY) -> Vllm:
    (tmp / "library" / "g1" / "files").mkdir(parents=True, exist_ok=True)
    (tmp / "kv.key").write_text(key + "\n")
    (tmp / "kv.key").chmod(0o600)
    found = Vllm("c", parsed(text or recipe_text(tmp)), runtime, tmp / "state")
    return found


def ctx(lines: list[str] | None = None) -> StepContext:
    return StepContext(threading.Event(), (lines if lines is not None else []).append)


def base_images() -> dict[str, Image]:
    return {BASE: Image(BASE_ID, {})}


def test_the_tier_image_comes_after_the_base_image_then_the_tier_directories(
    tmp_path: Path,
) -> None:
    runtime = Images()
    found = engine(tmp_path, runtime)
    assert found.prerequisites().missing == (PulledImage(BASE),)  # no tier image before it
    runtime.images.update(base_images())
    (step,) = found.prerequisites().missing
    assert step == TierImage(f"{BASE}-tiers")
    assert step.description == tier_image.MESSAGE
    found.make(step, ctx())
    (step,) = found.prerequisites().missing
    assert isinstance(step, TierDirectories)
    found.make(step, ctx())
    ready = found.prerequisites()
    assert ready.missing == ()
    assert ready.image == EngineImage(f"{BASE}-tiers", runtime.images[f"{BASE}-tiers"])
    assert len(runtime.builds) == 1


@pytest.mark.parametrize(
    "key",
    [
        "0123456789abcdef0123456789abcdef",  # 32 hex digits: a uuid4, 16 bytes
        "a passphrase an operator made up, long enough",
        "g" + "0" * 63,  # 64 characters, one not hex
        KEY + "00",
    ],
)
def test_a_key_the_plugin_would_refuse_stops_the_engine_before_its_start(
    tmp_path: Path, key: str
) -> None:
    found = engine(tmp_path, Images(base_images()), key=key)
    with pytest.raises(Permanent) as refused:
        found.prerequisites()
    assert str(refused.value) == (
        "secret LUCIA_KV_KEY: the cache key must be exactly 64 hex digits "
        "(32 random bytes: openssl rand -hex 32)"
    )


def test_a_recipe_without_tiers_builds_nothing_and_runs_the_base_image(tmp_path: Path) -> None:
    runtime = Images(base_images())
    found = engine(tmp_path, runtime, recipe_text(tmp_path, tiers=""))
    ready = found.prerequisites()
    assert ready.missing == () and ready.image == EngineImage(BASE, runtime.images[BASE])
    assert "--kv-transfer-config" not in found.command()
    assert runtime.builds == []
    spec = found.run_spec(ready.image, Endpoint("172.17.0.1", 8123))
    assert spec.image == BASE_ID


def test_the_build_runs_from_a_fresh_context_under_the_state_dir_and_removes_it(
    tmp_path: Path,
) -> None:
    runtime = Images(base_images())
    found = engine(tmp_path, runtime)
    lines: list[str] = []
    found.make(TierImage(f"{BASE}-tiers"), ctx(lines))
    ((request, dockerfile, context_files),) = runtime.builds
    plugin = tier_image.read_plugin()
    assert request.tag == f"{BASE}-tiers"
    assert request.labels == tier_image.labels(plugin, BASE_ID)
    assert Path(request.context or "").parent == tmp_path / "state" / "tier-build"
    assert dockerfile.startswith(f"FROM {BASE_ID}\n")
    assert "site-packages/lucia_kv/connector.py" in context_files
    assert f"site-packages/{plugin.dist_info}/METADATA" in context_files
    assert list((tmp_path / "state" / "tier-build").iterdir()) == []  # removed after
    assert lines[0] == tier_image.MESSAGE
    assert lines[1] == f"{tier_image.MESSAGE}: Step 1/3 : FROM {BASE_ID}"  # the heartbeat's


@pytest.mark.parametrize("stale", ["another base", "another plugin version", "no labels"])
def test_a_tier_image_of_another_base_or_plugin_version_is_rebuilt(
    tmp_path: Path, stale: str
) -> None:
    plugin = tier_image.read_plugin()
    old = {
        "another base": tier_image.labels(plugin, "sha256:" + "c" * 64),
        "another plugin version": tier_image.labels(replace(plugin, version="0.0.9"), BASE_ID),
        "no labels": {},
    }[stale]
    runtime = Images({**base_images(), f"{BASE}-tiers": Image("sha256:" + "d" * 64, old)})
    found = engine(tmp_path, runtime)
    assert found.prerequisites().missing == (TierImage(f"{BASE}-tiers"),)
    found.make(TierImage(f"{BASE}-tiers"), ctx())
    assert runtime.images[f"{BASE}-tiers"].labels == tier_image.labels(plugin, BASE_ID)


def test_a_current_tier_image_is_not_built_again(tmp_path: Path) -> None:
    plugin = tier_image.read_plugin()
    current = Image("sha256:" + "e" * 64, tier_image.labels(plugin, BASE_ID))
    runtime = Images({**base_images(), f"{BASE}-tiers": current})
    found = engine(tmp_path, runtime)
    (step,) = found.prerequisites().missing
    assert isinstance(step, TierDirectories)
    assert runtime.builds == []


def test_a_plugin_changed_on_disk_is_what_the_next_build_installs_and_then_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade writes the plugin's new files under a running worker: the worker goes on
    with the image it has until a build is due (here a new base image), that build installs
    the files as they are now, and the next observation finds its image current."""
    source = tmp_path / "kvplugin"
    shutil.copytree(
        tier_image.SOURCE,
        source,
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
    )
    read = tier_image.read_plugin
    monkeypatch.setattr(tier_image, "read_plugin", lambda: read(source))  # the installed copy
    runtime = Images(base_images())
    found = engine(tmp_path, runtime)
    found.make(TierImage(f"{BASE}-tiers"), ctx())
    assert not any(isinstance(step, TierImage) for step in found.prerequisites().missing)
    first = runtime.images[f"{BASE}-tiers"].labels[labels.TIERS_DIGEST]
    assert noted(found) == f"KV-cache tier plugin lucia-kv-tiers 0.1.0 (files {first[:19]})"
    pyproject = source / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.1.1"'))
    with (source / "lucia_kv" / "connector.py").open("a") as connector:
        connector.write("# upgraded\n")
    assert not any(isinstance(step, TierImage) for step in found.prerequisites().missing)
    runtime.images[BASE] = Image("sha256:" + "c" * 64, {})  # a pull brought a new base
    assert found.prerequisites().missing == (TierImage(f"{BASE}-tiers"),)
    found.make(TierImage(f"{BASE}-tiers"), ctx())
    built = runtime.builds[-1][0].labels
    assert built[labels.TIERS_VERSION] == "0.1.1" and built[labels.TIERS_DIGEST] != first
    for _ in range(3):  # the observations after that build: no other build is asked for
        assert not any(isinstance(step, TierImage) for step in found.prerequisites().missing)
    assert len(runtime.builds) == 2
    assert found.identity(Image(BASE_ID, {})).plugin_version == "0.1.1"
    assert noted(found) == (
        f"KV-cache tier plugin lucia-kv-tiers 0.1.1 (files {built[labels.TIERS_DIGEST][:19]})"
    )


def noted(found: Vllm) -> str:
    """The status note of one look at the engine (its prerequisites: no container runs)."""
    return found.notes(Look(None, None, (), None, found.prerequisites()))


def test_without_tiers_the_status_names_no_plugin(tmp_path: Path) -> None:
    found = engine(tmp_path, Images(base_images()), recipe_text(tmp_path, tiers=""))
    assert found.prerequisites().missing == () and noted(found) == ""


def test_a_failed_build_names_the_next_step_and_leaves_no_context(tmp_path: Path) -> None:
    runtime = Images(base_images(), fail=True)
    found = engine(tmp_path, runtime)
    with pytest.raises(BuildFailed) as failed:
        found.make(TierImage(f"{BASE}-tiers"), ctx())
    message = str(failed.value)
    assert message.startswith(f"adding the KV cache tiers to {BASE} ({BASE}-tiers) failed: ")
    assert "No module named 'vllm'" in message
    assert "the running engine, if any, was left alone" in message
    assert "remove [tiers]" in message
    assert list((tmp_path / "state" / "tier-build").iterdir()) == []
    assert found.prerequisites().missing == (TierImage(f"{BASE}-tiers"),)  # tried again


def test_the_command_selects_the_connector_and_holds_no_key(tmp_path: Path) -> None:
    found = engine(tmp_path, Images(base_images()))
    command = found.command()
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LuciaTierConnector"
    assert config["kv_connector_module_path"] == "lucia_kv.connector"
    assert (config["kv_role"], config["kv_load_failure_policy"]) == ("kv_both", "recompute")
    assert KEY not in " ".join(command)
    assert "--block-size" not in command  # the CPU default, 128


def built_spec(found: Vllm) -> RunSpec:
    """The engine's run spec once its prerequisites (the tier image) are made."""
    for _ in range(3):
        for step in found.prerequisites().missing:
            found.make(step, ctx())
    ready = found.prerequisites()
    assert ready.image is not None
    return found.run_spec(ready.image, Endpoint("172.17.0.1", 8123))


def test_the_run_spec_gives_the_tiers_in_the_environment_and_the_key_as_a_file(
    tmp_path: Path,
) -> None:
    runtime = Images(base_images())
    found = engine(tmp_path, runtime)
    spec = built_spec(found)
    env = spec.environment
    assert env["LUCIA_KV_KEY_FILE"] == "/run/lucia-secrets/LUCIA_KV_KEY/value"
    assert (env["LUCIA_KV_NVME_DIR"], env["LUCIA_KV_HDD_DIR"]) == ("/kv/nvme", "/kv/hdd")
    assert env["LUCIA_KV_NAMESPACE"] == spec.labels["lucia.vllm.kv-namespace"]
    assert spec.labels[labels.IMAGE_REF] == f"{BASE}-tiers"
    assert spec.image == runtime.images[f"{BASE}-tiers"].id
    assert KEY not in repr(spec)


@pytest.mark.parametrize(
    ("extra", "buffers"),
    [("", 512 * 1024**2), ('buffer_bytes = "1g"\nqueue_bytes = "64m"', (1024 + 64) * 1024**2)],
)
def test_the_containers_memory_limit_holds_the_plugins_buffers_it_is_given(
    tmp_path: Path, extra: str, buffers: int
) -> None:
    """Docker's limit is run.memory (6g) plus the staging buffer and write queue the plugin is
    told to hold; without tiers it is run.memory alone."""
    runtime = Images(base_images())
    found = engine(tmp_path, runtime, recipe_text(tmp_path, extra=extra))
    spec = built_spec(found)
    assert spec.memory == f"{6 * 1024**3 + buffers}b"
    env = spec.environment
    given = int(env["LUCIA_KV_BUFFER_BYTES"]) + int(env["LUCIA_KV_QUEUE_BYTES"])
    assert given == buffers
    need = found.memory_need()
    assert need is not None and need.need == 6 * 1024**3 + buffers
    plain = engine(tmp_path / "plain", Images(base_images()), recipe_text(tmp_path / "plain", ""))
    image = plain.prerequisites().image
    assert image is not None
    bare = plain.run_spec(image, Endpoint("172.17.0.1", 8123))
    assert bare.memory == f"{6 * 1024**3}b" and "LUCIA_KV_QUEUE_BYTES" not in bare.environment


def test_the_namespace_names_the_plugins_version_and_the_base_not_the_tier_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = engine(tmp_path, Images(base_images()))
    base = Image(BASE_ID, {})
    plugin = tier_image.read_plugin()
    identity = found.identity(base)
    assert identity.plugin_version == plugin.version == "0.1.0"  # kvplugin/pyproject.toml
    tiered = Image("sha256:" + "7" * 64, tier_image.labels(plugin, BASE_ID))
    assert found.namespace(tiered) == found.namespace(base)  # a rebuild keeps the blocks
    monkeypatch.setattr(tier_image, "plugin", lambda: replace(plugin, version="0.2.0"))
    upgraded = engine(tmp_path, Images(base_images()))  # a worker started after the upgrade
    assert upgraded.identity(base).plugin_version == "0.2.0"
    assert upgraded.namespace(base) != found.namespace(base)


def test_without_tiers_the_plugin_version_is_not_in_the_namespace(tmp_path: Path) -> None:
    found = engine(tmp_path, Images(base_images()), recipe_text(tmp_path, tiers=""))
    assert found.identity(Image(BASE_ID, {})).plugin_version == ""


@pytest.mark.parametrize(
    ("device", "block", "flag", "effective"),
    [
        ("cpu", None, None, 128),
        ("cpu", 128, None, 128),
        ("cpu", 64, "64", 64),
        ("cpu", 256, "256", 256),
    ],
)
def test_the_block_size_is_the_devices_unless_the_recipe_sets_another(
    tmp_path: Path, device: str, block: int | None, flag: str | None, effective: int
) -> None:
    extra = f"block_size = {block}" if block is not None else ""
    found = engine(tmp_path, Images(base_images()), recipe_text(tmp_path, extra=extra))
    command = found.command()
    assert (
        command[command.index("--block-size") + 1] if "--block-size" in command else None
    ) == flag
    assert found.identity(Image(BASE_ID, {})).layout.block_size == effective


def test_the_gpu_default_block_is_16() -> None:
    text = (Path(__file__).resolve().parents[2] / "recipes" / "vllm.toml").read_text()
    recipe = parsed(text)
    assert recipe.block_size == 16 and "--block-size" not in recipe.layout_args()
    bigger = parsed(
        text.replace('key_secret = "LUCIA_KV_KEY"', 'key_secret = "LUCIA_KV_KEY"\nblock_size = 32')
    )
    assert bigger.layout_args() == ("--block-size", "32")


@pytest.mark.parametrize("block", [16, 100, 48])
def test_a_cpu_block_size_vllms_cpu_attention_refuses_is_refused(
    tmp_path: Path, block: int
) -> None:
    with pytest.raises(
        RecipeError,
        match=f"tiers.block_size {block}: vLLM's CPU attention takes multiples of 32 tokens only",
    ):
        parse(recipe_text(tmp_path, extra=f"block_size = {block}"))


def test_an_old_recipe_with_plugin_version_gets_the_extra_field_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as refused:
        parse(recipe_text(tmp_path, extra='plugin_version = "0.1.0"'))
    assert str(refused.value) == "<recipe>: tiers.plugin_version: unknown key"


def test_the_cpu_recipes_tiers_uncommented_load_and_start_with_the_tier_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the key file the recipe names, under ~
    (tmp_path / ".config" / "lucia").mkdir(parents=True)
    (tmp_path / ".config" / "lucia" / "vllm-cache.key").write_text(KEY + "\n")
    shipped = (Path(__file__).resolve().parents[2] / "recipes" / "vllm-cpu.toml").read_text()
    marker = "# [tiers]\n"
    assert marker in shipped
    head, _, block = shipped.partition(marker)
    text = head + "[tiers]\n" + "\n".join(line.removeprefix("# ") for line in block.splitlines())
    recipe = parsed(text)
    assert recipe.tiers.any and recipe.block_size == 128
    assert [tier.name for tier in recipe.tier_plan().disks] == ["nvme", "hdd"]
    runtime = Images({recipe.vllm.image: Image(BASE_ID, {})})
    found = Vllm("vllm-cpu", recipe, runtime, tmp_path / "state")
    assert found.prerequisites().missing == (TierImage(f"{recipe.vllm.image}-tiers"),)
