"""Recipe files: the shipped Spark recipe, and recipes that must be refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.engines import grammar
from supervisor.recipe import Grammar, RecipeError, load, parse
from tests.support import MINIMAL_RECIPE

ROOT = Path(__file__).resolve().parents[2]
SPARK = ROOT / "recipes" / "spark-model.toml"


def test_the_spark_recipe_has_the_operators_values() -> None:
    recipe = load(SPARK)
    env = recipe.environment
    assert env["PARALLEL"] == "4"
    assert env["CONTEXT"] == "200000"
    assert env["TENSORFOLD_MEMORY_RESERVE_GIB"] == "4"
    assert env["PORT"] == "8888"
    assert recipe.run.port == 8888
    assert recipe.grammar.requirement == "xgrammar>=0.2.8,<0.3"
    assert recipe.grammar.modules == ["xgrammar", "tensorfold"]
    assert recipe.source.commit == "069c0e91491e1aa5409a34300db355c8273d6406"
    assert recipe.grammar_tag == "tensorfold-qwen38:v0.6.6-grammar"
    assert recipe.run.stop_grace == 60
    assert recipe.run.ready_path == "/v1/models"
    assert recipe.run.gpus == "all" and recipe.run.ipc == "host"
    assert recipe.run.ulimits == {"memlock": -1, "stack": 67108864}
    assert recipe.command[:3] == ["tensorfold", "serve", recipe.model]
    assert "--port" in recipe.command and "8888" in recipe.command


MINIMAL = MINIMAL_RECIPE

BAD = [
    ("not toml", "name = ", "not valid TOML"),
    ("unknown key", MINIMAL + "\nsurprise = 1\n", "surprise"),
    ("short commit", MINIMAL.replace("0123456789abcdef0123456789abcdef01234567", "abc123"),
     "source.commit"),
    ("unknown engine", MINIMAL.replace('engine = "tensorfold"', 'engine = "vllm"'), "engine"),
    ("port out of range", MINIMAL.replace("port = 8888", "port = 70000"), "run.port"),
    ("module name with code", MINIMAL.replace('["xgrammar"]', '["os; rm -rf /"]'),
     "not module names"),
    ("dockerfile outside the checkout", MINIMAL.replace('tag = "img:1"',
                                                         'tag = "img:1"\ndockerfile = "../x"'),
     "inside the checkout"),
    ("bad image tag", MINIMAL.replace('tag = "img:1"', 'tag = "Img With Spaces"'),
     "image reference"),
    ("command names an unknown setting", MINIMAL + 'command = ["serve", "${NOPE}"]\n', "NOPE"),
    ("relative volume target",
     MINIMAL + 'volumes = [{ source = "/a", target = "rel" }]\n', "absolute"),
    ("setting that is not an env name", MINIMAL + '[settings]\n"A-B" = "1"\n',
     "environment variable"),
]


@pytest.mark.parametrize(("text", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_recipes_are_refused_naming_the_problem(text: str, needle: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse(text, "bad.toml")
    message = str(info.value)
    assert message.startswith("bad.toml: ")
    assert needle in message
    assert "\n" not in message


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="no such recipe file"):
        load(tmp_path / "nope.toml")


def test_minimal_recipe_defaults() -> None:
    recipe = parse(MINIMAL)
    assert recipe.run.stop_grace == 60
    assert recipe.run.network == "lucia"
    assert recipe.run.inner_port == 8888
    assert recipe.prepare.commands == []


PIN = Grammar(requirement="xgrammar>=0.2.8,<0.3", modules=["xgrammar", "tensorfold"])


def test_grammar_dockerfile_is_exec_form_and_never_the_engine_extra() -> None:
    text = grammar.dockerfile(PIN, "sha256:base")
    lines = text.splitlines()
    assert lines[0] == "FROM sha256:base"
    install = json.loads(lines[1].removeprefix("RUN "))
    check = json.loads(lines[2].removeprefix("RUN "))
    assert install[:4] == ["python", "-m", "pip", "install"]
    assert install[-1] == "xgrammar>=0.2.8,<0.3"
    assert "[grammar]" not in text
    assert check == ["python", "-c", "import xgrammar, tensorfold"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (grammar.labels(PIN, "sha256:base"), True),
        ({**grammar.labels(PIN, "sha256:base"), "other": "x"}, True),
        (grammar.labels(PIN, "sha256:older"), False),
        (grammar.labels(Grammar(requirement="xgrammar==0.2.8", modules=["xgrammar",
                                                                       "tensorfold"]),
                        "sha256:base"), False),
        (grammar.labels(Grammar(requirement=PIN.requirement, modules=["xgrammar"]),
                        "sha256:base"), False),
        ({}, False),
    ],
)
def test_grammar_image_is_current_exactly_when_base_and_pin_match(
    labels: dict[str, str], expected: bool
) -> None:
    assert grammar.current(PIN, "sha256:base", labels) is expected
