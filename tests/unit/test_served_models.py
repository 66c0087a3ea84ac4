"""The model names each engine kind serves, as status.json's `models` says them in every state:
the router's preset sections, vLLM's served names, TensorFold's `--name`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.engines.flags import flag_values
from supervisor.engines.llama_router import preset
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.engines.tensorfold.recipe import served_names as tensorfold_names
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.recipe import served_names as vllm_names
from supervisor.recipe.loader import load, parse
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
