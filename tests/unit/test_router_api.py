"""The router's API as the worker reads it: /models (parse, targets, note, startup-set changes),
the build /props states, and each loaded model's slots from the real llama-server's own /props
and /models answers (tests/data/llama-server/, captured from Debian sid's llama-server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engines.llama_router.api import (
    ModelState,
    build,
    changes,
    failed,
    note,
    parse,
    props_path,
    slots,
    target_groups,
)
from supervisor.worker.telemetry import WorkerMetrics

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
        (
            LISTING,
            (
                ModelState("tiny", "loaded", args=("/usr/bin/llama-server",)),
                ModelState("sp", "unloaded"),
                ModelState("broken", "unloaded", failed=True, exit_code=1),
                ModelState("big", "loading"),
            ),
        ),
        (
            {"data": [{"id": "x", "status": {"value": "failed"}}]},
            (ModelState("x", "failed", failed=True),),
        ),
        (
            {"data": [{"id": "x", "status": {"value": "unloaded", "exit_code": True}}]},
            (ModelState("x", "unloaded"),),
        ),
        (
            {"data": [{"id": "x", "status": {"value": "loaded", "args": "--parallel 2"}}]},
            (ModelState("x", "loaded"),),
        ),
        (
            {"data": [{"id": "x", "status": {"value": "loaded", "args": ["-np", 2]}}]},
            (ModelState("x", "loaded"),),
        ),
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
        {
            "targets": ["10.0.0.1:80"],
            "labels": {**common, "__param_model": name, "__param_autoload": "false", "model": name},
        }
        for name in ("tiny", "two")
    ]


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        (
            (TINY, SP, BROKEN, BIG),
            "loaded: tiny; loading: big; offered: tiny, sp, broken, big; "
            "failed to load: broken (exit code 1)",
        ),
        ((SP,), "loaded: none; offered: sp"),
        ((), "loaded: none; offered: none"),
        (
            (ModelState("x", "failed", failed=True),),
            "loaded: none; offered: x; failed to load: x (exit code unknown)",
        ),
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
    wanted: list[str],
    applied: list[str],
    reloaded: list[str],
    load: tuple[str, ...],
    unload: tuple[str, ...],
) -> None:
    assert changes((TINY, SP, BROKEN, BIG), wanted, applied, reloaded) == (load, unload)


def test_failed_models_and_their_gauge() -> None:
    assert failed((TINY, SP, BROKEN, BIG)) == (BROKEN,)
    metrics = WorkerMetrics("r")

    def gauge(model: str) -> float | None:
        return metrics.registry.get_sample_value("lucia_router_model_load_failed", {"model": model})

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


# -- slots -------------------------------------------------------------------------------------

CAPTURED = Path(__file__).resolve().parents[1] / "data" / "llama-server"


def captured(name: str) -> tuple[dict[str, Any], tuple[str, ...], dict[str, str]]:
    """A real router's /props?model=tiny, its child's command line from /models, and the
    environment the router ran with, as recorded (the log's `n_slots = ...` line beside)."""
    record = json.loads((CAPTURED / f"{name}.json").read_text())
    (model,) = parse(record["models"])
    assert model.name == "tiny" and model.value == "loaded"
    return record["props"], model.args, record["environment"]


@pytest.mark.parametrize(
    ("name", "total", "expected"),
    [
        # llama-server's auto: 4 slots sharing one 256-cell cache, each slot's context 256 (the
        # demo's recipe): one request at a time has its whole context; 4 at once overflow it
        ("auto-ctx256", 4, 1),
        # the same with ctx-size 1024: the shared cache holds 4 slot contexts of 256
        ("auto-ctx1024", 4, 4),
        # --parallel 4: a cache of 256 cells per slot
        ("parallel4-ctx1024", 4, 4),
        # --parallel 2 with --kv-unified: 2 slots share 256 cells, each may take all of them
        ("parallel2-kvu-ctx256", 2, 1),
        # no ctx-size, --kv-unified-per-slot 256: the shared cache is 4 x 256
        ("auto-per-slot256", 4, 4),
        # LLAMA_ARG_N_PARALLEL=2 in the router's environment (not on the child's command line)
        ("env-parallel2-ctx256", 2, 2),
    ],
)
def test_a_loaded_models_slots_from_the_real_servers_answers(
    name: str, total: int, expected: int
) -> None:
    props, args, environment = captured(name)
    assert props["total_slots"] == total  # llama-server's own count
    assert slots(props, args, environment) == expected


@pytest.mark.parametrize(
    ("args", "environment", "expected"),
    [
        ((), {}, 1),  # auto, no ctx-size: the model's own context, one slot's
        (("--ctx-size", "300"), {}, 2),  # padded to 512 cells, as llama-server pads it
        (("--ctx-size=1024",), {}, 4),
        (("-c", "4096"), {}, 4),  # never more than its slots
        (("--ctx-size", "1024", "--parallel", "-1"), {}, 4),  # -1: auto, shared
        (("--ctx-size", "256", "--parallel", "4"), {}, 4),  # a cache of its own per slot
        (("--ctx-size", "256", "-np", "4", "-kvu"), {}, 1),
        (("--ctx-size", "256", "--kv-unified", "--no-kv-unified", "-np", "4"), {}, 4),
        (("--ctx-size", "256", "--parallel", "4"), {"LLAMA_ARG_KV_UNIFIED": "1"}, 1),
        (("--ctx-size", "256", "--parallel", "4", "-no-kvu"), {"LLAMA_ARG_KV_UNIFIED": "1"}, 4),
        ((), {"LLAMA_ARG_CTX_SIZE": "1024"}, 4),
        (("--ctx-size", "512"), {"LLAMA_ARG_CTX_SIZE": "1024"}, 2),  # the flag wins
        (("--ctx-size", "many"), {}, 1),
    ],
)
def test_slots_follow_the_childs_flags_and_environment(
    args: tuple[str, ...], environment: dict[str, str], expected: int
) -> None:
    props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 256}}
    assert slots(props, ("/usr/bin/llama-server", *args), environment) == expected


@pytest.mark.parametrize(
    "props",
    [
        # the router's own /props (no model named): no slots of a model
        json.loads((CAPTURED / "router-props.json").read_text()),
        {"total_slots": 0, "default_generation_settings": {"n_ctx": 256}},
        {"total_slots": True, "default_generation_settings": {"n_ctx": 256}},
        {"total_slots": 4, "default_generation_settings": {"n_ctx": 0}},
        {"total_slots": 4},
        {"error": {"code": 400, "message": "model is not loaded"}},
        [],
        None,
    ],
)
def test_props_that_name_no_slots_give_none(props: Any) -> None:
    assert slots(props, (), {}) is None


def test_props_never_load_a_model() -> None:
    assert props_path("tiny") == "/props?model=tiny&autoload=false"
    assert props_path("a b&c") == "/props?model=a+b%26c&autoload=false"
