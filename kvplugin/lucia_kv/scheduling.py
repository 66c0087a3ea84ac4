"""The connector's scheduler-side bookkeeping, with no vLLM in it: block keys, what to load and
what to save each step.

A block's key is a hash chain over the token ids of the full blocks up to it (and a seed that
names what else shapes the KV: the parallel rank, a LoRA adapter), so a key names exactly one
prefix. Only full blocks are keyed, loaded or saved.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def chain(
    tokens: Sequence[int], block_size: int, seed: bytes, start: Sequence[bytes] = ()
) -> list[bytes]:
    """The keys of the full blocks of tokens (extending `start`, the keys already known)."""
    keys = list(start)
    previous = keys[-1] if keys else hashlib.sha256(b"lucia-kv chain v1\0" + seed).digest()
    for index in range(len(keys), len(tokens) // block_size):
        block = tokens[index * block_size : (index + 1) * block_size]
        previous = hashlib.sha256(previous + struct.pack(f"<{block_size}q", *block)).digest()
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


@dataclass
class _Request:
    keys: list[bytes]
    block_ids: list[int]
    saved: int  # blocks [0, saved) are stored or were loaded/cached already
    load: tuple[int, int] | None = None  # blocks [first, end) to load in the next step


class Scheduling:
    """Tracks requests between the scheduler's calls and turns a step into a StepPlan."""

    def __init__(self, block_size: int, seed: bytes) -> None:
        self.block_size = block_size
        self.seed = seed
        self._requests: dict[str, _Request] = {}
        self._matched: dict[str, tuple[int, list[bytes]]] = {}  # last lookup per request
        self._finished: list[str] = []

    def prompt_keys(self, prompt: Sequence[int]) -> list[bytes]:
        """Keys of the prompt's full blocks, leaving at least one token for vLLM to compute."""
        usable = max(0, len(prompt) - 1) // self.block_size * self.block_size
        return chain(prompt[:usable], self.block_size, self.seed)

    def matched(self, request_id: str, local_tokens: int, keys: list[bytes], hits: int) -> int:
        """Record a lookup (hits leading blocks found); the new tokens the store can give."""
        tokens = hits * self.block_size
        self._matched[request_id] = (local_tokens, keys)
        return max(0, tokens - local_tokens)

    def allocated(self, request_id: str, block_ids: Sequence[int], external_tokens: int) -> None:
        """After vLLM allocated blocks: plan the load of the external tokens."""
        local, keys = self._matched.pop(request_id, (0, []))
        first = local // self.block_size
        end = (local + external_tokens) // self.block_size
        known = self._requests.get(request_id)
        if known is None:
            known = _Request(keys=keys, block_ids=list(block_ids), saved=end)
            self._requests[request_id] = known
        else:
            known.block_ids = list(block_ids)
            known.saved = max(known.saved, end)
        known.load = (first, end) if external_tokens > 0 else None

    def step(
        self,
        scheduled: Sequence[tuple[str, Sequence[int] | None, bool, int, int]],
        tokens_of: Mapping[str, Sequence[int]],
    ) -> StepPlan:
        """A StepPlan from this step's requests: (id, new block ids or None, whether they
        replace the old ones, tokens computed before the step, tokens scheduled in it);
        tokens_of gives each request's token ids so far."""
        plan = StepPlan(finished=self._finished)
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
            if done > known.saved:
                known.keys = chain(
                    tokens[: done * self.block_size], self.block_size, self.seed, known.keys
                )
                plan.saves.append(self._transfer(request_id, known, known.saved, done))
                known.saved = done
        return plan

    def finished(self, request_id: str) -> None:
        self._matched.pop(request_id, None)
        if self._requests.pop(request_id, None) is not None:
            self._finished.append(request_id)

    @staticmethod
    def _transfer(request_id: str, known: _Request, first: int, end: int) -> Transfer:
        return Transfer(
            request_id,
            tuple((known.block_ids[i], known.keys[i]) for i in range(first, end)),
        )
