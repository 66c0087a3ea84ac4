"""Each engine kind's answers are pure functions of one look: asked in every order, on the same
look, they are the same. The looks are what each kind's observation reads at its boundary: a
running container of ours, the router's recorded /models (one model failed) and its last sync,
vLLM's namespace, tier image and version."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engines.base import Endpoint
from supervisor.engines.container import ContainerEngine
from supervisor.engines.llama_router import api as router_api
from supervisor.engines.llama_router.engine import LlamaRouter, RouterLook
from supervisor.engines.llama_router.library_sync import Synced
from supervisor.engines.loader import load
from supervisor.engines.look import Look, Prerequisites
from supervisor.engines.tensorfold.engine import TensorFold
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.steps import VllmLook
from tests.unit.test_engine_slots import CAPTURED, ROUTER, container, vllm
from tests.unit.test_served_models import NoDocker

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT = Endpoint("172.30.0.1", 18080)
ANSWERS = ("targets", "notes", "served", "failed", "version", "slots", "capabilities", "answers")


def _router(tmp_path: Path) -> tuple[ContainerEngine[Any, Any], Look[Any]]:
    recipe = load_text(
        tmp_path, ROUTER.format(models=tmp_path / "models", cache=tmp_path / "cache", settings="")
    )
    (tmp_path / "state").mkdir()
    engine = LlamaRouter("router", recipe, NoDocker(), tmp_path / "state")
    recorded = json.loads((CAPTURED / "auto-ctx256.json").read_text())["models"]
    broken = router_api.ModelState("broken", "unloaded", failed=True, exit_code=1)
    listing = (*router_api.parse(recorded), broken)
    synced = Synced(
        "lib", (("tiny", "tiny.gguf", None),), "preset", skipped="bad.gguf", unfit="heavy"
    )
    own = RouterLook(
        (), None, None, ("broken", "tiny"), True, synced, listing, "b7000", {"tiny": 1}
    )
    return engine, Look(container(), ENDPOINT, (), None, own)


def _vllm(tmp_path: Path) -> tuple[ContainerEngine[Any, Any], Look[Any]]:
    recipe = vllm(["--max-num-seqs", "8", "--served-model-name", "a", "b"])
    engine = Vllm("v", recipe, NoDocker(), tmp_path / "state")
    own = VllmLook(namespace="ns", tier_labels={}, version="0.32.0", tiers_note="nvme off")
    return engine, Look(container(), ENDPOINT, (), None, own)


def _tensorfold(tmp_path: Path) -> tuple[ContainerEngine[Any, Any], Look[Any]]:
    recipe = load(ROOT / "recipes" / "spark-model.toml")
    assert isinstance(recipe, TensorFoldRecipe)
    engine = TensorFold("spark", recipe, NoDocker(), tmp_path / "state")
    return engine, Look(container(), ENDPOINT, (), None, Prerequisites())


def load_text(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load(path)


@pytest.mark.parametrize("make", [_router, _vllm, _tensorfold])
def test_the_answers_do_not_depend_on_the_order_they_are_asked_in(
    tmp_path: Path, make: Any
) -> None:
    engine, look = make(tmp_path)
    first = {name: getattr(engine, name)(look) for name in ANSWERS}
    assert first["answers"].targets and first["answers"].models, "a look of a serving engine"
    for order in itertools.permutations(ANSWERS):
        assert {name: getattr(engine, name)(look) for name in order} == first, order


def test_the_router_says_its_failed_model_in_its_note_and_its_gauge(tmp_path: Path) -> None:
    engine, look = _router(tmp_path)
    observed = engine.answers(look)
    assert observed.failed == ("broken",)
    assert "broken" in observed.notes and "skipped bad.gguf" in observed.notes
