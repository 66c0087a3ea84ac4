"""What the real llama-server does in router mode, asserted straight against docker (no worker).

These are the facts the llama-router engine is built on (issue 12); if a new llama.cpp-tools
changes one, this file says which.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import gguf
import pytest

from tests.gguf_fixtures import TinyLlama, write_llama
from tests.llama_server import LlamaRouter, Section

pytestmark = pytest.mark.docker

MIB = 1024 * 1024
# llama_kv_cache: size =    0.12 MiB (   256 cells,   2 layers,  4/1 seqs), K (f16):    0.06 MiB,
# V (f16):    0.06 MiB  -- a child's line, prefixed with `[PORT] ` and a timestamp by the router
KV_LINE = re.compile(
    r"^\[(?P<port>\d+)\] .*llama_kv_cache: size = +(?P<size>[\d.]+) MiB "
    r"\( *(?P<cells>\d+) cells, +(?P<layers>\d+) layers, +(?P<seqs>\d+)/(?P<streams>\d+) seqs\), "
    r"K \((?P<ktype>\w+)\): +(?P<k>[\d.]+) MiB, V \((?P<vtype>\w+)\): +(?P<v>[\d.]+) MiB$",
    re.MULTILINE,
)
MODEL_BUFFER = re.compile(
    r"^\[(?P<port>\d+)\] .*load_tensors: +(?P<buffer>\S+) model buffer size = "
    r"+(?P<size>[\d.]+) MiB",
    re.MULTILINE,
)
SPAWN = re.compile(r"spawning server instance with name=(?P<name>\S+) on port (?P<port>\d+)")


def _library(directory: Path) -> dict[str, Section]:
    directory.mkdir(exist_ok=True)
    write_llama(directory / "tiny.gguf")
    shards = write_llama(directory / "split" / "sp.gguf", split_max_tensors=8)
    assert [p.name for p in shards] == [f"sp-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    (directory / "broken.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return {
        "tiny": Section("tiny", "tiny.gguf"),
        "sp": Section("sp", "split/sp-00001-of-00003.gguf"),
        "broken": Section("broken", "broken.gguf"),
    }


def _stays_unloaded(router: LlamaRouter, name: str, seconds: float = 2) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert router.models()[name]["value"] == "unloaded", name
        time.sleep(0.2)


def test_an_idle_router_answers_lists_loads_and_unloads(llama_router, tmp_path: Path) -> None:
    sections = _library(tmp_path / "models")
    router = llama_router(tmp_path / "models", list(sections.values()), defaults={"ctx-size": 256})

    health = router.get("/health")
    assert (health.status, health.json()) == (200, {"status": "ok"}), "healthy with none loaded"
    statuses = router.models()
    assert set(statuses) == {"tiny", "sp", "broken"}
    assert {name: status["value"] for name, status in statuses.items()} == dict.fromkeys(
        statuses, "unloaded"
    )
    assert statuses["tiny"]["args"][0] == "/usr/bin/llama-server"  # the child's command line
    assert statuses["tiny"]["preset"].startswith("[tiny]\n")

    missing = router.get("/metrics")
    assert missing.status == 400
    assert missing.json()["error"]["message"] == "model name is missing from the request"
    unloaded = router.get("/metrics", {"model": "tiny", "autoload": "false"})
    assert unloaded.status == 400
    assert unloaded.json()["error"]["message"] == "model is not loaded"
    _stays_unloaded(router, "tiny")

    answer = router.post("/models/load", {"model": "tiny"})
    assert (answer.status, answer.json()) == (200, {"success": True})
    router.wait_value("tiny", "loaded")
    metrics = router.get("/metrics", {"model": "tiny", "autoload": "false"})
    assert metrics.status == 200
    assert b"# TYPE llamacpp:prompt_tokens_total counter" in metrics.body
    assert re.search(rb"^llamacpp:\w+ ", metrics.body, re.MULTILINE)

    chat = router.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "ignore_eos": True,  # the tiny model may end its answer early
        },
    )
    assert chat.status == 200, chat.body
    completion = chat.json()
    assert completion["model"] == "tiny"
    assert completion["object"] == "chat.completion"
    assert completion["usage"]["completion_tokens"] == 4
    assert completion["choices"][0]["message"]["role"] == "assistant"

    answer = router.post("/models/unload", {"model": "tiny"})
    assert (answer.status, answer.json()) == (200, {"success": True})
    router.wait_value("tiny", "unloaded")
    assert router.get("/metrics", {"model": "tiny", "autoload": "false"}).status == 400

    # without autoload=false, a scrape loads the model
    assert router.get("/metrics", {"model": "sp"}, timeout=60).status == 200
    assert router.models()["sp"]["value"] == "loaded", "the split model loads, on a scrape"

    answer = router.post("/models/load", {"model": "broken"})
    assert (answer.status, answer.json()) == (200, {"success": True}), "accepted, then fails"
    failed = router.wait_status("broken", lambda status: status.get("failed") is True)
    assert {key: failed[key] for key in ("value", "failed", "exit_code")} == {
        "value": "unloaded",
        "failed": True,
        "exit_code": 1,
    }


def test_reload_rereads_the_preset_without_loading_new_startup_sections(
    llama_router, tmp_path: Path
) -> None:
    sections = _library(tmp_path / "models")
    router = llama_router(tmp_path / "models", [sections["tiny"]], defaults={"ctx-size": 256})
    assert set(router.models()) == {"tiny"}

    added = Section("late", "tiny.gguf", {"load-on-startup": True})
    router.write_preset([sections["tiny"], added], defaults={"ctx-size": 256})
    assert set(router.models()) == {"tiny"}, "the preset is read at start and on reload only"
    assert router.models(reload=True)["late"]["value"] == "unloaded"
    _stays_unloaded(router, "late")
    router.write_preset([added], defaults={"ctx-size": 256})
    assert set(router.models(reload=True)) == {"late"}, "a removed section is no longer offered"


# name: (shape, ctx-size); llama.cpp pads the context to a multiple of 256 cells (300 -> 512)
SHAPES = {
    "plain": (TinyLlama(), 256),
    "gqa": (TinyLlama(layers=3, heads=4, kv_heads=2, context=2048), 2048),
    "wide-heads": (TinyLlama(heads=2, kv_heads=1, key_length=48, value_length=48, seed=3), 300),
}
CELL_PADDING = 256


def test_startup_models_load_and_verbose_logs_give_kv_and_weights(
    llama_router, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    sections = []
    for name, (shape, ctx_size) in SHAPES.items():
        write_llama(models / f"{name}.gguf", shape)
        sections.append(
            Section(name, f"{name}.gguf", {"load-on-startup": True, "ctx-size": ctx_size})
        )
    router = llama_router(models, sections, models_max=len(SHAPES), args=["-lv", "4"])
    for name in SHAPES:
        router.wait_value(name, "loaded")
    logs = router.logs()
    ports = {match["port"]: match["name"] for match in SPAWN.finditer(logs)}
    assert sorted(ports.values()) == sorted(SHAPES)

    kv = {ports[match["port"]]: match for match in KV_LINE.finditer(logs)}
    weights = {ports[match["port"]]: match for match in MODEL_BUFFER.finditer(logs)}
    assert set(kv) == set(weights) == set(SHAPES), logs[-3000:]
    for name, (shape, ctx_size) in SHAPES.items():
        line = kv[name]
        cells = -(-ctx_size // CELL_PADDING) * CELL_PADDING
        assert (int(line["cells"]), int(line["layers"])) == (cells, shape.layers), name
        assert (line["ktype"], line["vtype"]) == ("f16", "f16")
        assert (int(line["seqs"]), int(line["streams"])) == (4, 1), "4 slots, one unified cache"
        expected = shape.kv_cache_bytes(cells) / MIB
        assert float(line["size"]) == pytest.approx(expected, abs=0.006), name
        assert float(line["k"]) + float(line["v"]) == pytest.approx(expected, abs=0.011), name
        file_mib = (models / f"{name}.gguf").stat().st_size / MIB
        assert weights[name]["buffer"] == "CPU_Mapped"
        assert float(weights[name]["size"]) == pytest.approx(file_mib, abs=0.02), name


def test_llama_refuses_key_and_value_lengths_that_differ(llama_router, tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_llama(models / "kv.gguf", TinyLlama(key_length=16, value_length=32))
    router = llama_router(models, [Section("kv", "kv.gguf")], defaults={"ctx-size": 256})
    router.post("/models/load", {"model": "kv"})
    failed = router.wait_status("kv", lambda status: status.get("failed") is True)
    assert failed["exit_code"] == 1
    assert "tensor 'blk.0.attn_output.weight' has wrong shape" in router.logs()


def test_without_verbosity_the_memory_lines_are_not_logged(llama_router, tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_llama(models / "tiny.gguf")
    router = llama_router(
        models,
        [Section("tiny", "tiny.gguf", {"load-on-startup": True})],
        defaults={"ctx-size": 256},
        args=["-lv", "3"],
    )
    router.wait_value("tiny", "loaded")
    logs = router.logs()
    assert SPAWN.search(logs)
    assert not KV_LINE.search(logs) and not MODEL_BUFFER.search(logs)


def test_more_startup_models_than_models_max_exits_1(llama_router, tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_llama(models / "tiny.gguf")
    sections = [Section(f"m{i}", "tiny.gguf", {"load-on-startup": True}) for i in range(3)]
    router = llama_router(models, sections, defaults={"ctx-size": 256}, models_max=2, wait=False)
    assert router.container.wait(timeout=60)["StatusCode"] == 1, router.logs()[-2000:]


def test_models_max_evicts_the_least_recently_used_and_errors_are_plain(
    llama_router, tmp_path: Path
) -> None:
    sections = _library(tmp_path / "models")
    tiny = Section("tiny", "tiny.gguf", {"load-on-startup": True})
    router = llama_router(
        tmp_path / "models", [tiny, sections["sp"]], defaults={"ctx-size": 256}, models_max=1
    )
    router.wait_value("tiny", "loaded")
    assert router.post("/models/load", {"model": "sp"}).json() == {"success": True}
    router.wait_value("sp", "loaded")
    assert router.models()["tiny"]["value"] == "unloaded", "evicted to stay within models-max"

    unknown = router.post("/models/load", {"model": "nope"})
    assert unknown.status == 404
    assert unknown.json()["error"]["message"] == "File Not Found"
    idle = router.post("/models/unload", {"model": "tiny"})
    assert idle.status == 400
    assert idle.json()["error"]["message"] == "model is not running"


def test_reload_unloads_a_loaded_model_whose_section_changed(llama_router, tmp_path: Path) -> None:
    """So a load-on-startup flag dropped from a loaded model's section unloads it on reload;
    the sections that did not change keep serving."""
    models = tmp_path / "models"
    write_llama(models / "tiny.gguf")
    first = Section("first", "tiny.gguf", {"load-on-startup": True})
    second = Section("second", "tiny.gguf", {"load-on-startup": True})
    router = llama_router(models, [first, second], defaults={"ctx-size": 256})
    router.wait_value("first", "loaded")
    router.wait_value("second", "loaded")
    router.write_preset([Section("first", "tiny.gguf"), second], defaults={"ctx-size": 256})
    router.models(reload=True)
    router.wait_value("first", "unloaded", timeout=10)
    assert router.models()["second"]["value"] == "loaded"


def test_reload_of_a_new_global_section_unloads_all_and_loads_none(
    llama_router, tmp_path: Path
) -> None:
    """The reload's own answer already says so; the load-on-startup models stay unloaded."""
    models = tmp_path / "models"
    write_llama(models / "tiny.gguf")
    sections = [Section(n, "tiny.gguf", {"load-on-startup": True}) for n in ("a", "b")]
    router = llama_router(models, sections, defaults={"ctx-size": 256})
    router.wait_value("a", "loaded")
    router.wait_value("b", "loaded")
    router.write_preset(sections, defaults={"ctx-size": 512})
    assert {n: s["value"] for n, s in router.models(reload=True).items()} == {
        "a": "unloaded",
        "b": "unloaded",
    }
    _stays_unloaded(router, "a")


def test_the_router_states_its_build_in_props_as_its_version_flag_does(
    llama_router, client, llama_server_image: str, tmp_path: Path
) -> None:
    """Router mode has no /version (vLLM's); GET /props answers at once, with no model loaded,
    and its `build_info` is the build `llama-server --version` prints: the engineVersion."""
    (tmp_path / "models").mkdir()
    router = llama_router(tmp_path / "models", [])
    assert router.get("/version").status == 404
    props = router.get("/props")
    assert props.status == 200
    assert props.json()["role"] == "router"
    printed = client.containers.run(
        llama_server_image, ["--version"], remove=True, stdout=True, stderr=True
    ).decode()
    stated = re.search(r"^version: \S+ \(build (\d+), commit (\S+)\)$", printed, re.MULTILINE)
    assert stated is not None, printed
    assert props.json()["build_info"] == f"b{stated[1]}-{stated[2]}"


def test_embeddings_need_the_flag_and_a_pooling_and_props_state_neither(
    llama_router, tmp_path: Path
) -> None:
    """What the capabilities of a router model rest on (engines/llama_router/serves.py):
    /v1/embeddings answers only a child run with --embeddings whose model pools (its GGUF's
    pooling type); without the flag it is 501 and the model generates; a chat GGUF with the
    flag refuses embeddings 400. Its child's arguments are in /models; /props names neither."""
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "chat.gguf")
    write_llama(models / "emb.gguf", TinyLlama(seed=3), pooling=gguf.PoolingType.MEAN)
    sections = [
        Section("chat", "chat.gguf"),
        Section("emb-off", "emb.gguf"),
        Section("emb", "emb.gguf", {"embeddings": True}),
        Section("chat-on", "chat.gguf", {"embeddings": True}),
    ]
    router = llama_router(models, sections, defaults={"ctx-size": 256}, models_max=4)
    hello = {"input": "hello"}
    for name in ("chat", "emb-off", "emb", "chat-on"):
        assert router.post("/models/load", {"model": name}).status == 200
        router.wait_value(name, "loaded")
    assert "--embeddings" in router.models()["emb"]["args"]
    assert "--embeddings" not in router.models()["emb-off"]["args"]
    for name in ("chat", "emb-off"):
        refused = router.post("/v1/embeddings", {"model": name, **hello})
        assert refused.status == 501, refused
        assert "Start it with `--embeddings`" in refused.json()["error"]["message"]
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert router.post("/v1/chat/completions", chat).status == 200
    answer = router.post("/v1/embeddings", {"model": "emb", **hello})
    assert answer.status == 200 and len(answer.json()["data"][0]["embedding"]) == 64
    refused = router.post("/v1/embeddings", {"model": "chat-on", **hello})
    assert refused.status == 400 and "not OAI compatible" in refused.json()["error"]["message"]
    for name in ("chat", "emb"):
        props = router.get("/props", {"model": name, "autoload": "false"}).json()
        assert not {key for key in props if "embed" in key or "pool" in key}, sorted(props)
    responses = router.post(
        "/v1/responses", {"model": "chat", "input": "a", "max_output_tokens": 2}
    )
    assert responses.status == 200 and responses.json()["object"] == "response"
