"""The router's API as the worker reads it: /models (parse, targets, note, startup-set changes)
and the build /props states."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.engines.llama_router.api import (
    ModelState,
    build,
    changes,
    failed,
    note,
    parse,
    target_groups,
)
from supervisor.worker.telemetry import Metrics

# the shape of a real answer (tests/integration/test_llama_server_facts.py)
LISTING = {
    "object": "list",
    "data": [
        {"id": "tiny", "status": {"value": "loaded", "args": ["/usr/bin/llama-server"]}},
        {"id": "sp", "status": {"value": "unloaded"}},
        {"id": "broken", "status": {"value": "unloaded", "failed": True, "exit_code": 1}},
        {"id": "big", "status": {"value": "loading"}},
    ],
}
TINY, SP, BROKEN, BIG = parse(LISTING)


@pytest.mark.parametrize(
    ("listing", "expected"),
    [
        (LISTING, (
            ModelState("tiny", "loaded"),
            ModelState("sp", "unloaded"),
            ModelState("broken", "unloaded", failed=True, exit_code=1),
            ModelState("big", "loading"),
        )),
        ({"data": [{"id": "x", "status": {"value": "failed"}}]},
         (ModelState("x", "failed", failed=True),)),
        ({"data": [{"id": "x", "status": {"value": "unloaded", "exit_code": True}}]},
         (ModelState("x", "unloaded"),)),
        ({"data": [{"id": 3}, "x", {"status": {}}, {"id": "ok"}]}, (ModelState("ok", ""),)),
        ({"data": "nope"}, ()),
        ([], ()),
        (None, ()),
    ],
)
def test_parse(listing: Any, expected: tuple[ModelState, ...]) -> None:
    assert parse(listing) == expected


def test_one_target_group_per_loaded_model_that_never_loads_one() -> None:
    common = {"__metrics_path__": "/metrics", "engine": "llama-router", "name": "r"}
    groups = target_groups((*parse(LISTING), ModelState("two", "loaded")), "10.0.0.1:80", common)
    assert [g.model_dump() for g in groups] == [
        {"targets": ["10.0.0.1:80"], "labels": {
            **common, "__param_model": name, "__param_autoload": "false", "model": name}}
        for name in ("tiny", "two")
    ]


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ((TINY, SP, BROKEN, BIG),
         "loaded: tiny; loading: big; offered: tiny, sp, broken, big; "
         "failed to load: broken (exit code 1)"),
        ((SP,), "loaded: none; offered: sp"),
        ((), "loaded: none; offered: none"),
        ((ModelState("x", "failed", failed=True),),
         "loaded: none; offered: x; failed to load: x (exit code unknown)"),
        ((ModelState("x", "loaded", failed=True),), "loaded: x; offered: x"),
    ],
)
def test_note(models: tuple[ModelState, ...], expected: str) -> None:
    assert note(models) == expected


@pytest.mark.parametrize(
    ("wanted", "applied", "load", "unload"),
    [
        (["tiny"], ["tiny"], (), ()),
        (["tiny", "sp"], ["tiny"], ("sp",), ()),  # the new one loads, tiny serves on
        (["sp"], ["tiny"], ("sp",), ("tiny",)),
        ([], ["tiny", "broken"], (), ("tiny",)),  # broken is not running: nothing to unload
        (["big"], [], (), ()),  # loading already
        (["tiny"], [], (), ()),  # loaded already (on demand)
        (["broken"], [], ("broken",), ()),  # newly wanted: tried again
        (["gone"], [], (), ()),  # not offered (the sync refuses it first)
        (["sp", "sp"], ["sp", "sp"], (), ()),
    ],
)
def test_changes_apply_only_the_difference(
    wanted: list[str], applied: list[str], load: tuple[str, ...], unload: tuple[str, ...]
) -> None:
    assert changes((TINY, SP, BROKEN, BIG), wanted, applied) == (load, unload)


def test_a_startup_model_the_router_evicted_is_not_loaded_back() -> None:
    evicted = ModelState("tiny", "unloaded")
    assert changes((evicted, SP), ["tiny"], ["tiny"]) == ((), ())


@pytest.mark.parametrize(
    ("wanted", "applied", "reloaded", "load", "unload"),
    [
        (["sp"], ["sp"], ["sp"], ("sp",), ()),  # its section changed, the router unloaded it
        (["sp"], ["sp"], ["tiny"], (), ()),  # another section changed: sp stays as it is
        (["tiny", "sp"], ["tiny"], ["sp"], ("sp",), ()),
        (["sp"], ["tiny"], ["sp", "tiny"], ("sp",), ("tiny",)),
    ],
)
def test_a_model_whose_section_the_router_reloaded_is_due_again(
    wanted: list[str], applied: list[str], reloaded: list[str], load: tuple[str, ...],
    unload: tuple[str, ...],
) -> None:
    assert changes((TINY, SP, BROKEN, BIG), wanted, applied, reloaded) == (load, unload)


def test_failed_models_and_their_gauge() -> None:
    assert failed((TINY, SP, BROKEN, BIG)) == (BROKEN,)
    metrics = Metrics("r")

    def gauge(model: str) -> float | None:
        return metrics.registry.get_sample_value(
            "lucia_router_model_load_failed", {"model": model})

    metrics.set_load_failed(["broken", "other"])
    assert (gauge("broken"), gauge("other")) == (1.0, 1.0)
    metrics.set_load_failed(["broken"])
    assert (gauge("broken"), gauge("other")) == (1.0, None), "a model that loads is dropped"
    metrics.set_load_failed([])
    assert gauge("broken") is None


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"role": "router", "build_info": "b11669-Debian"}, "b11669-Debian"),  # the real one's
        ({"build_info": "b6000-1a2b3c4d"}, "b6000-1a2b3c4d"),
        ({"role": "router"}, None),
        ({"build_info": ""}, None),
        ({"build_info": 11669}, None),
        ({"build_info": "b1 <script>"}, None),  # status.json carries a build, nothing else
        ({"build_info": "b" + "1" * 64}, None),
        ([], None),
        (None, None),
    ],
)
def test_the_build_is_what_props_states(props: Any, expected: str | None) -> None:
    assert build(props) == expected
