"""GGUF cache benchmarks: `.venv/bin/python bench/copy_bench.py [--size-mib N] [--rounds N]`.

1. Copy throughput of supervisor.engines.llama_router.fastcopy.copy_file against `cp` on the
   same files in the same run: three real GGUF files (random tensor data) in a temp directory,
   copied to a sibling directory on the same disk. The page cache is not dropped: every variant
   reads warm sources. copy_file fsyncs each copy before renaming it, cp does not, so
   `cp + sync FILE...` (fsync of the copies) is measured too; that is the like-for-like baseline.
2. Re-checking an unchanged library of 100 models (scan + sync with nothing to copy), against
   os.stat of the same GGUF files (sources and copies) and against reading every GGUF header.
   A separate pass proves the re-check opens no GGUF file.

Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.standalone import filesystem, machine, table, timed  # noqa: E402
from supervisor.engines.llama_router import fastcopy, gguf_cache  # noqa: E402
from supervisor.library import ggufcheck  # noqa: E402
from supervisor.library.models import scan  # noqa: E402

MIB = 1024 * 1024
TENSOR_MIB = 64


def write_big_gguf(path: Path, size_mib: int, block: np.ndarray[Any, Any]) -> None:
    """A real GGUF file of about size_mib MiB: 64 MiB tensors written one at a time."""
    count = max(1, size_mib // TENSOR_MIB)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(path.stem)
    for index in range(count):
        writer.add_tensor_info(f"blk.{index}.weight", block.shape, block.dtype, block.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _ in range(count):
        writer.write_tensor_data(block)
    writer.close()


def write_tiny_gguf(path: Path, elements: int = 256) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(path.stem)
    writer.add_tensor("weight", np.arange(elements, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def clear(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()


# --- 1. copy throughput -------------------------------------------------------------------------


def fn_is_ours(name: str) -> bool:
    return name.startswith("fastcopy")


def copy_throughput(work: Path, size_mib: int, rounds: int) -> list[tuple[str, ...]]:
    sources = work / "src"
    sources.mkdir()
    block = np.frombuffer(np.random.default_rng(7).bytes(TENSOR_MIB * MIB), dtype=np.int8)
    files = []
    for index in range(3):
        path = sources / f"Bench-{index}-Q4_K_M.gguf"
        write_big_gguf(path, size_mib, block)
        files.append(path)
    total = sum(p.stat().st_size for p in files)
    for path in files:
        path.read_bytes()  # warm: every variant reads the sources from the page cache
    dest = work / "dest"
    dest.mkdir()
    methods: set[str] = set()

    def ours() -> None:
        for path in files:
            methods.add(fastcopy.copy_file(path, dest / path.name).method)

    def cp() -> None:
        subprocess.run(["cp", *map(str, files), str(dest)], check=True)

    def cp_sync() -> None:
        cp()
        subprocess.run(["sync", *(str(dest / p.name) for p in files)], check=True)

    variants: dict[str, Callable[[], None]] = {
        "fastcopy.copy_file (fsync each)": ours,
        "cp": cp,
        "cp + sync FILE... (fsync each)": cp_sync,
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():  # interleaved, so drift hits every variant alike
            clear(dest)
            subprocess.run(["sync"], check=True)  # start each from clean writeback
            samples[name].append(timed(fn))
            assert all((dest / p.name).stat().st_size == p.stat().st_size for p in files)
    clear(dest)
    shutil.rmtree(sources)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    for name, seconds in medians.items():
        label = name + (f" [{', '.join(sorted(methods))}]" if fn_is_ours(name) else "")
        rows.append(
            (
                label,
                f"{seconds:.3f} s",
                f"{min(samples[name]):.3f} s",
                f"{total / seconds / 1e9:.2f} GB/s",
                f"{seconds / medians['cp']:.2f}x",
                f"{seconds / medians['cp + sync FILE... (fsync each)']:.2f}x",
            )
        )
    print(f"copy: 3 GGUF files, {total / 1e9:.2f} GB total, {rounds} rounds, median; warm cache")
    return rows


# --- 2. re-checking an unchanged library --------------------------------------------------------


def build_library(models: Path) -> None:
    """100 Ready models: 80 single files, 10 split in 3 shards, 10 with an mmproj."""
    for index in range(100):
        files = models / f"{index:032x}" / "files"
        files.mkdir(parents=True)
        (files.parent / "model.json").write_text(
            '{"state": "Ready", "displayName": "bench", "bytesTotal": 1}'
        )
        if index < 10:
            writer = gguf.GGUFWriter(files / f"Split-{index}.gguf", "llama", split_max_tensors=1)
            for shard in range(3):
                writer.add_tensor(f"t{shard}", np.zeros(64, dtype=np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        else:
            write_tiny_gguf(files / f"Model-{index}-Q4_K_M.gguf")
            if index < 20:
                write_tiny_gguf(files / "mmproj-F16.gguf")


class OpenCounter:
    def __init__(self) -> None:
        self.gguf = 0
        self._real = os.open

    def __enter__(self) -> OpenCounter:
        def counting(path: Any, *args: Any, **kwargs: Any) -> int:
            if str(path).endswith(".gguf"):
                self.gguf += 1
            return self._real(path, *args, **kwargs)

        os.open = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.open = self._real


def recheck(work: Path, rounds: int) -> list[tuple[str, ...]]:
    models, cache = work / "library", work / "cache"
    build_library(models)
    never = threading.Event()
    first = gguf_cache.sync(scan(models), cache, lambda _m: None, never)
    assert len(first.models) == 100 and not first.bad, first.summary()
    gguf_files = sorted(models.rglob("*.gguf")) + sorted(cache.rglob("*.gguf"))

    with OpenCounter() as opens:
        again = gguf_cache.sync(scan(models), cache, lambda _m: None, never)
    assert again.copied == () and len(again.unchanged) == len(first.copied)

    def resync() -> None:
        gguf_cache.sync(scan(models), cache, lambda _m: None, never)

    def stat_all() -> None:
        for path in gguf_files:
            os.stat(path)

    def headers() -> None:
        for path in gguf_files:
            ggufcheck.check_header(path)

    variants = {
        "re-check (scan + sync, nothing to copy)": resync,
        "baseline: os.stat of every GGUF (source + copy)": stat_all,
        "naive: read every GGUF header (source + copy)": headers,
        "scan() alone": lambda: scan(models),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["baseline: os.stat of every GGUF (source + copy)"]
    print(
        f"re-check: 100 Ready models, {len(first.copied)} cached GGUF files; "
        f"GGUF files opened by a re-check: {opens.gguf}; {rounds} rounds, median"
    )
    return [
        (name, f"{s * 1000:.2f} ms", f"{s / 100 * 1e6:.0f} us/model", f"{s / base:.1f}x")
        for name, s in medians.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=512, help="size of each of 3 files")
    parser.add_argument("--rounds", type=int, default=5, help="copy rounds per variant")
    parser.add_argument("--recheck-rounds", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: TMPDIR)")
    args = parser.parse_args(argv)
    print(machine())
    with tempfile.TemporaryDirectory(prefix="lucia-copy-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        fs = filesystem(work)
        print(f"work directory: {work} ({fs}); page cache not dropped (warm sources)")
        print()
        (work / "copy").mkdir()
        rows = copy_throughput(work / "copy", args.size_mib, args.rounds)
        table(rows, ("variant", "median", "min", "throughput", "vs cp", "vs cp+sync"))
        (work / "recheck").mkdir()
        rows = recheck(work / "recheck", args.recheck_rounds)
        table(rows, ("variant", "median", "per model", "vs stat"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
