"""The KV formula over real GGUF headers written by the `gguf` package; figures worked by hand."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from supervisor.library.ggufcheck import Unreadable
from supervisor.library.ggufmeta import BadHeader, read_metadata
from supervisor.memplan.kv import CacheType, NotAModel, shape
from tests.gguf_fixtures import write_model

# (fixture arguments, attention layers, bytes per token with f16 K and V)
CASES: list[tuple[str, dict[str, Any], int, int]] = [
    # 3 layers x 2 KV heads x (16 + 16) x 2 B = 384 (key = value = 64 / 4 heads = 16)
    ("issue-example", {"blocks": 3, "heads": 4, "kv_heads": 2, "embedding": 64}, 3, 384),
    # no head_count_kv: KV heads = heads = 8; length 256 / 8 = 32: 5 x 8 x (32 + 32) x 2 = 5120
    ("no-gqa", {"blocks": 5, "heads": 8, "kv_heads": None, "embedding": 256}, 5, 5120),
    # explicit lengths win over 512 / 16 = 32: 2 x 4 x (128 + 64) x 2 = 3072
    (
        "gqa-explicit-lengths",
        {
            "blocks": 2,
            "heads": 16,
            "kv_heads": 4,
            "embedding": 512,
            "key_length": 128,
            "value_length": 64,
        },
        2,
        3072,
    ),
    # qwen3next, 8 blocks, interval 4: layers 3 and 7 hold KV: 2 x 2 x (256 + 256) x 2 = 4096
    (
        "qwen3next-interval-4",
        {
            "arch": "qwen3next",
            "blocks": 8,
            "heads": 16,
            "kv_heads": 2,
            "embedding": 2048,
            "key_length": 256,
            "value_length": 256,
            "interval": 4,
        },
        2,
        4096,
    ),
    # qwen35 without the key: default interval 4, 12 blocks -> layers 3, 7, 11:
    # 3 x 4 x (128 + 128) x 2 = 6144
    (
        "qwen35-default-interval",
        {
            "arch": "qwen35",
            "blocks": 12,
            "heads": 8,
            "kv_heads": 4,
            "embedding": 1024,
            "key_length": 128,
            "value_length": 128,
        },
        3,
        6144,
    ),
    # qwen3next, interval 2 over 6 blocks -> layers 1, 3, 5; 512 / 8 = 64:
    # 3 x 1 x (64 + 64) x 2 = 768
    (
        "qwen3next-interval-2",
        {
            "arch": "qwen3next",
            "blocks": 6,
            "heads": 8,
            "kv_heads": 1,
            "embedding": 512,
            "interval": 2,
        },
        3,
        768,
    ),
    # jamba-style per-layer KV heads, 0 on recurrent layers; 512 / 8 = 64:
    # layers 1 and 3 with 8 heads: 2 x 8 x (64 + 64) x 2 = 4096
    (
        "per-layer-kv-heads",
        {"arch": "jamba", "blocks": 4, "heads": 8, "kv_heads": [0, 8, 0, 8], "embedding": 512},
        2,
        4096,
    ),
    # per-layer KV heads that differ (64 / 4 heads = 16): (2 + 4 + 6) x (16 + 16) x 2 = 768
    (
        "per-layer-varied",
        {"blocks": 3, "heads": 4, "kv_heads": [2, 4, 6], "embedding": 64},
        3,
        768,
    ),
    # an interval arch ignores per-layer zeros only where the interval already excludes them:
    # qwen3next 4 blocks interval 2 -> layers 1, 3; kv [4, 0, 4, 4] -> layer 1 has 0: only 3:
    # 1 x 4 x (32 + 32) x 2 = 512 (256 / 8 = 32)
    (
        "interval-and-zero",
        {
            "arch": "qwen3next",
            "blocks": 4,
            "heads": 8,
            "kv_heads": [4, 0, 4, 4],
            "embedding": 256,
            "interval": 2,
        },
        1,
        512,
    ),
]


@pytest.mark.parametrize(("name", "args", "layers", "per_token"), CASES, ids=[c[0] for c in CASES])
def test_bytes_per_token(
    tmp_path: Path, name: str, args: dict[str, Any], layers: int, per_token: int
) -> None:
    kv = shape(read_metadata(write_model(tmp_path / f"{name}.gguf", **args)))
    assert len(kv.layers) == layers
    assert kv.bytes_per_token() == per_token
    assert not kv.embedding


@pytest.mark.parametrize(
    ("type_k", "type_v", "expected"),
    [
        ("f16", "f16", 384),  # 3 x 2 x 32 x 2
        ("f32", "f32", 768),  # 3 x 2 x 32 x 4
        ("f32", "f16", 576),  # 3 x (2 x 16 x 4 + 2 x 16 x 2) = 3 x (128 + 64)
        # a row is 2 heads x 16 = 32 elements = one q8_0 block of 34 B: 3 x (34 + 34) = 204
        ("q8_0", "q8_0", 204),
        ("q4_0", "f16", 3 * (18 + 64)),  # one q4_0 block 18 B + f16 row 64 B
    ],
)
def test_cache_types(tmp_path: Path, type_k: CacheType, type_v: CacheType, expected: int) -> None:
    kv = shape(read_metadata(write_model(tmp_path / "m.gguf")))
    assert kv.bytes_per_token(type_k, type_v) == expected


@pytest.mark.parametrize(
    ("native", "ctx_size", "parallel", "cells"),
    [
        (2048, 1024, 2, 1024),  # 2 sequences of 512 cells: the issue's 0.38 MiB = 1024 x 384
        (2048, 1024, 1, 1024),
        # what llama-server logged (tests/integration/test_memory_oracle.py): padded to 256,
        # never capped at the native context
        (128, 1024, 2, 1024),  # 2 x 512, past native 128 (llama.cpp only warns)
        (128, 1024, 1, 1024),
        (256, 300, 1, 512),  # one unified cache of 300 padded to 512
        (256, 300, 2, 512),  # 300 -> 512, 2 sequences of 256
        (4096, 1000, 3, 1536),  # 1000 -> 1024, // 3 = 341 -> 512 a sequence, x 3
        (256, 100, 1, 256),
        (0, 5000, 1, 5120),  # no native context in the header
    ],
)
def test_cells_are_padded_to_256_as_the_engine_allocates_them(
    tmp_path: Path, native: int, ctx_size: int, parallel: int, cells: int
) -> None:
    kv = shape(read_metadata(write_model(tmp_path / "m.gguf", context=native)))
    assert kv.cells(ctx_size, parallel) == cells
    assert kv.cache_bytes(ctx_size, parallel) == cells * 384


def test_issue_example_matches_the_logged_size(tmp_path: Path) -> None:
    kv = shape(read_metadata(write_model(tmp_path / "m.gguf", context=2048)))
    assert kv.cache_bytes(1024, 2) == 2 * 512 * 384 == 393_216  # llama-server: 0.38 MiB


@pytest.mark.parametrize(
    "args",
    [
        {"arch": "bert", "pooling": None},
        {"arch": "llama", "pooling": gguf.PoolingType.MEAN},  # e.g. a qwen3 embedding model
    ],
)
def test_embedding_models_have_no_kv(tmp_path: Path, args: dict[str, Any]) -> None:
    kv = shape(read_metadata(write_model(tmp_path / "e.gguf", **args)))
    assert kv.embedding
    assert kv.cache_bytes(8192, 4) == 0


def test_missing_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotAModel, match=r"llama\.block_count is missing"):
        shape(read_metadata(path))


def test_per_layer_array_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", blocks=3, kv_heads=[2, 2])
    with pytest.raises(NotAModel, match="not 3 counts"):
        shape(read_metadata(path))


# --- the header reader ----------------------------------------------------------------------


def test_header_values_and_vocabulary_are_stepped_over(tmp_path: Path) -> None:
    meta = read_metadata(write_model(tmp_path / "m.gguf", vocabulary=5000, context=4096))
    assert meta.architecture == "llama"
    assert meta.get("llama.context_length") == 4096
    assert meta.get("tokenizer.ggml.tokens") is None  # a string array: stepped over
    assert meta.get("tokenizer.ggml.scores") is None  # 5000 floats: longer than kept arrays
    assert meta.version == 3 and meta.tensor_count == 1


def _rchar() -> int:
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def test_reads_the_header_not_the_tensor_data(tmp_path: Path) -> None:
    path = write_model(tmp_path / "big.gguf", elements=16 * 1024 * 1024)  # 64 MiB of tensor
    assert path.stat().st_size > 64 * 1024 * 1024
    before = _rchar()
    read_metadata(path)
    read = _rchar() - before
    assert read <= 64 * 1024 + 4096, read  # the first chunk only


@pytest.mark.parametrize("cut", [8, 20, 30, 60])
def test_truncated_header(tmp_path: Path, cut: int) -> None:
    path = write_model(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(BadHeader, match="truncated GGUF header"):
        read_metadata(path)


def test_not_gguf_and_symlink(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"<html>not a model</html>")
    with pytest.raises(BadHeader, match="does not start with GGUF"):
        read_metadata(bad)
    link = tmp_path / "link.gguf"
    os.symlink(write_model(tmp_path / "m.gguf"), link)
    with pytest.raises(Unreadable, match="symlink"):
        read_metadata(link)


def test_keys_after_a_vocabulary_of_long_and_many_strings(tmp_path: Path) -> None:
    """Strings longer than a read chunk, and many short ones, are stepped over exactly: the
    keys after them still read right (the order the `gguf` writer keeps is the order added)."""
    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["x" * 70_000] * 3 + ["y"] * 100_000 + ["z" * 2_000_000])
    writer.add_context_length(77)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    meta = read_metadata(path)
    assert meta.get("llama.context_length") == 77
    assert meta.get("llama.block_count") == 2
    assert set(meta.values) <= set(gguf.GGUFReader(path).fields)
