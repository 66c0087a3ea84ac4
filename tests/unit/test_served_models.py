"""The model names each engine kind serves, as status.json's `models` says them in every state:
the router's preset sections (or, before a sync current with the library, what the next sync
would offer), vLLM's served names, TensorFold's `--name`; and the served-name rule the vLLM and
TensorFold recipes hold theirs to (protocol.names)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Image
from supervisor.engines.base import StepContext
from supervisor.engines.flags import flag_values
from supervisor.engines.llama_router import preset
from supervisor.engines.llama_router.engine import LlamaRouter
from supervisor.engines.llama_router.library_sync import offered_names, served_names
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.loader import load, parse
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.engines.tensorfold.recipe import served_names as tensorfold_names
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.recipe import served_names as vllm_names
from supervisor.library.models import Library, LibraryUnavailable, ReadyModel
from supervisor.recipe.schema import RecipeError
from tests.gguf_fixtures import add_model, break_magic, write_gguf, write_model
from tests.support import MINIMAL_RECIPE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "flag", "many", "expected"),
    [
        ((), "--name", False, ()),
        (("--name", "a"), "--name", False, ("a",)),
        (("--name=a",), "--name", False, ("a",)),
        (("--name", "a", "b"), "--name", False, ("a",)),
        (("--name", "a", "b", "--x"), "--name", True, ("a", "b")),
        (("--name", "a", "--name", "c"), "--name", False, ("c",)),  # the last one wins
        (("--name", "--port", "1"), "--name", False, ()),
        (("--names", "a"), "--name", False, ()),
    ],
)
def test_flag_values_read_as_argparse_does(
    args: tuple[str, ...], flag: str, many: bool, expected: tuple[str, ...]
) -> None:
    assert flag_values(args, flag, many=many) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, ()),
        ("", ()),
        ("version = 1\n\n[*]\nctx-size = 8\n", ()),
        (
            "version = 1\n\n[*]\nc = 1\n\n[b-model]\nmodel = /m/b\n\n[a]\nmodel = /m/a\n",
            ("b-model", "a"),
        ),
    ],
)
def test_the_routers_names_are_its_presets_sections(
    text: str | None, expected: tuple[str, ...]
) -> None:
    assert preset.models(text) == expected


def test_a_rendered_preset_names_what_it_serves() -> None:
    class Model:
        def __init__(self, name: str) -> None:
            self.name, self.model_file, self.mmproj_file = name, f"{name}.gguf", None

    text = preset.render([Model("qwen-1"), Model("gemma-2")], {"ctx-size": 8}, ["qwen-1"], "/c")
    assert preset.models(text) == ("gemma-2", "qwen-1")


VLLM = """
name = "v"
engine = "vllm"
[vllm]
served_name = "llama-small"
max_model_len = 4096
args = ARGS
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], ("llama-small",)),
        (["--max-num-seqs", "4"], ("llama-small",)),
        (["--served-model-name", "a", "b", "--enforce-eager"], ("a", "b")),
        (["--served-model-name=c"], ("c",)),
    ],
)
def test_vllm_serves_its_served_names(args: list[str], expected: tuple[str, ...]) -> None:
    recipe = parse(VLLM.replace("ARGS", json.dumps(args)))
    assert isinstance(recipe, VllmRecipe)
    assert vllm_names(recipe) == expected


def test_the_shipped_vllm_recipes_serve_their_served_name() -> None:
    for name in ("vllm.toml", "vllm-cpu.toml"):
        recipe = load(ROOT / "recipes" / name)
        assert isinstance(recipe, VllmRecipe)
        assert vllm_names(recipe) == (recipe.vllm.served_name,)


@pytest.mark.parametrize(
    ("served", "args", "why"),
    [
        ("Qwen 7B (Q4)", [], "vllm.served_name: Value error, 'Qwen 7B (Q4)' is not a served name"),
        ("a/../b", [], "'a/../b' is not a served name: it has '..'"),
        ("a//b", [], "'a//b' is not a served name: it has an empty part"),
        ("ok", ["--served-model-name", "fine", "not fine"], "'not fine' is not a served name"),
        ("ok", ["--served-model-name=modèle"], "'modèle' is not a served name"),
    ],
)
def test_vllm_refuses_a_served_name_outside_the_rule(
    served: str, args: list[str], why: str
) -> None:
    """Was: taken (the args unchecked, the served_name under a rule of its own with `..`)."""
    text = VLLM.replace('"llama-small"', json.dumps(served)).replace("ARGS", json.dumps(args))
    with pytest.raises(RecipeError) as caught:
        parse(text)
    assert why in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ('["tensorfold", "serve", "org/m", "--name", "Qwen 7B"]', "'Qwen 7B'"),
        ('["tensorfold", "serve", "--name", "${N}"]', "'from settings'"),
        ('["tensorfold", "serve", "--served-model-name=.x"]', "'.x'"),
    ],
)
def test_tensorfold_refuses_a_served_name_outside_the_rule(command: str, why: str) -> None:
    text = MINIMAL_RECIPE.replace("[run]", '[settings]\nN = "from settings"\n[run]')
    with pytest.raises(RecipeError) as caught:
        parse(text + f"command = {command}\n")
    assert f"{why} is not a served name: it " in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ('["tensorfold", "serve", "org/m"]', ("m",)),  # unnamed: the model it loads
        ('["tensorfold", "serve", "org/m", "--name", "fast"]', ("fast",)),
        ('["tensorfold", "serve", "--name=fast", "--served-model-name", "late"]', ("late",)),
        ('["tensorfold", "serve", "--name", "${N}"]', ("from-settings",)),
    ],
)
def test_tensorfold_serves_its_name(command: str, expected: tuple[str, ...]) -> None:
    text = MINIMAL_RECIPE.replace("[run]", '[settings]\nN = "from-settings"\n[run]')
    recipe = parse(text + f"command = {command}\n")
    assert isinstance(recipe, TensorFoldRecipe)
    assert tensorfold_names(recipe) == expected


def test_the_spark_recipe_serves_its_served_name() -> None:
    recipe = load(ROOT / "recipes" / "spark-model.toml")
    assert isinstance(recipe, TensorFoldRecipe)
    assert tensorfold_names(recipe) == ("Qwen3.8-Flash-Next",)


# -- the router's names: the preset's while its sync is current, else the library's ----------

LIB = Path("/library")


def _library(*models: tuple[str, ...]) -> Library:
    """A scanned library (nothing on disk: naming reads no file), one Ready model per tuple of
    file names, guids in order."""
    ready = [
        ReadyModel(
            f"{index:032x}",
            LIB / f"{index:032x}",
            tuple(LIB / f"{index:032x}" / "files" / name for name in sorted(files)),
        )
        for index, files in enumerate(models)
    ]
    return Library(LIB, tuple(ready), ())


SPLIT = tuple(f"beta-0000{i}-of-00003.gguf" for i in (1, 2, 3))


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ((), ()),
        ((("alpha.gguf",),), ("alpha",)),
        ((("zeta.gguf",), ("alpha.gguf",)), ("alpha", "zeta")),  # sorted, as the preset is
        (((*SPLIT, "mmproj-beta-f16.gguf"),), ("beta",)),  # a split model and its projector
        ((SPLIT[:2],), ()),  # a shard missing: the sync skips it
        ((("mmproj-only.gguf",),), ()),  # a projector is no model
        ((("a.gguf", "b.gguf"),), ("a", "b")),  # one library model, two files: two models
        ((("alpha.gguf",), ("alpha.gguf",)), ("alpha",)),  # a name two models give: once
        ((("alpha.gguf", "alpha-00001-of-00001.gguf"),), ()),  # single and split: neither
        ((("[bad].gguf", "ok.gguf"),), ("ok",)),  # a name no preset section can have
    ],
)
def test_the_next_sync_offers_the_library_units_by_name(
    models: tuple[tuple[str, ...], ...], expected: tuple[str, ...]
) -> None:
    assert offered_names(_library(*models)) == expected


PRESET_AZ = "version = 1\n\n[*]\nc = 1\n\n[alpha]\nmodel = /m/a\n\n[zeta]\nmodel = /m/z\n"


@pytest.mark.parametrize(
    ("found", "current", "text", "expected"),
    [
        # never synced (a router that never ran): what the first sync would offer
        (_library(("alpha.gguf",), ("zeta.gguf",)), False, None, ("alpha", "zeta")),
        (_library(), False, None, ()),
        # the last sync is current: its preset, which may leave out what the library has
        # (a bad header, a model that cannot fit even alone)
        (
            _library(("alpha.gguf",), ("zeta.gguf",), ("big.gguf",)),
            True,
            PRESET_AZ,
            ("alpha", "zeta"),
        ),
        # the library changed since: a model Ready since is named before the next sync ...
        (
            _library(("alpha.gguf",), ("zeta.gguf",), ("new.gguf",)),
            False,
            PRESET_AZ,
            ("alpha", "new", "zeta"),
        ),
        # ... and one no longer Ready is not
        (_library(("alpha.gguf",)), False, PRESET_AZ, ("alpha",)),
    ],
)
def test_the_router_names_the_presets_models_while_its_sync_is_current(
    found: Library, current: bool, text: str | None, expected: tuple[str, ...]
) -> None:
    assert served_names(found, current, text) == expected


ROUTER = """
name = "router"
engine = "llama-router"
[library]
models_dir = "{models}"
cache_dir = "{cache}"
[router]
image = "lucia-test/llama:1"
models_max = 2
defaults = {{ n-gpu-layers = 0 }}
[run]
port = 18080
"""


class NoDocker(Runtime):
    """The runtime boundary with the router image present, no network and nothing running."""

    def image(self, ref: str) -> Image | None:
        return Image(id="sha256:" + "a" * 64, labels={})

    def container(self, name: str) -> None:
        return None

    def gateway(self, network: str) -> None:
        return None


def test_a_router_names_its_library_before_a_first_sync_and_its_preset_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each observation hands the worker for status.json's models (real library, cache
    and preset): a router that never ran names the library's models; a sync's preset leaves
    out a bad file and a model that cannot fit even alone, and its names stand while the
    library is unchanged; a model Ready since is named before the next sync; a library that
    cannot be read leaves the last look's names."""
    machine = tmp_path / "machine.toml"  # 4 MiB: the 8 MiB counted for heavy cannot fit
    machine.write_text(f'limit = {4 / 1024}\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    models = tmp_path / "models"
    write_model(add_model(models) / "alpha.gguf", context=2048)
    write_model(add_model(models) / "heavy.gguf", elements=1024 * 1024)
    break_magic(write_gguf(add_model(models) / "broken.gguf"))
    later = add_model(models, "Downloading")
    write_model(later / "zeta.gguf", context=2048)
    recipe = parse(ROUTER.format(models=models, cache=tmp_path / "cache"))
    assert isinstance(recipe, LlamaRouterRecipe)
    (tmp_path / "state").mkdir()  # the worker's
    engine = LlamaRouter("router", recipe, NoDocker(), tmp_path / "state")
    step = StepContext(threading.Event(), lambda line: None)

    assert engine.info.models == (), "before any look: the preset's (there is none)"
    assert engine.observe().models == ("alpha", "broken", "heavy"), "before any sync"
    assert engine.last is not None
    assert engine.served(engine.last) == ("alpha", "broken", "heavy"), "the last look's"
    engine.syncer.sync(step)
    assert engine.observe().models == ("alpha",), "the preset's: broken and heavy left out"
    assert engine.observe().models == ("alpha",), "an unchanged library: the same names"

    (later.parent / "model.json").write_text(json.dumps({"state": "Ready"}))
    assert engine.observe().models == ("alpha", "broken", "heavy", "zeta"), "Ready since"
    engine.syncer.sync(step)
    assert engine.observe().models == ("alpha", "zeta")

    models.rename(tmp_path / "unmounted")
    with pytest.raises(LibraryUnavailable):
        engine.observe()
    assert engine.served(engine.last) == ("alpha", "zeta"), "the last look's names stand"
