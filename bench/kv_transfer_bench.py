"""KV block transfer benchmark: `.venv/bin/python bench/kv_transfer_bench.py [--device D]`.

The connector's batched move of a step's KV blocks between vLLM's paged cache and host bytes
(lucia_kv.transfer: a save gathers every layer's blocks into one staging buffer and waits once,
a load the reverse), over a cache laid out as vLLM 0.32 lays it out (one buffer, a [B, H, N, C]
view per layer, layout LBHNC: the CPU backend's), against:

1. the machine's own copy of the same number of bytes in the same run: on CUDA a contiguous
   device buffer to pinned host memory and back (`tensor.to('cpu')`'s copy, non-blocking, one
   sync), on the CPU one memcpy (`ctypes.memmove`) between two buffers;
2. on the CPU, the per-block copy the connector made before (each block, each layer:
   `select().contiguous().numpy().tobytes()`, joined; the load through a bytearray and one
   `copy_` per layer). On a GPU that path raised (`.numpy()` of a device tensor).

Variants run interleaved, so drift hits each alike; medians of --rounds. Prints a table; asserts
nothing about timings.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kvplugin"))

from lucia_kv.transfer import Blocks  # noqa: E402

from bench.standalone import machine, table, timed  # noqa: E402

GB = 1e9
Layers = list[tuple[torch.Tensor, int]]


def caches(args: argparse.Namespace, device: str, dtype: torch.dtype) -> Layers:
    """vLLM 0.32's per-layer [B, H, N, 2 * head_dim] views of one int8 buffer (LBHNC)."""
    size = torch.empty((), dtype=dtype).element_size()
    shape = (args.layers, args.num_blocks, args.heads, args.block_size, 2 * args.head_dim * size)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    return [(raw[n].view(dtype), 0) for n in range(args.layers)]


def old_save(layers: Layers, block_ids: list[int]) -> list[bytes]:
    parts_of = []
    for block_id in block_ids:
        parts = []
        for cache, dim in layers:
            block = cache.select(dim, block_id).contiguous()
            parts.append(block.view(torch.uint8).reshape(-1).numpy().tobytes())
        parts_of.append(b"".join(parts))
    return parts_of


def old_load(layers: Layers, blocks: list[tuple[int, bytes]]) -> None:
    for block_id, data in blocks:
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for cache, dim in layers:
            target = cache.select(dim, block_id)
            size = target.numel() * target.element_size()
            part = source[offset : offset + size].view(cache.dtype).reshape(target.shape)
            target.copy_(part)
            offset += size


def run(args: argparse.Namespace) -> tuple[list[tuple[str, ...]], int]:
    device, dtype = args.device, getattr(torch, args.dtype)
    layers = caches(args, device, dtype)
    blocks = Blocks(layers)
    total = blocks.block_bytes * args.step_blocks
    chooser = random.Random(1)
    cuda = device.startswith("cuda")
    source = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

    def to_host() -> None:
        if cuda:
            host.copy_(source, non_blocking=True)
            wait()
        else:
            ctypes.memmove(host.data_ptr(), source.data_ptr(), total)

    def to_device() -> None:
        if cuda:
            source.copy_(host, non_blocking=True)
            wait()
        else:
            ctypes.memmove(source.data_ptr(), host.data_ptr(), total)

    samples: dict[str, list[float]] = {}
    copy_name = "device -> pinned host" if cuda else "memcpy"
    back_name = "pinned host -> device" if cuda else "memcpy"
    for round_ in range(args.rounds + 1):  # the first round warms up, and is dropped
        ids = chooser.sample(range(args.num_blocks), args.step_blocks)
        saved = blocks.save(ids)
        pairs = list(zip(ids, saved, strict=True))
        variants: list[tuple[str, Callable[[], object]]] = [
            (f"save: {copy_name}, same bytes, contiguous", to_host),
            ("save: batched (lucia_kv.transfer)", lambda ids=ids: blocks.save(ids)),
            (f"load: {back_name}, same bytes, contiguous", to_device),
            ("load: batched (lucia_kv.transfer)", lambda pairs=pairs: blocks.load(pairs)),
        ]
        if not cuda:
            variants += [
                ("save: old per block (.numpy().tobytes())", lambda ids=ids: old_save(layers, ids)),
                ("load: old per block (copy_ per layer)", lambda p=pairs: old_load(layers, p)),
            ]
        for name, fn in variants:
            seconds = timed(fn)
            if round_:
                samples.setdefault(name, []).append(seconds)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    for name, seconds in medians.items():
        direction = name.split(":")[0]
        baseline = next(n for n in medians if n.startswith(direction) and "same bytes" in n)
        old = next((n for n in medians if n.startswith(direction) and "old" in n), None)
        rows.append(
            (
                name,
                f"{seconds * 1000:.2f} ms",
                f"{total / seconds / GB:.2f} GB/s",
                f"{seconds / medians[baseline]:.2f}x",
                f"{seconds / medians[old]:.2f}x" if old else "-",
            )
        )
    return rows, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"cpu or cuda (default {default})")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block")
    parser.add_argument("--num-blocks", type=int, default=32, help="blocks in the cache")
    parser.add_argument("--step-blocks", type=int, default=8, help="blocks moved per step")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"{machine()}, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    rows, total = run(args)
    block = total // args.step_blocks
    print(
        f"{args.step_blocks} blocks of {block / 2**20:.2f} MiB per step ({total / 2**20:.0f} MiB; "
        f"{args.layers} layers x {args.heads} KV heads x {args.block_size} tokens x "
        f"2 x {args.head_dim} {args.dtype}), cache of {args.num_blocks} blocks on {args.device}, "
        f"{args.rounds} rounds, median"
    )
    table(rows, ("variant", "median", "throughput", "vs same bytes", "vs old"))
    print(f"load at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
