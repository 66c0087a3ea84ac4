"""lucia_kv.batches: a step's loads and saves a host buffer of blocks at a time.

A fake of Blocks records each move and how many blocks' bytes were read from the store and
not yet loaded at each moment: never more than a buffer's (`rows`), however many blocks the
step has. The connector's rules hold across batches: a request's blocks after its first miss
are read (so damaged copies are found) but not loaded and are reported, a batch that fails to
load is reported and never raises, and a save hands every block's bytes to the store in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from lucia_kv import batches


class Moves:
    """Blocks' interface over a dict of block id to bytes, recording every move."""

    def __init__(self, rows: int, failing: Sequence[int] = ()) -> None:
        self.rows = rows
        self.cache: dict[int, bytes] = {}
        self.loads: list[list[int]] = []
        self.saves: list[list[int]] = []
        self.failing = set(failing)  # the load or save calls (0, 1, ...) that raise
        self.held = 0  # bytes read from the store, not yet loaded
        self.most = 0

    def read(self, key: bytes) -> bytes | None:
        if key.startswith(b"miss"):
            return None
        self.held += 1
        self.most = max(self.most, self.held)
        return b"data " + key

    def load(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        self.loads.append([block_id for block_id, _ in blocks])
        self.held = 0  # the connector drops the batch's bytes after the move
        if len(self.loads) - 1 in self.failing:
            raise RuntimeError("CUDA error: an illegal memory access")
        self.cache.update(blocks)

    def save(self, block_ids: Sequence[int]) -> list[bytes]:
        self.saves.append(list(block_ids))
        if len(self.saves) - 1 in self.failing:
            raise ValueError("KV block ids outside")
        return [b"block %d" % block_id for block_id in block_ids]


def request(first: int, count: int, misses: Sequence[int] = ()) -> list[tuple[int, bytes]]:
    """Blocks first..first+count-1, the keys of `misses` (positions) absent from the store."""
    return [
        (first + n, (b"miss %d" if n in misses else b"key %d") % (first + n)) for n in range(count)
    ]


@pytest.mark.parametrize(("rows", "count"), [(1, 5), (4, 10), (8, 8), (64, 10), (3, 0)])
def test_loads_hold_at_most_one_buffer_of_bytes(rows: int, count: int) -> None:
    moves = Moves(rows)
    errors = batches.load(
        moves, [request(0, count // 2), request(100, count - count // 2)], moves.read
    )
    assert errors == set()
    assert moves.most <= rows
    assert len(moves.loads) == math.ceil(count / rows)
    assert all(len(batch) <= rows for batch in moves.loads)
    assert sorted(moves.cache) == sorted(b for r in moves.loads for b in r)
    assert len(moves.cache) == count


@pytest.mark.parametrize(
    ("rows", "misses", "loaded", "errors"),
    [
        (2, (), [0, 1, 2, 3, 4, 5], set()),
        (2, (2,), [0, 1], {2, 3, 4, 5}),  # a miss: the rest of the request is not loaded
        (4, (0,), [], {0, 1, 2, 3, 4, 5}),
        (1, (5,), [0, 1, 2, 3, 4], {5}),
    ],
)
def test_a_requests_blocks_after_a_miss_are_read_but_not_loaded(
    rows: int, misses: tuple[int, ...], loaded: list[int], errors: set[int]
) -> None:
    moves = Moves(rows)
    asked: list[bytes] = []

    def read(key: bytes) -> bytes | None:
        asked.append(key)
        return moves.read(key)

    other = request(50, 3)
    found = batches.load(moves, [request(0, 6, misses), other], read)
    assert found == errors
    assert len(asked) == 6 + 3  # every block read, damaged copies found
    assert sorted(moves.cache) == [*loaded, 50, 51, 52]  # the other request loads whole


@pytest.mark.parametrize(
    ("rows", "failing", "errors", "loaded"),
    [
        (8, (0,), {0, 1, 2, 3, 10, 11}, []),  # one batch, the step's: all recomputed
        (2, (0,), {0, 1, 2, 3}, [10, 11]),  # request 0 failed: its later batch not loaded
        (2, (1,), {2, 3}, [0, 1, 10, 11]),
        (3, (1,), {3, 10, 11}, [0, 1, 2]),  # a batch across two requests fails both
    ],
)
def test_a_batch_that_does_not_load_is_reported_and_the_rest_goes_on(
    rows: int, failing: tuple[int, ...], errors: set[int], loaded: list[int]
) -> None:
    moves = Moves(rows, failing)
    assert batches.load(moves, [request(0, 4), request(10, 2)], moves.read) == errors
    assert sorted(moves.cache) == loaded


@pytest.mark.parametrize(
    ("rows", "count", "failing", "stored"),
    [
        (4, 10, (), list(range(10))),
        (16, 10, (), list(range(10))),
        (1, 3, (), [0, 1, 2]),
        (4, 10, (1,), [0, 1, 2, 3, 8, 9]),  # the failed batch is lost, the next saved
        (4, 0, (), []),
    ],
)
def test_saves_go_to_the_store_a_batch_at_a_time(
    rows: int, count: int, failing: tuple[int, ...], stored: list[int]
) -> None:
    moves = Moves(rows, failing)
    blocks = [(n, b"key %d" % n) for n in range(count)]
    got: list[tuple[bytes, bytes]] = []
    batches.save(moves, blocks, lambda key, data: got.append((key, data)))
    assert [len(batch) for batch in moves.saves] == [
        min(rows, count - start) for start in range(0, count, rows)
    ]
    assert got == [(b"key %d" % n, b"block %d" % n) for n in stored]
