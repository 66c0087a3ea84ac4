"""KV blocks between vLLM's paged KV cache and host bytes, a step's blocks at once (torch only).

A block's bytes are, for each layer in the order given, that layer's slice of the block in the
logical order of the cache's dims (what `cache.select(block_dim, id).contiguous()` holds), so
blocks stored before keep reading back.

On a device (the GPU), a step's blocks go through one host staging buffer, pinned on CUDA: a
save gathers every layer's blocks into a device buffer of at most `chunk_bytes` (one gather per
layer), copies it to the host in one piece, and waits once for the step; a load copies the
blocks' bytes into the host buffer, moves it to the device in one piece per chunk, scatters it
into every layer, and waits once. This is the shape of vLLM's own offloading worker
(vllm/v1/kv_offload/cpu/gpu_worker.py): copies queued on the stream the model runs on, after its
writes, and one wait on that stream.

On the CPU, where each layer's block slice is one run of memory (vLLM 0.32's CPU backend lays
every layer out so), a block is copied from the cache straight into its bytes and back: one
memory copy per layer and block, the least there is. Other CPU layouts take the device path's
steps on the CPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# The device buffer a step's blocks pass through, at most: small beside the GPU memory vLLM
# leaves free next to its KV cache, large enough for the copy engine's full bandwidth.
CHUNK_BYTES = 64 * 1024 * 1024


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


class Blocks:
    """The KV caches of one worker's layers, moved a step's blocks at a time."""

    def __init__(
        self, caches: Sequence[tuple[torch.Tensor, int]], chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        """`caches`: each layer's cache and its block dim, in the order of a block's bytes.
        ValueError when they are on different devices, disagree on the number of blocks, or
        one's innermost dim is not contiguous (no byte view of it)."""
        if not caches:
            raise ValueError("no KV cache layers")
        devices = {cache.device for cache, _ in caches}
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
        self._cuda = self.device.type == "cuda"
        self._direct = self.device.type == "cpu" and all(layer.run for layer in layers)
        self._rows = max(1, chunk_bytes // max(1, self.block_bytes))  # blocks per chunk

    def save(self, block_ids: Sequence[int]) -> list[bytes]:
        """The bytes of each block, in the order asked. ValueError when an id is out of
        range."""
        count = len(block_ids)
        if not count:
            return []
        index = self._index(block_ids)
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
        host = self._host(count)
        stage = self._stage(count)
        for start, part in self._chunks(index):
            rows = host[start : start + part.shape[0]]
            if stage is None:
                self._gather(part, rows)
            else:
                self._gather(part, stage[: part.shape[0]])
                rows.copy_(stage[: part.shape[0]], non_blocking=self._cuda)
        self._wait()
        base, size = host.data_ptr(), self.block_bytes
        return [ctypes.string_at(base + row * size, size) for row in range(count)]

    def load(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Write each (block id, bytes) into the caches. ValueError, before anything is
        written, when a block's bytes are not `block_bytes` long or an id is out of range."""
        count = len(blocks)
        if not count:
            return
        sizes = {len(data) for _, data in blocks}
        if sizes != {self.block_bytes}:
            raise ValueError(f"KV blocks of {sorted(sizes)} bytes, expected {self.block_bytes}")
        index = self._index([block_id for block_id, _ in blocks])
        if self._direct:
            for block_id, data in blocks:
                source = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
                for x in self._layers:
                    target = x.data.data_ptr() + block_id * x.data.stride(x.dim)
                    ctypes.memmove(target, source + x.offset, x.size)
            return
        host = self._host(count)
        base, size = host.data_ptr(), self.block_bytes
        for row, (_, data) in enumerate(blocks):
            ctypes.memmove(base + row * size, data, size)
        stage = self._stage(count)
        for start, part in self._chunks(index):
            rows = host[start : start + part.shape[0]]
            if stage is not None:
                stage[: part.shape[0]].copy_(rows, non_blocking=self._cuda)
                rows = stage[: part.shape[0]]
            self._scatter(part, rows)
        self._wait()

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

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:  # checked here: an index out of range on a GPU ends its context
            raise ValueError(f"KV block ids {bad} outside 0..{self.num_blocks - 1}")
        index = torch.tensor(list(block_ids), dtype=torch.int64)
        if self.device.type == "cpu":
            return index
        if self._cuda:
            index = index.pin_memory()
        return index.to(self.device, non_blocking=self._cuda)

    def _host(self, count: int) -> torch.Tensor:
        """The step's staging buffer: one row of `block_bytes` per block, pinned for CUDA."""
        return torch.empty((count, self.block_bytes), dtype=torch.uint8, pin_memory=self._cuda)

    def _stage(self, count: int) -> torch.Tensor | None:
        """The device buffer a chunk of rows passes through; none on the CPU."""
        if self.device.type == "cpu":
            return None
        rows = min(count, self._rows)
        return torch.empty((rows, self.block_bytes), dtype=torch.uint8, device=self.device)

    def _chunks(self, index: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, block ids) of each chunk of at most `chunk_bytes`."""
        for start in range(0, index.shape[0], self._rows):
            yield start, index[start : start + self._rows]

    def _wait(self) -> None:
        """The one wait of a step: every copy queued on the current stream has finished."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
