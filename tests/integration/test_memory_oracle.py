"""The real llama-server as the memory plan's oracle: for tiny llama models of varied shapes,
the plan's KV bytes for the same ctx-size and parallel slots equal what the engine logs with
`-lv 4` (to the engine's own two decimals of MiB, and cell for cell), and the plan's weights
figure (the files' size) is within 2% of the logged model buffer."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engines.llama_router.plan import read_model
from supervisor.library.ggufcheck import Unit
from supervisor.library.ggufmeta import read_metadata
from supervisor.memplan.kv import row_size, shape
from supervisor.memplan.need import plan_model
from tests.gguf_fixtures import TinyLlama, write_llama
from tests.integration.test_llama_server_facts import KV_LINE, MODEL_BUFFER, SPAWN
from tests.llama_server import Section

pytestmark = pytest.mark.docker

MIB = 1024 * 1024
# name: (shape, ctx-size, parallel slots; None: llama-server's auto, 4 slots and one cache).
# n_ff 512: the file's header (about 11 KiB, mostly the vocabulary) is not in the model buffer,
# and must stay under 2% of it.
FF = 512
CASES: dict[str, tuple[TinyLlama, int, int | None]] = {
    "plain": (TinyLlama(n_ff=FF), 256, None),
    "gqa": (TinyLlama(layers=3, heads=4, kv_heads=2, context=2048, n_ff=FF), 2048, None),
    "padded": (
        TinyLlama(heads=2, kv_heads=1, key_length=48, value_length=48, n_ff=FF, seed=3),
        300,
        None,
    ),
    "past-native": (
        TinyLlama(layers=1, heads=8, kv_heads=8, n_embd=128, context=256, n_ff=FF),
        2048,
        None,
    ),
    "two-slots": (TinyLlama(layers=3, heads=4, kv_heads=2, context=512, n_ff=FF, seed=1), 1024, 2),
    "three-slots": (
        TinyLlama(layers=2, heads=4, kv_heads=1, context=1024, n_ff=FF, seed=2),
        1000,
        3,
    ),
}


def test_plan_equals_what_llama_server_allocates(llama_router, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    sections = []
    for name, (tiny, ctx_size, parallel) in CASES.items():
        write_llama(models / f"{name}.gguf", tiny)
        keys: dict[str, str | int | bool] = {"load-on-startup": True, "ctx-size": ctx_size}
        if parallel is not None:
            keys["parallel"] = parallel
        sections.append(Section(name, f"{name}.gguf", keys))
    engine = llama_router(models, sections, models_max=len(CASES), args=["-lv", "4"])
    for name in CASES:
        engine.wait_value(name, "loaded")
    logs = engine.logs()
    ports = {match["port"]: match["name"] for match in SPAWN.finditer(logs)}
    kv = {ports[match["port"]]: match for match in KV_LINE.finditer(logs)}
    buffers = {ports[match["port"]]: match for match in MODEL_BUFFER.finditer(logs)}
    assert set(kv) == set(buffers) == set(CASES), logs[-3000:]

    for name, (_, ctx_size, parallel) in CASES.items():
        path = models / f"{name}.gguf"
        found = read_model(Unit(name, (path,)))
        kv_shape = shape(read_metadata(path))
        slots = parallel or 1
        planned = plan_model(
            name, found.weights, kv_shape, 1 << 40, context=ctx_size, parallel=slots
        )
        line = kv[name]
        streams = int(line["streams"])
        assert (int(line["seqs"]), streams) == ((4, 1) if parallel is None else (slots, slots))
        assert int(line["cells"]) * streams == kv_shape.cells(ctx_size, slots), name
        assert int(line["layers"]) == len(kv_shape.layers), name
        assert (line["ktype"], line["vtype"]) == ("f16", "f16")
        assert line["size"] == f"{planned.kv / MIB:.2f}", name  # exactly, to the engine's digits
        cells = kv_shape.cells(ctx_size, slots)
        k = cells * sum(
            row_size("f16", layer.kv_heads * layer.key_length) for layer in kv_shape.layers
        )
        assert (line["k"], line["v"]) == (f"{k / MIB:.2f}", f"{(planned.kv - k) / MIB:.2f}")
        logged = float(buffers[name]["size"]) * MIB
        assert buffers[name]["buffer"] == "CPU_Mapped"
        assert abs(found.weights - logged) <= 0.02 * logged, (name, found.weights, logged)
        assert found.weights == path.stat().st_size
