"""The router's preset from the memory plan: `ctx-size = "auto"` becomes each model's planned
context, the load-on-startup models planned together, and a model that cannot fit even alone is
not offered. Real GGUF headers; every figure worked out here by the guide's formula."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engines.llama_router import memory as router_memory
from supervisor.engines.llama_router import preset
from supervisor.engines.llama_router.gguf_cache import CachedModel
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.loader import parse
from supervisor.errors import Permanent
from tests.gguf_fixtures import write_model

MIB = 1024**2
LIMIT = 4 * MIB

RECIPE = """
name = "router"
engine = "llama-router"
[library]
models_dir = "/nowhere"
cache_dir = "{cache}"
[router]
image = "lucia-test/llama:1"
models_max = 2
load_on_startup = {startup}
defaults = {{ ctx-size = {ctx}, n-gpu-layers = 0 }}
[run]
port = 18080
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[CachedModel]]:
    machine = tmp_path / "machine.toml"
    machine.write_text(
        f'limit = {LIMIT / 1024**3}\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n'
    )
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    directory = tmp_path / "cache"
    # small: 3 layers x 2 KV heads x (16 + 16) x 2 B = 384 B a token, native 2048
    write_model(directory / "small" / "small.gguf", context=2048)
    # wide: 2 layers x 4 KV heads x (64 + 64) x 2 B = 2048 B a token, native 4096
    write_model(
        directory / "wide" / "wide.gguf", context=4096, blocks=2, heads=4, kv_heads=4, embedding=256
    )
    # heavy: 1M float32 = 4 MiB of weights, 8 MiB counted: more than the 4 MiB limit
    write_model(directory / "heavy" / "heavy.gguf", elements=1024 * 1024)
    models = [
        CachedModel(n, n, f"{n}/{n}.gguf", None, (f"{n}/{n}.gguf",))
        for n in ("heavy", "small", "wide")
    ]
    return directory, models


def _recipe(directory: Path, startup: str = "[]", ctx: str = '"auto"') -> LlamaRouterRecipe:
    found = parse(RECIPE.format(cache=directory, startup=startup, ctx=ctx))
    assert isinstance(found, LlamaRouterRecipe)
    return found


def _size(directory: Path, name: str) -> int:
    return (directory / name / f"{name}.gguf").stat().st_size


def _render(directory: Path, models: list[CachedModel], recipe: LlamaRouterRecipe) -> str:
    planned = router_memory.plan("router", recipe, models, directory, guard=None)
    offered = [m for m in models if m.name in planned.offered]
    return preset.render(
        offered, planned.defaults, recipe.router.load_on_startup, "/models", planned.contexts
    )


def _preset(small: int, wide: int, startup: tuple[str, ...] = ()) -> str:
    def section(name: str, ctx: int) -> list[str]:
        start = ["load-on-startup = true"] if name in startup else []
        return ["", f"[{name}]", f"model = /models/{name}/{name}.gguf", f"ctx-size = {ctx}", *start]

    lines = [
        preset.HEADER.rstrip("\n"),
        "version = 1",
        "",
        "[*]",
        "n-gpu-layers = 0",
        *section("small", small),
        *section("wide", wide),
    ]
    return "\n".join(lines) + "\n"


def test_auto_becomes_each_models_own_context_and_an_unfit_model_is_not_offered(cache) -> None:
    directory, models = cache
    planned = router_memory.plan("router", _recipe(directory), models, directory, None)
    assert planned.unfit == ("heavy",)
    # each alone in 4 MiB: room after its weights x 2, per token, rounded down to 256, <= native
    small = min(2048, (LIMIT - 2 * _size(directory, "small")) // 384 // 256 * 256)
    wide = min(4096, (LIMIT - 2 * _size(directory, "wide")) // 2048 // 256 * 256)
    assert (small, wide) == (2048, 1792)
    assert _render(directory, models, _recipe(directory)) == _preset(small, wide)
    # with none loaded at start, the start claims the largest offered model
    assert [m.name for m in planned.startup] == ["wide"]


def test_the_load_on_startup_models_are_planned_together(cache) -> None:
    directory, models = cache
    recipe = _recipe(directory, startup='["small", "wide"]')
    weights = 2 * _size(directory, "small") + 2 * _size(directory, "wide")
    share = (LIMIT - weights) // 2  # the room after both weights, split evenly
    small, wide = min(2048, share // 384 // 256 * 256), share // 2048 // 256 * 256
    assert (small, wide) == (2048, 768)
    assert _render(directory, models, recipe) == _preset(small, wide, ("small", "wide"))
    planned = router_memory.plan("router", recipe, models, directory, None)
    need = router_memory.need("router", planned.startup)
    assert need.need == weights + small * 384 + wide * 2048


def test_a_fixed_context_is_kept_in_the_defaults(cache) -> None:
    directory, models = cache
    planned = router_memory.plan("router", _recipe(directory, ctx="512"), models, directory, None)
    assert planned.contexts is None and planned.defaults["ctx-size"] == 512
    assert planned.offered == ("small", "wide") and planned.unfit == ("heavy",)


def test_a_startup_model_that_cannot_fit_alone_is_refused_with_the_numbers(cache) -> None:
    directory, models = cache
    with pytest.raises(Permanent) as refused:
        router_memory.plan(
            "router", _recipe(directory, startup='["heavy"]'), models, directory, None
        )
    assert str(refused.value).startswith(
        "The model heavy does not fit after voice, OS, services, and runtime reservations: "
        "needs 8.0 MiB, 4.0 MiB left (limit 4.0 MiB, reserves 0 B)."
    )
