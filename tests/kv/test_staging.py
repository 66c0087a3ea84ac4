"""lucia_kv.transfer's staged path through a recording Copies: one fixed host buffer, one wait.

The recording stands CPU tensors in for a device's (it answers "cuda" for every cache), so the
path a GPU takes runs here: how many host buffers it allocates (and whether pinned), how many
times it waits, and that the bytes still round-trip. A step of blocks that fit the buffer waits
once; a larger one once per buffer of blocks; after the first step nothing new is allocated on
the host. The real torch path is checked the same way on CUDA in tests/kv/test_transfer.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from lucia_kv.transfer import TORCH, Blocks  # noqa: E402

from tests.kv.test_transfer import NUM_BLOCKS, SHAPES, Layers, old_extract, registered  # noqa: E402


class Recording:
    """Copies over CPU tensors, treated as on `device`, that counts what it is asked."""

    def __init__(self, device: str) -> None:
        self.on = torch.device(device)
        self.hosts: list[tuple[tuple[int, ...], torch.dtype, bool]] = []  # (shape, dtype, pinned)
        self.stagings = 0
        self.syncs = 0
        self.blocking: set[bool] = set()  # the non_blocking flags its copies were given

    def device(self, cache: torch.Tensor) -> torch.device:
        return self.on

    def host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        self.hosts.append((shape, dtype, pinned))
        return torch.empty(shape, dtype=dtype)

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        assert device == self.on
        self.stagings += 1
        return torch.empty(shape, dtype=dtype)

    def copy(self, target: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        self.blocking.add(non_blocking)
        target.copy_(source)

    def synchronize(self, device: torch.device) -> None:
        assert device == self.on
        if device.type == "cuda":  # what torch's own does: elsewhere the copies block
            self.syncs += 1


def layers(seed: int, shape: str = "vllm 0.32 LBNHC") -> Layers:
    return registered(SHAPES[shape](3, torch.bfloat16, "cpu", seed))


def block_bytes() -> int:
    return Blocks(layers(0)).block_bytes


def steps(count: int) -> Iterator[list[int]]:
    """Block-id sets of `count` ids, a different one each step."""
    for step in range(3):
        yield [(step * 5 + n) % NUM_BLOCKS for n in range(count)]


# (device, blocks per buffer asked, blocks a step, blocks the buffer holds, waits a step)
CASES = [
    ("cuda", NUM_BLOCKS, 5, NUM_BLOCKS, 1),
    ("cuda", NUM_BLOCKS, NUM_BLOCKS, NUM_BLOCKS, 1),
    ("cuda", 100, NUM_BLOCKS, NUM_BLOCKS, 1),  # never more than the cache's blocks
    ("cuda", 5, NUM_BLOCKS, 5, math.ceil(NUM_BLOCKS / 5)),
    ("cuda", 5, 10, 5, 2),
    ("cuda", 1, 4, 1, 4),
    ("cuda", 0, 3, 1, 3),  # less than a block: one block
    ("cpu", 5, NUM_BLOCKS, 5, 0),  # a CPU layout without runs: staged, nothing to wait for
]


@pytest.mark.parametrize(("device", "asked", "count", "rows", "waits"), CASES)
def test_a_step_waits_once_per_buffer_and_allocates_the_host_buffer_once(
    device: str, asked: int, count: int, rows: int, waits: int
) -> None:
    size = block_bytes()
    copies = Recording(device)
    # a buffer of `asked` blocks and a little more: rounded down to whole blocks
    buffer_bytes = max(1, asked * size + size // 2)
    source = Blocks(layers(3), buffer_bytes=buffer_bytes, copies=copies)
    assert source.rows == rows
    for number, ids in enumerate(steps(count)):
        before = (len(copies.hosts), copies.syncs)
        saved = source.save(ids)
        assert saved == [old_extract(layers(3), block_id) for block_id in ids]
        source.load(list(zip(ids, saved, strict=True)))
        made, syncs = len(copies.hosts) - before[0], copies.syncs - before[1]
        assert syncs == 2 * waits, f"step {number}: a save and a load"
        assert made == (2 if number == 0 else 0), f"step {number}: host buffers allocated"
    assert [(shape, pinned) for shape, _, pinned in copies.hosts] == [
        ((rows, size), device == "cuda"),  # the blocks' bytes, pinned on CUDA
        ((rows,), device == "cuda"),  # their ids
    ]
    assert copies.stagings == (2 if device == "cuda" else 0)
    assert copies.blocking <= {device == "cuda"}


@pytest.mark.parametrize("buffer_blocks", [1, 3, NUM_BLOCKS])
@pytest.mark.parametrize("shape", SHAPES)
def test_blocks_round_trip_through_a_buffer_of_any_size(shape: str, buffer_blocks: int) -> None:
    source = registered(SHAPES[shape](2, torch.float16, "cpu", 21))
    target = registered(SHAPES[shape](2, torch.float16, "cpu", 22))
    for cache, _ in target:
        cache.view(torch.uint8).zero_()
    size = Blocks(source).block_bytes
    ids = [7, 2, 11, 0, 5]
    saved = Blocks(source, 1, size * buffer_blocks, Recording("cuda")).save(ids)
    assert saved == [old_extract(source, block_id) for block_id in ids]
    moves = list(zip(ids, saved, strict=True))
    Blocks(target, 1, size * buffer_blocks, Recording("cuda")).load(moves)
    assert Blocks(target).save(ids) == saved
    untouched = [b for b in range(NUM_BLOCKS) if b not in ids]
    assert not any(any(data) for data in Blocks(target).save(untouched))


def test_torchs_own_copies_allocate_the_host_buffer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real path on a CPU layout that is staged: torch.empty on the host at the first step
    only, however many steps and whatever their size."""
    calls: list[tuple[object, ...]] = []
    empty = torch.empty

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args)
        return empty(*args, **kwargs)

    source = layers(4)
    blocks = Blocks(source, buffer_bytes=4 * block_bytes(), copies=TORCH)
    monkeypatch.setattr(torch, "empty", counted)
    made = []
    for count in (3, NUM_BLOCKS, 1, NUM_BLOCKS):
        ids = list(range(count))
        saved = blocks.save(ids)
        blocks.load(list(zip(ids, saved, strict=True)))
        made.append(len(calls))
    assert made == [2, 2, 2, 2]  # the blocks' buffer and the ids', at the first step
