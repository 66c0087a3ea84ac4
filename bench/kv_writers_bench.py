"""KV store writers benchmark: a writer per tier against one queue for every tier.

`.venv/bin/python bench/kv_writers_bench.py [--baseline REV] [--rounds N]`

A model step saves a burst of blocks; the store's writers put them on an NVMe tier (a directory)
and an HDD tier whose every block write takes `--hdd-ms` more (the HDD stand-in: its two fsyncs
per block on a spinning disk). Measured per variant, medians of interleaved rounds: the time
until the NVMe tier holds every block it took, the NVMe and HDD blocks dropped by a full queue,
and the time until both tiers are done. The variants are this tree's kvplugin and the one at
`--baseline` (a git revision, checked out into a temporary worktree), each in a process of its
own with the same settings. Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.standalone import machine, table  # noqa: E402

CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys, tempfile, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from lucia_kv import blockfile, version
    from lucia_kv.config import StoreConfig, TierSpec
    from lucia_kv.store import Store

    blocks, size, burst, step_ms, hdd_ms, queue_blocks = map(float, sys.argv[2:8])
    write = blockfile.write

    def slow_hdd(dir_fd, *args, **kwargs):
        if os.readlink(f"/proc/self/fd/{dir_fd}").endswith("/hdd"):
            time.sleep(hdd_ms / 1000)
        return write(dir_fd, *args, **kwargs)

    blockfile.write = slow_hdd
    with tempfile.TemporaryDirectory(prefix="lucia-kv-writers-") as tmp:
        root = Path(tmp)
        tiers = (TierSpec("nvme", root / "nvme", 1 << 34), TierSpec("hdd", root / "hdd", 1 << 34))
        config = StoreConfig(namespace="bench", plugin_version=version(), tiers=tiers,
                             key=b"k" * 32, writers=2, queue_blocks=int(queue_blocks))
        store = Store(config)
        data = os.urandom(int(size))
        keys = [hashlib.sha256(f"block {n}".encode()).digest() for n in range(int(blocks))]
        began = time.perf_counter()
        for start in range(0, len(keys), int(burst)):
            for key in keys[start:start + int(burst)]:
                store.save(key, data)
            time.sleep(step_ms / 1000)

        def settled(tier):
            got = store.metrics.get("writes", tier) + store.metrics.get("skipped_writes", tier)
            return got >= len(keys)

        while not settled("nvme"):
            time.sleep(0.0005)
        nvme_done = time.perf_counter() - began
        store.flush()
        all_done = time.perf_counter() - began
        result = {
            "nvme_s": nvme_done, "all_s": all_done,
            "nvme_dropped": store.metrics.get("skipped_writes", "nvme"),
            "hdd_dropped": store.metrics.get("skipped_writes", "hdd"),
        }
        store.close()
    print(json.dumps(result))
    """
)


def run_variant(plugin: Path, args: argparse.Namespace) -> dict[str, float]:
    settings = [args.blocks, args.kib * 1024, args.burst, args.step_ms, args.hdd_ms, args.queue]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(plugin), *map(str, settings)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", default="56f4549", help="the revision compared against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--kib", type=int, default=256, help="bytes per block, KiB")
    parser.add_argument("--burst", type=int, default=16, help="blocks a step saves")
    parser.add_argument("--step-ms", type=float, default=20.0, help="time between steps")
    parser.add_argument("--hdd-ms", type=float, default=10.0, help="added to each HDD write")
    parser.add_argument("--queue", type=int, default=64, help="queue_blocks")
    args = parser.parse_args(argv)
    print(f"{machine()}, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="lucia-kv-writers-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            variants = {
                "a writer per tier (this tree)": ROOT / "kvplugin",
                f"one queue for every tier ({args.baseline})": base / "kvplugin",
            }
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, plugin in variants.items():
                    samples[name].append(run_variant(plugin, args))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                check=False,
                capture_output=True,
            )
    print(
        f"{args.blocks} blocks of {args.kib} KiB saved {args.burst} a step every "
        f"{args.step_ms:g} ms; NVMe a directory, HDD the same plus {args.hdd_ms:g} ms a block; "
        f"queue_blocks {args.queue}, 2 writers; medians of {args.rounds} interleaved rounds"
    )
    baseline = next(name for name in variants if name != "a writer per tier (this tree)")
    base_nvme = statistics.median(s["nvme_s"] for s in samples[baseline])
    rows = []
    for name, got in samples.items():
        nvme = statistics.median(s["nvme_s"] for s in got)
        rows.append(
            (
                name,
                f"{nvme * 1000:.0f} ms",
                f"{nvme / base_nvme:.2f}x",
                f"{statistics.median(s['nvme_dropped'] for s in got):.0f}",
                f"{statistics.median(s['hdd_dropped'] for s in got):.0f}",
                f"{statistics.median(s['all_s'] for s in got) * 1000:.0f} ms",
            )
        )
    table(
        rows,
        ("variant", "NVMe holds all", "vs baseline", "NVMe dropped", "HDD dropped", "both done"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
