"""GGUF fixtures written with the real `gguf` package, and a model library to put them in."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
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


# A real, tiny llama-architecture model that llama-server loads and answers with on the CPU.

BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
VOCAB_SIZE = len(SPECIAL_TOKENS) + BYTE_TOKENS  # 259: byte-level SPM, every byte is a token


@dataclass(frozen=True)
class TinyLlama:
    """The shape of a tiny llama model; kv_heads must divide heads. key_length and value_length
    default to n_embd / heads; llama-server refuses a llama model whose two differ (the file is
    still written, for what only reads its metadata)."""

    layers: int = 2
    n_embd: int = 64
    heads: int = 4
    kv_heads: int | None = None
    key_length: int | None = None
    value_length: int | None = None
    context: int = 256
    n_ff: int = 128
    seed: int = 0

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_k(self) -> int:
        return self.key_length or self.n_embd // self.heads

    @property
    def head_v(self) -> int:
        return self.value_length or self.n_embd // self.heads

    def kv_cache_bytes(self, cells: int, bytes_per_element: int = 2) -> int:
        """K and V for every layer and cell (llama-server's default cache type is f16; it pads
        the context to a multiple of 256 cells)."""
        per_cell = self.n_kv_heads * (self.head_k + self.head_v) * bytes_per_element
        return self.layers * cells * per_cell


def write_llama(
    path: Path,
    shape: TinyLlama | None = None,
    *,
    split_max_tensors: int = 0,
    pooling: gguf.PoolingType | None = None,
) -> list[Path]:
    """Write a real llama GGUF at path; with split_max_tensors=N, gguf's own shards
    <stem>-0000i-of-0000K.gguf beside it instead. Returns the files written, first shard first.
    With `pooling`, its header declares that pooling type: an embedding model, which
    llama-server run with --embeddings answers /v1/embeddings with."""
    shape = shape or TinyLlama()
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    writer.add_name(path.stem)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_key_length(shape.head_k)
    writer.add_value_length(shape.head_v)
    writer.add_rope_dimension_count(shape.head_k)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    _add_byte_vocabulary(writer)
    for name, array in _llama_tensors(shape):
        writer.add_tensor(name, array)
    _finish(writer)
    if not split_max_tensors:
        return [path]
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    assert shards, sorted(p.name for p in path.parent.iterdir())
    return shards


def _add_byte_vocabulary(writer: gguf.GGUFWriter) -> None:
    tokens = [*SPECIAL_TOKENS, *(f"<0x{byte:02X}>" for byte in range(BYTE_TOKENS))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * BYTE_TOKENS
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _llama_tensors(shape: TinyLlama) -> list[tuple[str, np.ndarray[Any, np.dtype[np.float32]]]]:
    """numpy shapes are ggml's reversed: (rows, columns) = (out, in)."""
    rng = np.random.default_rng(shape.seed)

    def weights(*dims: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return (rng.standard_normal(dims) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.ones(n, dtype=np.float32)

    e, ff = shape.n_embd, shape.n_ff
    q = shape.heads * shape.head_k
    k, v = shape.n_kv_heads * shape.head_k, shape.n_kv_heads * shape.head_v
    tensors = [("token_embd.weight", weights(VOCAB_SIZE, e))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", ones(e)),
            (f"blk.{i}.attn_q.weight", weights(q, e)),
            (f"blk.{i}.attn_k.weight", weights(k, e)),
            (f"blk.{i}.attn_v.weight", weights(v, e)),
            (f"blk.{i}.attn_output.weight", weights(e, shape.heads * shape.head_v)),
            (f"blk.{i}.ffn_norm.weight", ones(e)),
            (f"blk.{i}.ffn_gate.weight", weights(ff, e)),
            (f"blk.{i}.ffn_up.weight", weights(ff, e)),
            (f"blk.{i}.ffn_down.weight", weights(e, ff)),
        ]
    tensors += [("output_norm.weight", ones(e)), ("output.weight", weights(VOCAB_SIZE, e))]
    return tensors


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
