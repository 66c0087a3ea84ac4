"""The connector's scheduler-side bookkeeping, with no vLLM in it: block keys, what to load and
what to save each step.

A block's key is a hash chain: SHA-256 of the previous block's key (the first block's, of the
engine's seed: the parallel layout and KV dtype), the block's token ids, and the request's
extras that touch the block (vLLM keys its own prefix cache with the same: the cache salt on the
first block, the LoRA adapter on every block, a multimodal item on the blocks its placeholder
range overlaps, the prompt embeddings of the block's positions). So a key names exactly one
prefix as the model saw it. Only full blocks are keyed, loaded or saved. A request whose extras
cannot be named the same way after a restart is not keyed at all: no lookup, no load, no save.
A request vLLM has skip reading cached KV (prompt logprobs, some pooling requests) matches
nothing in the tiers, and its blocks are saved as any other request's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def seed(tensor_parallel: int, pipeline_parallel: int, kv_dtype: str) -> bytes:
    """What shapes every block's bytes in one engine beyond its tokens, the request's extras
    and the namespace (which names the model): the parallel layout and the KV cache's dtype."""
    return f"tp{tensor_parallel}/pp{pipeline_parallel}/kv-{kv_dtype}".encode()


@dataclass(frozen=True)
class Extras:
    """What shapes a request's KV besides its token ids, as plain values that name the same
    thing after a restart (lucia_kv.extras reads them from a vLLM request)."""

    salt: str | None = None  # the request's cache_salt
    lora: tuple[str, str] | None = None  # the adapter's name and its files' digest
    mm: tuple[tuple[str, int, int], ...] = ()  # (content hash, offset, length) by offset
    embeds: tuple[bytes, ...] = ()  # per block: SHA-256 of its prompt embeddings' rows


NO_EXTRAS = Extras()


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<I", len(value)) + value


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def block_extras(extras: Extras, index: int, block_size: int) -> bytes:
    """The extras of block `index` as tagged, length-prefixed fields (empty when none touch
    it, so a request without extras keys its blocks by their tokens alone)."""
    start, end = index * block_size, (index + 1) * block_size
    fields = []
    if extras.lora is not None:
        fields += [_field(b"L", _text(extras.lora[0])), _field(b"D", _text(extras.lora[1]))]
    for identifier, offset, length in extras.mm:
        if offset < end and offset + length > start:
            where = struct.pack("<qq", offset - start, length)
            fields.append(_field(b"M", _text(identifier) + where))
    if index == 0 and extras.salt:
        fields.append(_field(b"S", _text(extras.salt)))
    if index < len(extras.embeds):
        fields.append(_field(b"E", extras.embeds[index]))
    return b"".join(fields)


def chain(
    tokens: Sequence[int],
    block_size: int,
    seed: bytes,
    start: Sequence[bytes] = (),
    extras: Extras = NO_EXTRAS,
) -> list[bytes]:
    """The keys of the full blocks of tokens (extending `start`, the keys already known)."""
    keys = list(start)
    previous = keys[-1] if keys else hashlib.sha256(b"lucia-kv chain v1\0" + seed).digest()
    for index in range(len(keys), len(tokens) // block_size):
        block = tokens[index * block_size : (index + 1) * block_size]
        packed = struct.pack(f"<{block_size}q", *block)
        previous = hashlib.sha256(
            previous + packed + block_extras(extras, index, block_size)
        ).digest()
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class Transfer:
    """One request's blocks to move this step: (vLLM block id, key) pairs."""

    request_id: str
    blocks: tuple[tuple[int, bytes], ...]


@dataclass
class StepPlan:
    """What the worker does this step (picklable: it crosses to the worker process)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    unkeyable: int = 0  # requests the tiers skipped since the last plan (their extras)
    read_skipped: int = 0  # requests matched to nothing since the last plan (vLLM's word)


@dataclass
class _Request:
    keys: list[bytes]
    block_ids: list[int]
    saved: int  # blocks [0, saved) are stored or were loaded/cached already
    load: tuple[int, int] | None = None  # blocks [first, end) to load in the next step
    extras: Extras | None = NO_EXTRAS  # None: no longer keyable, saves nothing more


@dataclass
class _CountedOnce:
    """Requests counted once each until they finish: the ones held, and how many of them the
    next plan has yet to count."""

    held: set[str] = field(default_factory=set)
    new: int = 0

    def add(self, request_id: str) -> None:
        if request_id not in self.held:
            self.held.add(request_id)
            self.new += 1

    def take(self) -> int:
        """The count the next plan says; 0 after it."""
        count, self.new = self.new, 0
        return count


class Scheduling:
    """Tracks requests between the scheduler's calls and turns a step into a StepPlan."""

    def __init__(self, block_size: int, seed: bytes) -> None:
        self.block_size = block_size
        self.seed = seed
        self._requests: dict[str, _Request] = {}
        self._matched: dict[str, tuple[int, list[bytes], Extras]] = {}  # last lookup
        self._finished: list[str] = []
        self._unkeyable = _CountedOnce()  # skipped requests not yet finished
        self._read_skipped = _CountedOnce()  # requests told to skip reads, not yet finished

    def prompt_keys(self, prompt: Sequence[int], extras: Extras = NO_EXTRAS) -> list[bytes]:
        """Keys of the prompt's full blocks, leaving at least one token for vLLM to compute."""
        usable = max(0, len(prompt) - 1) // self.block_size * self.block_size
        return chain(prompt[:usable], self.block_size, self.seed, extras=extras)

    def matched(
        self,
        request_id: str,
        local_tokens: int,
        keys: list[bytes],
        hits: int,
        extras: Extras = NO_EXTRAS,
    ) -> int:
        """Record a lookup (hits leading blocks found); the new tokens the store can give."""
        tokens = hits * self.block_size
        self._matched[request_id] = (local_tokens, keys, extras)
        return max(0, tokens - local_tokens)

    def read_skipped(self, request_id: str, local_tokens: int, extras: Extras = NO_EXTRAS) -> int:
        """Record a request vLLM has skip reading cached KV: it matches 0 tokens (no lookup,
        no load), its blocks are saved as any other's, and the next plan counts it once."""
        self._matched[request_id] = (local_tokens, [], extras)
        self._read_skipped.add(request_id)
        return 0

    def unkeyable(self, request_id: str) -> None:
        """A request whose extras have no stable name: the tiers skip it (no lookup, load or
        save from now on), and the next plan counts it once."""
        self._matched.pop(request_id, None)
        known = self._requests.get(request_id)
        if known is not None:
            known.extras = None
        self._unkeyable.add(request_id)

    def allocated(self, request_id: str, block_ids: Sequence[int], external_tokens: int) -> None:
        """After vLLM allocated blocks: plan the load of the external tokens."""
        if request_id in self._unkeyable.held:
            return
        local, keys, extras = self._matched.pop(request_id, (0, [], NO_EXTRAS))
        first = local // self.block_size
        end = (local + external_tokens) // self.block_size
        known = self._requests.get(request_id)
        if known is None:
            known = _Request(keys=keys, block_ids=list(block_ids), saved=end, extras=extras)
            self._requests[request_id] = known
        else:
            known.block_ids = list(block_ids)
            known.saved = max(known.saved, end)
        known.load = (first, end) if external_tokens > 0 else None

    def step(
        self,
        scheduled: Sequence[tuple[str, Sequence[int] | None, bool, int, int]],
        tokens_of: Mapping[str, Sequence[int]],
        extras_of: Mapping[str, Extras | None] | None = None,
    ) -> StepPlan:
        """A StepPlan from this step's requests: (id, new block ids or None, whether they
        replace the old ones, tokens computed before the step, tokens scheduled in it);
        tokens_of gives each request's token ids so far, extras_of its extras now where they
        may have grown (a streaming session's new multimodal items; None: unkeyable)."""
        for request_id, *_ in scheduled:
            if extras_of is not None and request_id in extras_of:
                extras = extras_of[request_id]
                if extras is None:
                    self.unkeyable(request_id)
                elif request_id in self._requests and request_id not in self._unkeyable.held:
                    self._requests[request_id].extras = extras
        plan = StepPlan(
            finished=self._finished,
            unkeyable=self._unkeyable.take(),
            read_skipped=self._read_skipped.take(),
        )
        self._finished = []
        for request_id, new_blocks, replace, computed, scheduled_tokens in scheduled:
            known = self._requests.get(request_id)
            if known is None:
                continue
            if new_blocks is not None:
                known.block_ids = (
                    list(new_blocks) if replace else known.block_ids + list(new_blocks)
                )
            if known.load is not None:
                first, end = known.load
                plan.loads.append(self._transfer(request_id, known, first, end))
                known.load = None
            # vLLM computes what was thought stored (a failed load, a preemption): save it again
            known.saved = min(known.saved, computed // self.block_size)
            tokens = tokens_of.get(request_id, ())
            done = min(computed + scheduled_tokens, len(tokens)) // self.block_size
            done = min(done, len(known.block_ids))
            if done > known.saved and known.extras is not None:
                known.keys = chain(
                    tokens[: done * self.block_size],
                    self.block_size,
                    self.seed,
                    known.keys,
                    known.extras,
                )
                plan.saves.append(self._transfer(request_id, known, known.saved, done))
                known.saved = done
        return plan

    def finished(self, request_id: str) -> None:
        self._matched.pop(request_id, None)
        self._unkeyable.held.discard(request_id)
        self._read_skipped.held.discard(request_id)
        if self._requests.pop(request_id, None) is not None:
            self._finished.append(request_id)

    @staticmethod
    def _transfer(request_id: str, known: _Request, first: int, end: int) -> Transfer:
        return Transfer(
            request_id,
            tuple((known.block_ids[i], known.keys[i]) for i in range(first, end)),
        )
