"""KV host buffer benchmark: `.venv/bin/python bench/kv_buffer_bench.py [--step-blocks N]`.

The peak host memory of one model step that loads --step-blocks KV blocks of --block-mib MiB on
the CPU (1000 blocks of 1 MiB by default, four times the default buffer), the connector's way
(lucia_kv.batches over lucia_kv.transfer.Blocks, a host buffer of --buffer-mib at a time),
against the way before it in the same run: every block of the step read into bytes first, then
loaded through a staging buffer of all of them (Blocks with a buffer as large as the step).
Two cache layouts: vLLM 0.32's CPU backend (LBHNC: one memory copy per layer and block, no
staging buffer) and LBNHC (the staged path a GPU takes, run on the CPU).

Each measurement runs in a child process of its own: the peak is its `ru_maxrss` (torch's
memory is invisible to tracemalloc) above its resident size just before the step. The cache is
--cache-blocks blocks (untouched memory, so only the blocks the step writes are resident); the
step's block ids cycle through the first --touched blocks. The store is stood in for by a fresh
bytes object per block read. Medians of --rounds; prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kvplugin"))

from bench.standalone import machine, table  # noqa: E402

MIB = 2**20
LAYOUTS = {"CPU backend (LBHNC, direct)": (0, 1, 2, 3, 4), "LBNHC (staged)": (0, 1, 3, 2, 4)}
WAYS = ("before: the step at once", "now: a buffer at a time")


def resident() -> int:
    """This process's resident bytes now (/proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict[str, float]:
    """One step's load in this process: its seconds and its peak above the resident before."""
    import torch
    from lucia_kv import batches
    from lucia_kv.transfer import Blocks

    layers, heads, tokens = 8, 4, 16  # bytes per block: layers x heads x tokens x content
    content = args.block_mib * MIB // (layers * heads * tokens)
    shape = (layers, args.cache_blocks, heads, tokens, content)
    order = LAYOUTS[args.layout]
    physical = [shape[dim] for dim in order]
    raw = torch.empty(physical, dtype=torch.uint8).permute(*[order.index(d) for d in range(5)])
    caches = [(raw[n], 0) for n in range(layers)]
    size = args.block_mib * MIB
    ids = [n % args.touched for n in range(args.step_blocks)]
    keys = [(block_id, b"%d" % n) for n, block_id in enumerate(ids)]

    def read(key: bytes) -> bytes:
        return b"\x07" * size  # written, so resident, as a block read from a tier is

    before = resident()
    started = time.perf_counter()
    if args.way == WAYS[0]:
        blocks = Blocks(caches, buffer_bytes=args.step_blocks * size)
        found = [(block_id, read(key)) for block_id, key in keys]
        blocks.load(found)
    else:
        blocks = Blocks(caches, buffer_bytes=args.buffer_mib * MIB)
        errors = batches.load(blocks, [keys], read)
        assert not errors, errors
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"seconds": seconds, "peak": max(0, peak)}


def measure(args: argparse.Namespace, layout: str, way: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--layout", layout, "--way", way]
    for name in ("step_blocks", "block_mib", "buffer_mib", "cache_blocks", "touched"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--step-blocks", type=int, default=1000, help="blocks the step loads")
    parser.add_argument("--block-mib", type=int, default=1)
    parser.add_argument("--buffer-mib", type=int, default=256, help="the plugin's buffer_bytes")
    parser.add_argument("--cache-blocks", type=int, default=1000)
    parser.add_argument("--touched", type=int, default=64, help="distinct blocks written")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print(f"{machine()}, load {os.getloadavg()[0]:.2f}")
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # interleaved, so drift hits each alike
        for layout in LAYOUTS:
            for way in WAYS:
                samples.setdefault((layout, way), []).append(measure(args, layout, way))
    rows = []
    for (layout, way), found in samples.items():
        peak = statistics.median(sample["peak"] for sample in found)
        seconds = statistics.median(sample["seconds"] for sample in found)
        old = samples[(layout, WAYS[0])]
        old_peak = statistics.median(sample["peak"] for sample in old)
        old_seconds = statistics.median(sample["seconds"] for sample in old)
        rows.append(
            (
                layout,
                way,
                f"{peak / MIB:.0f} MiB",
                f"{peak / old_peak:.2f}x",
                f"{seconds * 1000:.0f} ms",
                f"{seconds / old_seconds:.2f}x",
            )
        )
    total = args.step_blocks * args.block_mib
    print(
        f"one step loading {args.step_blocks} blocks of {args.block_mib} MiB ({total} MiB) on "
        f"the CPU, buffer_bytes {args.buffer_mib} MiB, medians of {args.rounds}"
    )
    table(rows, ("layout", "way", "peak host memory", "vs before", "step", "vs before"))
    print(f"load at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
