"""What a start needs: per model its weights, KV bytes per token, context and need in bytes.

The operators' guide's plan, for one model given the room it may use (`budget`: the limit less
the reserves and what others hold):

    cacheBudget = budget - weights * WeightMemoryMultiplier
    context     = min(nativeContext, cacheBudget / kvBytesPerToken), rounded down to 256

The rounding applies to the budget's figure; a native context below 256 (tiny models) is kept.
With parallel sequences the context is the engine's ctx-size (all sequences together), a
multiple of 256 a sequence, and the plan keeps each sequence within the native context
(llama-server itself does not cap it, and pads every cache to 256 cells: kv.cells).
Embedding models count at their file size: no KV cache and no multiplier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from supervisor.memplan.kv import CacheType, KvShape

ROUND: Final = 256
Context = int | Literal["auto"]


@dataclass(frozen=True)
class ModelNeed:
    """One model's figures. context 0 with auto: it does not fit even with no KV cache."""

    name: str
    weights: int
    kv_per_token: int
    context: int
    kv: int
    multiplier: float = 2.0
    parallel: int = 1
    embedding: bool = False

    @property
    def weights_cost(self) -> int:
        return math.ceil(self.weights * self.multiplier)

    @property
    def need(self) -> int:
        return self.weights_cost + self.kv


@dataclass(frozen=True)
class EngineNeed:
    """What one engine's start needs: its models planned together."""

    engine: str
    models: tuple[ModelNeed, ...]
    lower: str = "Lower CONTEXT"  # the refusal's advice, before "or stop <others>"
    shares: tuple[tuple[str, int], ...] = ()  # named parts of the need a refusal says

    @property
    def need(self) -> int:
        return sum(model.need for model in self.models)

    @property
    def subject(self) -> str:
        names = [model.name for model in self.models]
        if len(names) == 1 and names[0] != self.engine:
            return f"The model {names[0]}"
        if len(names) > 1:
            return f"The models {', '.join(names)}"
        return "The model"


def planned_context(shape: KvShape, room: int, parallel: int = 1, **types: CacheType) -> int:
    """The largest ctx-size whose KV fits in room bytes: min(native x parallel, room / per
    token) with the room's figure rounded down to 256; 0 when not even 256 tokens fit."""
    per_token = shape.bytes_per_token(**types)
    if per_token == 0:
        return shape.native_context * parallel
    step = ROUND * parallel  # each sequence's cache is padded to 256 cells too
    by_room = max(room, 0) // per_token // step * step
    if shape.native_context <= 0:
        return by_room
    native = shape.native_context * parallel
    if native <= by_room and shape.cells(native, parallel) * per_token <= max(room, 0):
        return native  # a native context below 256 is padded by the engine: it must fit too
    return min(by_room, native // step * step) if native > by_room else by_room


def plan_model(
    name: str,
    weights: int,
    shape: KvShape,
    room: int,
    *,
    context: Context = "auto",
    parallel: int = 1,
    multiplier: float = 2.0,
    type_k: CacheType = "f16",
    type_v: CacheType = "f16",
) -> ModelNeed:
    """Plan one model in room bytes; a fixed context is taken as asked (it may not fit)."""
    if shape.embedding:
        return ModelNeed(name, weights, 0, shape.native_context, 0, 1.0, parallel, True)
    per_token = shape.bytes_per_token(type_k, type_v)
    cost = math.ceil(weights * multiplier)
    if context == "auto":
        chosen = planned_context(shape, room - cost, parallel, type_k=type_k, type_v=type_v)
    else:
        chosen = context
    kv = shape.cache_bytes(chosen, parallel, type_k, type_v)
    return ModelNeed(name, weights, per_token, chosen, kv, multiplier, parallel)


def figures(
    name: str,
    weights: int,
    kv_per_token: int,
    context: int,
    *,
    parallel: int = 1,
    multiplier: float = 2.0,
    kv: int | None = None,
) -> ModelNeed:
    """A model whose figures come from its recipe (tensorfold), not from a GGUF header:
    kv defaults to kv_per_token x context."""
    total = kv_per_token * context if kv is None else kv
    return ModelNeed(name, weights, kv_per_token, context, total, multiplier, parallel)


def share_room(room: int, shapes: Sequence[tuple[int, KvShape]], multiplier: float) -> int:
    """Each model's KV room when several load together: the room left after all their
    weights, split evenly (embedding models need none of it)."""
    weights = sum(
        size if shape.embedding else math.ceil(size * multiplier) for size, shape in shapes
    )
    sharing = sum(1 for _, shape in shapes if not shape.embedding) or 1
    return (room - weights) // sharing
