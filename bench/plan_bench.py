"""Memory plan benchmark: `.venv/bin/python bench/plan_bench.py [--vocab N] [--rounds N]`.

Plans a 100-model library the way `lucia-supervisor plan` does for a llama-router (scan the
library, group the files, read every model's GGUF header, plan each model and the startup set)
and times it against baselines in the same process on the same files: os.stat of every GGUF
file (what any look at the library costs), and the header reads alone. The models are real
GGUF files written with the `gguf` package: 80 single files, 10 split in 3 shards, 10 with an
mmproj; every header carries a vocabulary of --vocab tokens (string arrays that must be
stepped over) and every file 1 MiB of tensor data that must not be read. /proc/self/io's rchar
shows how many bytes a plan read against the files' total size.

Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from supervisor.engines.llama_router import plan  # noqa: E402
from supervisor.library import ggufcheck  # noqa: E402
from supervisor.library.ggufmeta import read_metadata  # noqa: E402
from supervisor.library.models import scan  # noqa: E402

MIB = 1024 * 1024
GIB = 1024 * MIB


def _header(writer: gguf.GGUFWriter, vocab: int, index: int) -> None:
    writer.add_context_length(32768)
    writer.add_embedding_length(4096)
    writer.add_block_count(32 + index % 16)
    writer.add_head_count(32)
    writer.add_head_count_kv(8)
    writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_library(models: Path, vocab: int) -> None:
    tensor = np.zeros(MIB // 4, dtype=np.float32)  # 1 MiB of tensor data per file
    for index in range(100):
        files = models / f"{index:032x}" / "files"
        files.mkdir(parents=True)
        (files.parent / "model.json").write_text('{"state": "Ready"}')
        if index < 10:
            writer = gguf.GGUFWriter(files / f"Split-{index}.gguf", "llama", split_max_tensors=1)
            _header(writer, vocab, index)
            for shard in range(3):
                writer.add_tensor(f"t{shard}", tensor)
        else:
            writer = gguf.GGUFWriter(files / f"Model-{index}-Q4_K_M.gguf", "llama")
            _header(writer, vocab, index)
            writer.add_tensor("weight", tensor)
            if index < 20:
                mmproj = gguf.GGUFWriter(files / "mmproj-F16.gguf", "clip")
                mmproj.add_tensor("v", tensor)
                _finish(mmproj)
        _finish(writer)


def header_size(path: Path) -> int:
    """Where the KV pairs end, by the `gguf` package's own reader (the tensor infos follow)."""
    reader = gguf.GGUFReader(path)
    return max(
        field.offset + sum(len(part.tobytes()) for part in field.parts)
        for field in reader.fields.values()
    )


def rchar() -> int:
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vocab", type=int, default=32000, help="tokens in every header")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: TMPDIR)")
    args = parser.parse_args(argv)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory(prefix="lucia-plan-bench-", dir=args.dir) as tmp:
        models = Path(tmp) / "library"
        build_library(models, args.vocab)
        files = sorted(models.rglob("*.gguf"))
        total = sum(path.stat().st_size for path in files)

        def planned() -> plan.RouterPlan:
            library = scan(models)
            units = [u for m in library.models for u in ggufcheck.group(m.files).units]
            found, bad = plan.read_models(units)
            assert len(found) == 100 and not bad, bad
            return plan.plan(
                "bench", found, 100 * GIB, [found[0].name], plan.Options(), multiplier=2.0
            )

        mains = [u.main for m in scan(models).models for u in ggufcheck.group(m.files).units]
        variants: dict[str, Callable[[], object]] = {
            "plan (scan + group + headers + plan)": planned,
            "baseline: os.stat of every GGUF file": lambda: [os.stat(p) for p in files],
            "header reads alone (100 main files)": lambda: [read_metadata(p) for p in mains],
            "scan() alone": lambda: scan(models),
        }
        header_bytes = sum(header_size(path) for path in mains)
        before = rchar()
        result = planned()
        read = rchar() - before
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():  # interleaved, so drift hits every variant alike
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["baseline: os.stat of every GGUF file"]
    print(
        f"library: 100 Ready models, {len(files)} GGUF files, {total / MIB:.0f} MiB on disk, "
        f"{args.vocab}-token vocabulary in every header; {args.rounds} rounds, median"
    )
    print(
        f"one plan read {read / MIB:.2f} MiB ({read / 100 / 1024:.0f} KiB a model; headers "
        f"{header_bytes / 100 / 1024:.0f} KiB a model) of {total / MIB:.0f} MiB on disk; "
        f"offered {len(result.offered)} models"
    )
    rows = [
        (name, f"{s * 1000:.2f} ms", f"{s / 100 * 1e6:.0f} us/model", f"{s / base:.1f}x")
        for name, s in medians.items()
    ]
    header = ("variant", "median", "per model", "vs stat")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
