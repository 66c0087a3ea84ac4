"""lucia_kv.transfer over plain torch tensors laid out as vLLM 0.32's KV caches.

Bytes out equal the bytes of the old per-block copy (`old_extract` below, the connector's
algorithm before the batched transfer: stored blocks must stay readable), a save then a load
into a zeroed cache gives back exactly the blocks saved and leaves every other block alone, on
every layout, dtype and block-id subset here. Runs on the CPU always and on CUDA where torch
sees a device; needs only torch (`python -m pytest tests/kv/test_transfer.py`). On CUDA a step
also waits once per host buffer of blocks and pins its buffer once (tests/kv/test_staging.py
checks the same on the CPU through a recording of the copies).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from lucia_kv.transfer import Blocks, block_view  # noqa: E402

NUM_BLOCKS = 12
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available())"
        ),
    ),
]
# vLLM 0.32's layouts: logical [L, B, H, N, C], physical order (vllm/v1/kv_cache_layout.py)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}

Layers = list[tuple[torch.Tensor, int]]


def random_bytes(count: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).to(device)


def plain(shape: tuple[int, ...], dim: int) -> Callable[[int, torch.dtype, str, int], Layers]:
    """Layers of one contiguous tensor each, of `shape`, blocks along `dim`."""

    def make(layers: int, dtype: torch.dtype, device: str, seed: int) -> Layers:
        size = torch.empty((), dtype=dtype).element_size()
        count = 1
        for extent in shape:
            count *= extent
        return [
            (random_bytes(count * size, seed + n, device).view(dtype).view(shape), dim)
            for n in range(layers)
        ]

    return make


def vllm_views(
    layout: str, heads: int = 2, tokens: int = 4, content: int = 16, ratio: int = 1
) -> Callable[[int, torch.dtype, str, int], Layers]:
    """vLLM 0.32's per-layer [B, H, N, C] views of one shared int8 buffer
    (vllm/v1/kv_cache_interface.py create_kv_cache_views), C in elements of the dtype; with
    `ratio` > 1 each block split into kernel blocks, dim 0 counting NUM_BLOCKS * ratio."""

    def make(layers: int, dtype: torch.dtype, device: str, seed: int) -> Layers:
        size = torch.empty((), dtype=dtype).element_size()
        shape = (layers, NUM_BLOCKS * ratio, heads, tokens // ratio, content * size)
        strides = [0] * 5
        step = 1
        for dim in reversed(LAYOUTS[layout]):
            strides[dim] = step
            step *= shape[dim]
        raw = random_bytes(step, seed, device)
        view = torch.as_strided(raw, shape, tuple(strides))
        return [(view[n].view(dtype), 0) for n in range(layers)]

    return make


SHAPES = {
    # vLLM <= 0.10 flash-attn: (2, num_blocks, block_size, kv_heads, head_dim)
    "flash-attn (2, B, N, H, D)": plain((2, NUM_BLOCKS, 4, 2, 8), 1),
    # block-first: (num_blocks, 2, block_size, kv_heads, head_dim) (flashinfer NHD)
    "block-first (B, 2, N, H, D)": plain((NUM_BLOCKS, 2, 4, 2, 8), 0),
    # MLA: (num_blocks, block_size, kv_lora_rank + rope dim)
    "MLA (B, N, D)": plain((NUM_BLOCKS, 4, 24), 0),
    # vLLM 0.32's CPU backend: [B, H, N, 2 * head_size], layout LBHNC only
    "vllm 0.32 CPU / LBHNC": vllm_views("LBHNC"),
    "vllm 0.32 LBNHC": vllm_views("LBNHC"),
    "vllm 0.32 BLHNC (layers per block)": vllm_views("BLHNC"),
    "vllm 0.32 MLA [B, 1, N, C]": vllm_views("LBHNC", heads=1, content=24),
    "vllm 0.32 kernel blocks of N/2": vllm_views("LBHNC", ratio=2),
}


def registered(layers: Layers) -> Layers:
    """What the connector registers: each cache through block_view."""
    return [block_view(cache, NUM_BLOCKS) for cache, _ in layers]


def old_extract(layers: Layers, block_id: int) -> bytes:
    """The connector's per-block copy before the batched transfer (CPU tensors only: `.cpu()`
    stands in for where it raised on a device)."""
    parts = []
    for cache, dim in layers:
        block = cache.select(dim, block_id).contiguous().cpu()
        parts.append(bytes(block.view(torch.uint8).reshape(-1).tolist()))
    return b"".join(parts)


def subsets(seed: int) -> list[list[int]]:
    chooser = random.Random(seed)
    shuffled = chooser.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    return [
        [],
        [NUM_BLOCKS - 1],
        [0, NUM_BLOCKS - 1],
        chooser.sample(range(NUM_BLOCKS), 5),
        shuffled,
    ]


def layer_bytes(layers: Layers) -> list[torch.Tensor]:
    return [cache.contiguous().view(torch.uint8).cpu() for cache, _ in layers]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_saved_bytes_equal_the_old_per_block_copy(
    shape: str, dtype: torch.dtype, device: str
) -> None:
    layers = registered(SHAPES[shape](3, dtype, device, 7))
    blocks = Blocks(layers)
    for ids in subsets(len(shape)):
        expected = [old_extract(layers, block_id) for block_id in ids]
        assert blocks.save(ids) == expected
        assert all(len(data) == blocks.block_bytes for data in expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["a block per chunk", "one chunk"])
def test_a_round_trip_restores_the_blocks_and_nothing_else(
    shape: str, dtype: torch.dtype, device: str, chunk_bytes: int
) -> None:
    source = registered(SHAPES[shape](2, dtype, device, 11))
    target = registered(SHAPES[shape](2, dtype, device, 99))
    for cache, _ in target:
        cache.view(torch.uint8).zero_()
    saved = Blocks(source, chunk_bytes).save(ids := subsets(3)[3])
    Blocks(target, chunk_bytes).load(list(zip(ids, saved, strict=True)))
    for (want, dim), got in zip(source, layer_bytes(target), strict=True):
        want_bytes = want.view(torch.uint8).cpu()
        for block_id in range(NUM_BLOCKS):
            block = got.select(dim, block_id)
            if block_id in ids:
                assert torch.equal(block, want_bytes.select(dim, block_id)), block_id
            else:
                assert not block.any(), f"block {block_id} was written"


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_in_another_order_puts_each_block_in_its_place(device: str) -> None:
    make = SHAPES["vllm 0.32 BLHNC (layers per block)"]
    source = registered(make(4, torch.bfloat16, device, 5))
    saved = dict(enumerate(Blocks(source).save(list(range(NUM_BLOCKS)))))
    target = registered(make(4, torch.bfloat16, device, 6))
    moves = [(3, saved[7]), (7, saved[3]), (0, saved[0])]  # block 3's bytes into block 7, ...
    Blocks(target).load(moves)
    reread = Blocks(target).save([3, 7, 0])
    assert reread == [saved[7], saved[3], saved[0]]


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_load_writes_nothing(device: str) -> None:
    layers = registered(SHAPES["block-first (B, 2, N, H, D)"](2, torch.float16, device, 1))
    blocks = Blocks(layers)
    before = layer_bytes(layers)
    good = blocks.save([1])[0]
    other = bytes(reversed(good))
    for bad in (
        [(2, other), (3, good[:-1])],
        [(2, other), (NUM_BLOCKS, good)],
        [(-1, good)],
        [(4, good + b"x")],
    ):
        with pytest.raises(ValueError):
            blocks.load(bad)
        assert all(torch.equal(a, b) for a, b in zip(before, layer_bytes(layers), strict=True))
    with pytest.raises(ValueError):
        blocks.save([NUM_BLOCKS])
    assert blocks.save([]) == [] and blocks.load([]) is None


@pytest.mark.parametrize(
    ("shape", "num_blocks", "dim", "grouped"),
    [
        ((2, 5, 4, 2, 8), 5, 1, (2, 5, 4, 2, 8)),
        ((5, 2, 4, 2, 8), 5, 0, (5, 2, 4, 2, 8)),
        ((5, 4, 24), 5, 0, (5, 4, 24)),
        ((20, 2, 4, 16), 5, 0, (5, 4, 2, 4, 16)),  # four kernel blocks per block
        ((2, 2, 4, 8), 2, 0, (2, 2, 4, 8)),  # ambiguous: the first dim wins, as before
        ((6, 4), 4, 1, (6, 4)),
    ],
)
def test_block_view_finds_the_block_dim(
    shape: tuple[int, ...], num_blocks: int, dim: int, grouped: tuple[int, ...]
) -> None:
    view, found = block_view(torch.zeros(shape), num_blocks)
    assert (tuple(view.shape), found) == (grouped, dim)


@pytest.mark.parametrize(("shape", "num_blocks"), [((3, 7, 4), 5), ((7,), 5), ((4, 3), 0)])
def test_block_view_refuses_a_cache_without_blocks(shape: tuple[int, ...], num_blocks: int) -> None:
    with pytest.raises(ValueError, match="no dim of"):
        block_view(torch.zeros(shape), num_blocks)


def test_layers_that_disagree_are_refused() -> None:
    with pytest.raises(ValueError):
        Blocks([])
    with pytest.raises(ValueError):
        Blocks([(torch.zeros(4, 3), 0), (torch.zeros(5, 3), 0)])
    with pytest.raises(ValueError, match="no byte view"):
        Blocks([(torch.zeros(4, 3, 2).transpose(1, 2), 0)])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available())"
)
@pytest.mark.parametrize(("buffer_blocks", "count", "waits"), [(5, 3, 1), (5, NUM_BLOCKS, 3)])
def test_on_cuda_a_step_waits_once_per_buffer_and_pins_its_buffer_once(
    monkeypatch: pytest.MonkeyPatch, buffer_blocks: int, count: int, waits: int
) -> None:
    """torch's own copies: the waits counted at the stream's synchronize, the pinned buffers
    at the host allocator (torch.cuda.host_memory_stats: handouts, cached or new)."""
    layers = registered(SHAPES["vllm 0.32 CPU / LBHNC"](3, torch.bfloat16, "cuda", 8))
    size = Blocks(layers).block_bytes
    blocks = Blocks(layers, buffer_bytes=buffer_blocks * size)
    syncs: list[object] = []
    synchronize = torch.cuda.Stream.synchronize

    def counted(stream: object) -> None:
        syncs.append(stream)
        synchronize(stream)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: syncs.append("device"))

    def handouts() -> int | None:
        """Pinned blocks handed out so far; None where this torch does not count them."""
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        found = stats.get("active_requests.allocated")
        return None if found is None else int(found)

    ids = list(range(count))
    for step in range(3):
        before, syncs[:] = handouts(), []
        saved = blocks.save(ids)
        blocks.load(list(zip(ids, saved, strict=True)))
        assert len(syncs) == 2 * waits, f"step {step}: a save and a load"
        after = handouts()
        if before is not None and after is not None:
            pinned = after - before
            assert pinned >= 1 if step == 0 else pinned == 0, f"step {step}: {pinned} pinned"
        assert saved == [old_extract(layers, block_id) for block_id in ids]
