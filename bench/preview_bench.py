"""What a worker's look pays for the plan it publishes: `.venv/bin/python bench/preview_bench.py`.

Each look (an observation: on every event, else every poll interval) now plans a start of the
engine's recipe, claiming nothing (supervisor/memplan/preview.py), and status.json carries it.
Timed here against the real dockerd, medians of --rounds, against one container inspect
(`Runtime.container`, which every look already makes, several times):

- `preview`, a fixed need: the machine file, /proc/meminfo, the running lucia engines (one
  Docker listing, by their labels), the ledger read twice under its lock, the two checks;
- a llama-router's need before a sync, from a 100-model library (bench/plan_bench.py's): the
  GGUF headers read the first time (`Headers` empty), then with them kept (the library did not
  change: every later look), both planned in the same budget.

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
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.plan_bench import build_library  # noqa: E402
from supervisor.docker.runtime import Runtime  # noqa: E402
from supervisor.engines.llama_router import memory as router_memory  # noqa: E402
from supervisor.engines.llama_router.library_sync import library_fingerprint  # noqa: E402
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe  # noqa: E402
from supervisor.library import ggufcheck  # noqa: E402
from supervisor.library.models import scan  # noqa: E402
from supervisor.memplan.fit import Budget  # noqa: E402
from supervisor.memplan.guard import Guard  # noqa: E402
from supervisor.memplan.need import EngineNeed, figures  # noqa: E402
from supervisor.memplan.preview import preview  # noqa: E402

GIB = 1024**3


def timed(call: Callable[[], object], rounds: int) -> float:
    """The median seconds of one call over rounds."""
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def router_recipe(models: Path) -> LlamaRouterRecipe:
    """The shipped recipes/llama-router.toml on this library, loading nothing at start."""
    data = tomllib.loads((ROOT / "recipes" / "llama-router.toml").read_text())
    data["library"].update(models_dir=str(models), cache_dir=str(models.parent / "cache"))
    data["router"]["load_on_startup"] = []
    return LlamaRouterRecipe.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=32_000)
    args = parser.parse_args(argv)
    runtime = Runtime()
    with tempfile.TemporaryDirectory(prefix="lucia-preview-bench-") as scratch:
        root = Path(scratch)
        machine = root / "machine.toml"
        machine.write_text('limit = "unified"\nprofile = "workstation"\n')
        os.environ["LUCIA_MACHINE_FILE"] = str(machine)
        guard = Guard.for_data_dir("bench", root / "data", runtime)
        fixed = EngineNeed("bench", (figures("bench", 4 * GIB, 0, GIB, multiplier=2.0),))
        inspect = timed(lambda: runtime.container("lucia-bench-none"), args.rounds)
        planned = timed(lambda: preview(guard, lambda budget, multiplier: fixed), args.rounds)
        models = root / "models"
        build_library(models, args.vocab)
        recipe = router_recipe(models)
        budget = Budget(64 * GIB, 18 * GIB)

        def router_need(headers: router_memory.Headers) -> None:
            found = scan(models)
            units = [u for m in found.models for u in ggufcheck.group(m.files).units]
            read = headers.models(library_fingerprint(found), units)
            router_memory.library_need("bench-router", recipe, read, budget, 2.0)

        rounds = max(3, args.rounds // 20)
        first = timed(lambda: router_need(router_memory.Headers()), rounds)
        kept = router_memory.Headers()
        router_need(kept)
        later = timed(lambda: router_need(kept), args.rounds)
    print(f"machine: {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'what':58} {'median':>10} {'x inspect':>10}")
    rows = [
        ("one container inspect (the baseline)", inspect),
        ("preview, a fixed need", planned),
        ("router need, 100 models, headers read (first look)", first),
        ("router need, 100 models, headers kept (later looks)", later),
    ]
    for what, seconds in rows:
        print(f"{what:58} {seconds * 1000:8.2f} ms {seconds / inspect:9.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
