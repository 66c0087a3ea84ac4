"""GGUF fixtures written with the real `gguf` package, and a model library to put them in."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def write_gguf(path: Path, *, elements: int = 16, arch: str = "llama") -> Path:
    """A tiny real GGUF file (version 3): a few KV pairs and one float32 tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(path.stem)
    writer.add_context_length(128)
    writer.add_uint32("lucia.fixture", 1)
    writer.add_tensor("weight", np.arange(elements, dtype=np.float32))
    _finish(writer)
    return path


def write_split(directory: Path, prefix: str, count: int, *, elements: int = 16) -> list[Path]:
    """A split model by gguf's own splitter: <prefix>-0000i-of-0000N.gguf, a tensor in each."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(directory / f"{prefix}.gguf", "llama", split_max_tensors=1)
    writer.add_name(prefix)
    for index in range(count):
        writer.add_tensor(f"blk.{index}.weight", np.full(elements, index, dtype=np.float32))
    _finish(writer)
    shards = [directory / f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    assert all(shard.is_file() for shard in shards), sorted(p.name for p in directory.iterdir())
    return shards


def write_mmproj(path: Path) -> Path:
    return write_gguf(path, arch="clip")


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def set_version(path: Path, version: int) -> Path:
    """Patch the little-endian uint32 after the magic."""
    with path.open("r+b") as f:
        f.seek(4)
        f.write(version.to_bytes(4, "little"))
    return path


def break_magic(path: Path) -> Path:
    with path.open("r+b") as f:
        f.write(b"GGML")
    return path


def new_guid() -> str:
    return secrets.token_hex(16)


def add_model(
    models_dir: Path,
    state: str = "Ready",
    *,
    guid: str | None = None,
    listed: Sequence[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """<models>/<guid>/model.json (+ an empty files/); returns the files/ directory.

    listed=None leaves `files` out of model.json (the worker then scans files/)."""
    directory = models_dir / (guid or new_guid())
    (directory / "files").mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "id": directory.name,
        "displayName": "fixture",
        "state": state,
        "bytesTotal": 123,
        **(extra or {}),
    }
    if listed is not None:
        document["files"] = [{"name": name, "sizeBytes": 1} for name in listed]
    (directory / "model.json").write_text(json.dumps(document))
    return directory / "files"


def write_model(
    path: Path,
    *,
    arch: str = "llama",
    context: int = 2048,
    embedding: int = 64,
    blocks: int = 3,
    heads: int | Sequence[int] = 4,
    kv_heads: int | Sequence[int] | None = 2,
    key_length: int | None = None,
    value_length: int | None = None,
    interval: int | None = None,
    pooling: gguf.PoolingType | None = None,
    vocabulary: int = 0,
    elements: int = 16,
) -> Path:
    """A real GGUF file whose header says what the memory plan reads: block count, heads,
    KV heads (a number or one per layer), key/value lengths, full-attention interval."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(path.stem)
    writer.add_context_length(context)
    writer.add_embedding_length(embedding)
    writer.add_block_count(blocks)
    writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_length is not None:
        writer.add_key_length(key_length)
    if value_length is not None:
        writer.add_value_length(value_length)
    if interval is not None:
        writer.add_full_attention_interval(interval)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    if vocabulary:
        writer.add_token_list([f"token-{i}" for i in range(vocabulary)])
        writer.add_token_scores([0.0] * vocabulary)
    writer.add_tensor("weight", np.arange(elements, dtype=np.float32))
    _finish(writer)
    return path
