"""A model's KV cache, from its GGUF header: which layers hold one, and their bytes per token.

The facts below are llama.cpp's, read in ggml-org/llama.cpp:
- src/llama-model.cpp (load_hparams): `<arch>.block_count` layers; `<arch>.attention.head_count`
  and `<arch>.attention.head_count_kv` are a number or one number per layer, head_count_kv
  defaulting to head_count; key and value length default to `embedding_length / n_head()`
  (n_head() being layer 0's head count, 0 when it has none) unless
  `<arch>.attention.key_length` / `.value_length` say otherwise.
- src/llama-hparams.cpp: a layer's K row is `key_length * head_count_kv(layer)` elements (V
  alike); src/llama-kv-cache.cpp sizes each layer's K and V as ggml_row_size(type, row) per
  cell, for the layers the memory's filter keeps.
- src/llama-arch.cpp (llm_arch_is_hybrid) and src/llama-model.cpp: hybrid models keep a KV cache
  only for their non-recurrent layers. qwen3next, qwen35 and qwen35moe mark layer i recurrent
  unless (i + 1) % `<arch>.full_attention_interval` == 0 (default 4), or per layer by
  `<arch>.attention.recurrent_layers` where present; the others (jamba, nemotron_h,
  granitehybrid, lfm2, plamo2...) write head_count_kv per layer with 0 on recurrent layers.
- ggml/src/ggml.c (type traits): f32 4 bytes, f16 and bf16 2; q8_0 34 bytes per 32 elements,
  q4_0 18, q4_1 20, q5_0 22, q5_1 24, iq4_nl 18.

Not modelled, so over-counted (safe): sliding-window layers (their cache is the window, not the
context) and MLA's compressed cache (deepseek2); they are planned at full size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from supervisor.library.ggufmeta import Metadata, Value

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
# cache type -> (elements per block, bytes per block)
_BLOCKS: Final[dict[str, tuple[int, int]]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}
CACHE_TYPES: Final = tuple(_BLOCKS)
INTERVAL_ARCHS: Final = frozenset({"qwen3next", "qwen35", "qwen35moe"})
DEFAULT_INTERVAL: Final = 4
CELL_PAD: Final = 256  # llama.cpp pads the context (and each sequence's cache) to this
# encoder-only architectures: embedding models, no KV cache (llama.cpp src/llama-arch.cpp names)
ENCODER_ARCHS: Final = frozenset(
    {
        "bert",
        "modern-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "t5encoder",
    }
)


class NotAModel(ValueError):
    """The header lacks what planning needs; str() names the file and the key."""


@dataclass(frozen=True)
class Layer:
    """One layer that holds KV: its KV heads and per-head key and value lengths."""

    kv_heads: int
    key_length: int
    value_length: int


@dataclass(frozen=True)
class KvShape:
    """What the KV cache of one model is made of. `layers` lists only layers that hold KV."""

    architecture: str
    native_context: int
    block_count: int
    layers: tuple[Layer, ...]
    embedding: bool = False

    def bytes_per_token(self, type_k: CacheType = "f16", type_v: CacheType = "f16") -> int:
        """Sum over KV layers of K row + V row: layers x KV heads x (key + value) x 2 for f16."""
        return sum(
            row_size(type_k, layer.kv_heads * layer.key_length)
            + row_size(type_v, layer.kv_heads * layer.value_length)
            for layer in self.layers
        )

    def cells(self, ctx_size: int, parallel: int = 1) -> int:
        """KV cells llama-server allocates for ctx_size, as the real engine logs them
        (tests/integration/test_memory_oracle.py): ctx_size is padded up to a multiple of 256;
        with parallel 1 (or llama-server's auto: 4 slots, one unified cache) that is all of it;
        with an explicit parallel N, N caches of (padded // N) padded up to 256 again. It is
        not capped at the native context (llama.cpp only warns of an overflow)."""
        if parallel < 1 or ctx_size < 0:
            raise ValueError("parallel must be at least 1 and ctx_size not negative")
        padded = _pad(ctx_size)
        if parallel == 1:
            return padded
        return _pad(padded // parallel) * parallel

    def cache_bytes(
        self,
        ctx_size: int,
        parallel: int = 1,
        type_k: CacheType = "f16",
        type_v: CacheType = "f16",
    ) -> int:
        """Total KV bytes for ctx_size tokens over parallel sequences (the engine's own log:
        `llama_kv_cache: size = ...`)."""
        if self.embedding:
            return 0
        return self.cells(ctx_size, parallel) * self.bytes_per_token(type_k, type_v)


def _pad(cells: int) -> int:
    return -(-cells // CELL_PAD) * CELL_PAD


def row_size(cache_type: CacheType, elements: int) -> int:
    """ggml_row_size: bytes of a row of elements of this type."""
    block, size = _BLOCKS[cache_type]
    if elements % block:
        raise ValueError(f"a {cache_type} KV row needs a multiple of {block} elements")
    return elements // block * size


def _number(meta: Metadata, suffix: str, default: int | None = None) -> int:
    value = meta.arch_key(suffix)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        key = f"{meta.architecture}.{suffix}"
        what = "missing" if value is None else f"not a count ({value!r})"
        raise NotAModel(f"{meta.path}: {key} is {what}")
    return value


def _per_layer(meta: Metadata, suffix: str, layers: int, default: tuple[int, ...]) -> list[int]:
    value: Value | None = meta.arch_key(suffix)
    if value is None:
        return list(default)
    if isinstance(value, tuple):
        if len(value) != layers or not all(_is_count(v) for v in value):
            raise NotAModel(
                f"{meta.path}: {meta.architecture}.{suffix} is not {layers} counts, one a layer"
            )
        return [int(v) for v in value]
    if not _is_count(value):
        raise NotAModel(f"{meta.path}: {meta.architecture}.{suffix} is not a count ({value!r})")
    return [int(value)] * layers


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _head_length(meta: Metadata, suffix: str, first_heads: int) -> int:
    """The explicit key or value length, else embedding_length / layer 0's heads (0 if none)."""
    if meta.arch_key(suffix) is not None:
        return _number(meta, suffix)
    return _number(meta, "embedding_length") // first_heads if first_heads else 0


def is_embedding(meta: Metadata) -> bool:
    """An encoder-only architecture, or a header with a pooling type (an embedding model)."""
    pooling = meta.arch_key("pooling_type")
    pooled = isinstance(pooling, int) and not isinstance(pooling, bool) and pooling > 0
    return meta.architecture in ENCODER_ARCHS or pooled


def recurrent_layers(meta: Metadata, block_count: int) -> tuple[bool, ...]:
    """Which layers are recurrent (hold no KV): from the interval for the Qwen hybrids."""
    arch = meta.architecture
    explicit = meta.arch_key("attention.recurrent_layers")
    if isinstance(explicit, tuple) and len(explicit) == block_count:
        return tuple(bool(flag) for flag in explicit)
    if arch in INTERVAL_ARCHS:
        interval = _number(meta, "full_attention_interval", DEFAULT_INTERVAL)
        if interval < 1:
            raise NotAModel(f"{meta.path}: {arch}.full_attention_interval must be at least 1")
        return tuple((index + 1) % interval != 0 for index in range(block_count))
    return (False,) * block_count


def shape(meta: Metadata) -> KvShape:
    """The KV shape of a model file (the main file, shard 1 of a split model)."""
    arch = meta.architecture
    if not arch:
        raise NotAModel(f"{meta.path}: general.architecture is missing")
    native = _number(meta, "context_length", 0)
    if is_embedding(meta):
        return KvShape(arch, native, _number(meta, "block_count", 0), (), embedding=True)
    blocks = _number(meta, "block_count")
    heads = _per_layer(meta, "attention.head_count", blocks, ())
    if not heads:
        raise NotAModel(f"{meta.path}: {arch}.attention.head_count is missing")
    kv_heads = _per_layer(meta, "attention.head_count_kv", blocks, tuple(heads))
    key_length = _head_length(meta, "attention.key_length", heads[0])
    value_length = _head_length(meta, "attention.value_length", heads[0])
    recurrent = recurrent_layers(meta, blocks)
    layers = tuple(
        Layer(kv_heads[index], key_length, value_length)
        for index in range(blocks)
        if not recurrent[index] and kv_heads[index] > 0
    )
    return KvShape(arch, native, blocks, layers)
