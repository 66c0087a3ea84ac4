"""A step's loads and saves a host buffer of blocks at a time, so host memory stays bounded.

The connector's side of lucia_kv.transfer: a load reads at most `rows` blocks from the store
(the blocks of one host buffer, `buffer_bytes`), writes them into the KV caches, then reads the
next; a save copies at most `rows` blocks out of the caches and hands their bytes to the store
(whose queues have their own byte bound) before the next. Only one batch's bytes are held at
once, whatever the step's size. A transfer that fails costs its batch, never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

log = logging.getLogger("lucia_kv")


class Moves(Protocol):
    """What lucia_kv.transfer.Blocks offers: blocks per buffer, and the moves."""

    @property
    def rows(self) -> int:
        """Blocks per host buffer."""

    def save(self, block_ids: Sequence[int]) -> list[bytes]:
        """The bytes of each block, in the order asked."""

    def load(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Each (block id, bytes) into the caches."""


def load(
    moves: Moves,
    requests: Iterable[Sequence[tuple[int, bytes]]],
    read: Callable[[bytes], bytes | None],
) -> set[int]:
    """Read each request's (block id, key) blocks and load them a batch at a time; the ids of
    the blocks not loaded (vLLM recomputes them).

    A request's blocks after its first failure (a read that found nothing, or a batch that did
    not load) are still read, so every damaged copy is found and removed now and the recomputed
    block is saved in its place, but not loaded."""
    errors: set[int] = set()
    failed: set[int] = set()  # the requests past their first failure
    batch: list[tuple[int, int, bytes]] = []  # (request, block id, bytes)

    def flush() -> None:
        if not batch:
            return
        try:
            moves.load([(block_id, data) for _, block_id, data in batch])
        except (RuntimeError, ValueError) as exc:  # recomputed, never the engine's end
            log.warning("%d KV blocks not loaded: %s", len(batch), exc)
            errors.update(block_id for _, block_id, _ in batch)
            failed.update(request for request, _, _ in batch)
        batch.clear()

    for request, blocks in enumerate(requests):
        for block_id, key in blocks:
            data = read(key)
            if data is None or request in failed:
                failed.add(request)
                errors.add(block_id)
                continue
            batch.append((request, block_id, data))
            if len(batch) >= moves.rows:
                flush()
    flush()
    return errors


def save(
    moves: Moves, blocks: Sequence[tuple[int, bytes]], store: Callable[[bytes, bytes], object]
) -> None:
    """Copy the (block id, key) blocks out of the caches a batch at a time and hand each
    block's bytes to `store` (key, bytes); a batch that fails is not saved, the next is."""
    rows = moves.rows
    for start in range(0, len(blocks), rows):
        part = blocks[start : start + rows]
        try:
            found = moves.save([block_id for block_id, _ in part])
        except (RuntimeError, ValueError) as exc:  # a cache, never the engine's end
            log.warning("%d KV blocks not saved: %s", len(part), exc)
            continue
        for (_, key), data in zip(part, found, strict=True):
            store(key, data)
