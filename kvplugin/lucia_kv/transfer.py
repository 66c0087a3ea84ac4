"""KV blocks between vLLM's paged KV cache and host bytes, a step's blocks at once (torch only).

A block's bytes are, for each layer in the order given, that layer's slice of the block in the
logical order of the cache's dims (what `cache.select(block_dim, id).contiguous()` holds), so
blocks stored before keep reading back.

On a device (the GPU), blocks go through one host staging buffer, pinned on CUDA, allocated
once and reused: `rows` blocks of at most `buffer_bytes` (fewer when the cache has fewer). A
save gathers every layer's blocks into a device buffer of at most `chunk_bytes` (one gather per
layer), copies it to the host in one piece, and waits once; a load copies the blocks' bytes into
the host buffer, moves it to the device in one piece per chunk, scatters it into every layer,
and waits once. That is one wait per step while a step's blocks fit the host buffer, and one
wait per buffer of blocks when they do not (the buffer is refilled only after its copies have
finished). This is the shape of vLLM's own offloading worker
(vllm/v1/kv_offload/cpu/gpu_worker.py): copies queued on the stream the model runs on, after its
writes, and one wait on that stream. The buffers, the copies between them and the wait go
through a `Copies` (torch's own by default).

On the CPU, where each layer's block slice is one run of memory (vLLM 0.32's CPU backend lays
every layer out so), a block is copied from the cache straight into its bytes and back: one
memory copy per layer and block, the least there is, and no buffer. Other CPU layouts take the
device path's steps on the CPU (no device buffer, no wait).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

import torch

# The device buffer a step's blocks pass through, at most: small beside the GPU memory vLLM
# leaves free next to its KV cache, large enough for the copy engine's full bandwidth.
CHUNK_BYTES: Final = 64 * 1024 * 1024
# The host buffer, at most (lucia_kv.config's buffer_bytes).
BUFFER_BYTES: Final = 256 * 1024 * 1024

_Item = TypeVar("_Item")


class Copies(Protocol):
    """What the staged path asks of the device: where a cache is, buffers, copies, the wait."""

    def device(self, cache: torch.Tensor) -> torch.device:
        """The device a cache's blocks are copied from and to."""

    def host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host buffer (page-locked when `pinned`)."""

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer on the device."""

    def copy(self, target: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        """`source` into `target`, between the host and the device."""

    def synchronize(self, device: torch.device) -> None:
        """Every copy queued on the device's current stream has finished."""


class TorchCopies:
    """Copies through torch: pinned memory, `copy_`, the current stream's synchronize."""

    def device(self, cache: torch.Tensor) -> torch.device:
        """The cache's own device."""
        return cache.device

    def host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """torch.empty on the host."""
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """torch.empty on the device."""
        return torch.empty(shape, dtype=dtype, device=device)

    def copy(self, target: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        """Tensor.copy_."""
        target.copy_(source, non_blocking=non_blocking)

    def synchronize(self, device: torch.device) -> None:
        """The current CUDA stream's synchronize; nothing elsewhere (its copies block)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


TORCH: Final = TorchCopies()


def block_view(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
    """The cache with a dim of `num_blocks` blocks, and that dim (0 or 1, the first that fits).

    vLLM 0.32 may split a block into kernel blocks (dim 0 then counts a multiple of
    num_blocks, consecutive per block); they are grouped back into one dim, as vLLM's
    `group_kernel_blocks` does. ValueError when no dim counts the blocks."""
    shape = tuple(cache.shape)
    for dim in range(min(2, cache.dim())):
        if shape[dim] == num_blocks:
            return cache, dim
    if cache.dim() >= 2 and num_blocks > 0 and shape[0] % num_blocks == 0:
        return cache.view(num_blocks, shape[0] // num_blocks, *shape[1:]), 0
    raise ValueError(f"KV cache of shape {shape} has no dim of {num_blocks} blocks")


@dataclass(frozen=True)
class _Layer:
    data: torch.Tensor  # the cache viewed as bytes: its innermost dim counts bytes
    dim: int  # the block dim
    block: tuple[int, ...]  # the shape of one block of `data`
    size: int  # bytes per block
    offset: int  # where the layer's part starts in a block's bytes
    run: bool  # a block's slice is one run of memory, at data_ptr + id * stride(dim)


@dataclass(frozen=True)
class _Buffers:
    host: torch.Tensor  # rows x block_bytes, pinned on CUDA
    ids: torch.Tensor  # the host's block ids, rows of int64, pinned on CUDA
    stage: torch.Tensor | None  # a chunk's rows on the device; none on the CPU
    index: torch.Tensor | None  # the block ids on the device; none on the CPU


class Blocks:
    """The KV caches of one worker's layers, moved a step's blocks at a time."""

    def __init__(
        self,
        caches: Sequence[tuple[torch.Tensor, int]],
        chunk_bytes: int = CHUNK_BYTES,
        buffer_bytes: int = BUFFER_BYTES,
        copies: Copies = TORCH,
    ) -> None:
        """`caches`: each layer's cache and its block dim, in the order of a block's bytes.
        ValueError when they are on different devices, disagree on the number of blocks, or
        one's innermost dim is not contiguous (no byte view of it)."""
        if not caches:
            raise ValueError("no KV cache layers")
        devices = {copies.device(cache) for cache, _ in caches}
        counts = {cache.shape[dim] for cache, dim in caches}
        if len(devices) != 1 or len(counts) != 1:
            raise ValueError(f"KV cache layers on devices {devices} with block counts {counts}")
        self.device: torch.device = devices.pop()
        self.num_blocks: int = counts.pop()
        layers, offset = [], 0
        for cache, dim in caches:
            if cache.dim() == 0 or cache.stride(-1) != 1:
                raise ValueError(f"KV cache of strides {cache.stride()}: no byte view")
            data = cache.view(torch.uint8)
            first = data.select(dim, 0)
            size = first.numel()
            layers.append(
                _Layer(data, dim, tuple(first.shape), size, offset, first.is_contiguous())
            )
            offset += size
        self._layers = tuple(layers)
        self.block_bytes: int = offset
        self._copies = copies
        self._cuda = self.device.type == "cuda"
        self._direct = self.device.type == "cpu" and all(layer.run for layer in layers)
        # blocks per host buffer (at least one, at most the cache's), and per device chunk
        self.rows: int = max(1, min(buffer_bytes // max(1, offset), self.num_blocks))
        self._chunk = max(1, min(chunk_bytes // max(1, offset), self.rows))
        self._buffers: _Buffers | None = None  # allocated on the first staged move, then kept

    def save(self, block_ids: Sequence[int]) -> list[bytes]:
        """The bytes of each block, in the order asked. ValueError when an id is out of
        range."""
        if not block_ids:
            return []
        self._check(block_ids)
        if self._direct:
            # each layer's run read in place (a view of the cache's memory, no copy), joined
            # into the block's bytes: one copy
            spans = [
                (x.data.data_ptr(), x.data.stride(x.dim), ctypes.c_char * x.size)
                for x in self._layers
            ]
            return [
                b"".join([run.from_address(base + b * stride) for base, stride, run in spans])
                for b in block_ids
            ]
        found: list[bytes] = []
        buffers = self._staging()
        size = self.block_bytes
        for batch in self._batches(block_ids):
            for start, index in self._chunks(buffers, batch):
                rows = buffers.host[start : start + index.shape[0]]
                if buffers.stage is None:
                    self._gather(index, rows)
                else:
                    stage = buffers.stage[: index.shape[0]]
                    self._gather(index, stage)
                    self._copies.copy(rows, stage, self._cuda)
            self._copies.synchronize(self.device)
            base = buffers.host.data_ptr()
            found += [ctypes.string_at(base + row * size, size) for row in range(len(batch))]
        return found

    def load(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Write each (block id, bytes) into the caches. ValueError, before anything is
        written, when a block's bytes are not `block_bytes` long or an id is out of range."""
        if not blocks:
            return
        sizes = {len(data) for _, data in blocks}
        if sizes != {self.block_bytes}:
            raise ValueError(f"KV blocks of {sorted(sizes)} bytes, expected {self.block_bytes}")
        self._check([block_id for block_id, _ in blocks])
        if self._direct:
            for block_id, data in blocks:
                source = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
                for x in self._layers:
                    target = x.data.data_ptr() + block_id * x.data.stride(x.dim)
                    ctypes.memmove(target, source + x.offset, x.size)
            return
        buffers = self._staging()
        base, size = buffers.host.data_ptr(), self.block_bytes
        for batch in self._batches(blocks):
            for row, (_, data) in enumerate(batch):
                ctypes.memmove(base + row * size, data, size)
            for start, index in self._chunks(buffers, [block_id for block_id, _ in batch]):
                rows = buffers.host[start : start + index.shape[0]]
                if buffers.stage is not None:
                    stage = buffers.stage[: index.shape[0]]
                    self._copies.copy(stage, rows, self._cuda)
                    rows = stage
                self._scatter(index, rows)
            self._copies.synchronize(self.device)

    def _gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Every layer's blocks `index` into `out` (one row of `block_bytes` per block)."""
        rows = index.shape[0]
        for x in self._layers:
            target = out[:, x.offset : x.offset + x.size].view(rows, *x.block)
            target.copy_(x.data.index_select(x.dim, index).movedim(x.dim, 0))

    def _scatter(self, index: torch.Tensor, rows_in: torch.Tensor) -> None:
        """`rows_in` (one row of `block_bytes` per block) into every layer's blocks `index`."""
        rows = index.shape[0]
        for x in self._layers:
            source = rows_in[:, x.offset : x.offset + x.size].view(rows, *x.block)
            x.data.index_copy_(x.dim, index, source.movedim(0, x.dim))

    def _check(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:  # checked here: an index out of range on a GPU ends its context
            raise ValueError(f"KV block ids {bad} outside 0..{self.num_blocks - 1}")

    def _staging(self) -> _Buffers:
        """The buffers of the staged path, allocated once: `rows` blocks on the host (pinned on
        CUDA), a chunk of them on the device."""
        if self._buffers is None:
            copies, pinned, width = self._copies, self._cuda, self.block_bytes
            host = copies.host((self.rows, width), torch.uint8, pinned)
            ids = copies.host((self.rows,), torch.int64, pinned)
            stage = index = None
            if self.device.type != "cpu":
                stage = copies.staging((self._chunk, width), torch.uint8, self.device)
                index = copies.staging((self.rows,), torch.int64, self.device)
            self._buffers = _Buffers(host, ids, stage, index)
        return self._buffers

    def _batches(self, items: Sequence[_Item]) -> Iterator[Sequence[_Item]]:
        """The items a host buffer at a time."""
        for start in range(0, len(items), self.rows):
            yield items[start : start + self.rows]

    def _chunks(
        self, buffers: _Buffers, block_ids: Sequence[int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, block ids where the caches are) of each chunk of one buffer's blocks."""
        count = len(block_ids)
        buffers.ids[:count] = torch.tensor(list(block_ids), dtype=torch.int64)
        index = buffers.ids[:count]
        if buffers.index is not None:
            self._copies.copy(buffers.index[:count], index, self._cuda)
            index = buffers.index[:count]
        for start in range(0, count, self._chunk):
            yield start, index[start : start + self._chunk]
