"""The engine registry: every kind declared in its folder, recipes and plans looked up by kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from supervisor.engines import registry
from supervisor.engines.kind import EngineKind
from supervisor.engines.loader import parse
from supervisor.memplan import overview, settings
from supervisor.memplan.probe import Memory
from supervisor.recipe.schema import RecipeBase, RecipeError

ROOT = Path(__file__).resolve().parents[2]
ECHO = "tests.engines.echo.kind"
SHIPPED = ("tensorfold", "llama-router", "vllm")


def echo_recipe(name: str = "e1", engine: str = "echo") -> str:
    return f'name = "{name}"\nengine = "{engine}"\n[echo]\nimage = "echo:1"\n[run]\nport = 8080\n'


def test_the_shipped_kinds_are_registered_each_with_its_own_schema() -> None:
    kinds = registry.kinds(registry.SHIPPED)
    assert tuple(kinds) == SHIPPED
    for name, kind in kinds.items():
        assert kind.name == name
        assert kind.recipe.model_fields["engine"].annotation == Literal[name]  # type: ignore[valid-type]
        assert kind.conformance.startswith("tests.conformance.drivers.")


def test_an_unknown_engine_is_a_recipe_error_naming_the_known_kinds() -> None:
    with pytest.raises(RecipeError) as caught:
        parse(echo_recipe(), "e1.toml")
    assert str(caught.value) == (
        "e1.toml: engine: must be one of tensorfold, llama-router, vllm ('echo')"
    )


def test_a_kind_registered_through_the_environment_is_parsed_by_its_own_schema(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(registry.MODULES_ENV, ECHO)
    recipe = parse(echo_recipe())
    assert type(recipe).__name__ == "EchoRecipe" and recipe.engine == "echo"
    with pytest.raises(RecipeError, match=r"e1.toml: echo.image: .*not a valid image"):
        parse(echo_recipe().replace("echo:1", "Not An Image"), "e1.toml")
    with pytest.raises(RecipeError, match="one of tensorfold, llama-router, vllm, echo"):
        parse(echo_recipe(engine="echoes"))


def test_a_bad_engine_module_is_a_recipe_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.MODULES_ENV, "tests.engines.nowhere.kind")
    with pytest.raises(RecipeError, match=r"engine module tests\.engines\.nowhere\.kind: cannot"):
        parse(echo_recipe(), "e1.toml")
    monkeypatch.setenv(registry.MODULES_ENV, "supervisor.engines.base")
    with pytest.raises(RecipeError, match=r"supervisor\.engines\.base: has no KIND"):
        parse(echo_recipe(), "e1.toml")


def test_the_factory_refuses_a_kind_it_does_not_know(tmp_path: Path) -> None:
    """It used to make a Vllm of any recipe that was not tensorfold or llama-router."""

    class Odd(RecipeBase):
        engine: Literal["odd"]

    odd = Odd.model_validate({"name": "o", "engine": "odd", "run": {"port": 8080}})
    with pytest.raises(
        registry.UnknownEngine,
        match="'odd' is not a known engine; known: tensorfold, llama-router, vllm",
    ):
        registry.create("o", odd, runtime=None, state_dir=tmp_path)  # type: ignore[arg-type]


def test_the_plan_overview_asks_the_kind_for_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to treat any kind but tensorfold and vllm as a router (AttributeError)."""
    monkeypatch.setenv(registry.MODULES_ENV, ECHO)
    machine = settings.defaults()
    memory = Memory("fixed", 64 << 30, 64 << 30)
    plan = overview.build([parse(echo_recipe())], machine, memory, [], registry.plan_memory)
    (engine,) = plan.engines
    assert engine.verdict is None and engine.problem == "the echo engine is not planned"


def test_a_kind_whose_schema_answers_to_another_name_is_refused() -> None:
    class Other(RecipeBase):
        engine: Literal["other"]

    kind = registry.kinds(registry.SHIPPED)["vllm"]
    with pytest.raises(ValueError, match=r'must declare engine: Literal\["odd"\]'):
        EngineKind("odd", Other, kind.engine, kind.memory, "tests.x")


@pytest.mark.parametrize(
    ("modules", "known"),
    [
        ("", "tensorfold, llama-router, vllm"),
        (ECHO, "tensorfold, llama-router, vllm, echo"),
    ],
)
def test_the_worker_exits_78_on_an_unknown_engine_naming_the_known_kinds(
    tmp_path: Path, modules: str, known: str
) -> None:
    recipe = tmp_path / "w1.toml"
    recipe.write_text(echo_recipe("w1", engine="nope"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "worker",
            "w1",
            "--recipe",
            str(recipe),
            "--data-dir",
            str(tmp_path / "data"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", registry.MODULES_ENV: modules},
    )
    assert done.returncode == 78, done.stderr
    assert f"engine: must be one of {known} ('nope')" in done.stderr
