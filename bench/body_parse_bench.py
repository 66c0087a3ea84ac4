"""Body parse benchmark: `.venv/bin/python bench/body_parse_bench.py [--runs N] [--at-once N]`.

Where the gateway parses a request body (supervisor.host.proxy.bodies), measured two ways:

- what `body.prepare` costs per body size, for three shapes (an embeddings batch of token ids,
  the densest JSON a client sends; an embeddings batch of text; a chat of many messages),
  against the round trip of one call to a thread (`run_in_executor` of a function that returns
  at once): the size below which a thread costs more than the parse (bodies.PARSE_INLINE);
- how long the event loop goes without a turn while --at-once 16 MiB token-id bodies are parsed
  together: inline on the loop, in the default executor (`asyncio.to_thread`, several threads),
  and in the gateway's one parse thread (`Bodies.off_loop`). CPython's JSON decoder holds the
  interpreter's lock while it runs, so no thread makes a parse free for the loop; the figure is
  the longest gap a 1 ms ticker on the loop sees.

Medians of --runs runs. Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from supervisor.host.gateway.settings import GatewaySettings  # noqa: E402
from supervisor.host.proxy import body  # noqa: E402
from supervisor.host.proxy.bodies import PARSE_INLINE, Bodies  # noqa: E402

LIMITS = GatewaySettings().limits.bounds
EMBEDDINGS = "/v1/embeddings"
SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 16 << 20)


def of_size(size: int, field: str, item: object) -> bytes:
    """A body of at most `size` bytes whose `field` is a list of `item`s."""
    each = len(json.dumps(item)) + 2  # and ", "
    return json.dumps({"model": "m", field: [item] * ((size - 64) // each)}).encode()


def token_ids(size: int) -> bytes:
    return of_size(size, "input", [12345] * 64)


def texts(size: int) -> bytes:
    return of_size(size, "input", "lorem ipsum dolor sit " * 40)


def chat(size: int) -> bytes:
    return of_size(size, "messages", {"role": "user", "content": "hello there " * 80})


SHAPES: dict[str, tuple[Callable[[int], bytes], str]] = {
    "embeddings, token ids": (token_ids, EMBEDDINGS),
    "embeddings, text": (texts, EMBEDDINGS),
    "chat, messages": (chat, body.CHAT),
}


def median_s(work: Callable[[], object], runs: int) -> float:
    figures = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        figures.append(time.perf_counter() - start)
    return statistics.median(figures)


async def hop_s(runs: int) -> float:
    loop = asyncio.get_running_loop()
    figures = []
    for _ in range(max(runs, 200)):
        start = time.perf_counter()
        await loop.run_in_executor(None, int)
        figures.append(time.perf_counter() - start)
    return statistics.median(figures)


async def longest_gap_s(
    parse: Callable[[], Awaitable[object]], at_once: int
) -> tuple[float, float]:
    """The longest the loop went without a turn while `at_once` parses ran, and their time."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    start = time.perf_counter()
    await asyncio.gather(*(parse() for _ in range(at_once)))
    took = time.perf_counter() - start
    done = True
    await ticker
    return max(gaps), took


async def placements(runs: int, at_once: int) -> dict[str, tuple[float, float]]:
    raw = token_ids(body.ANY_LIMIT)
    bodies = Bodies(1 << 30, 60, LIMITS)

    async def inline() -> object:
        await asyncio.sleep(0)
        return body.prepare(EMBEDDINGS, raw, LIMITS)

    async def default_pool() -> object:
        return await asyncio.to_thread(body.prepare, EMBEDDINGS, raw, LIMITS)

    async def one_thread() -> object:
        return await bodies.off_loop(body.prepare, EMBEDDINGS, raw, LIMITS)

    ways = {
        "inline on the loop": inline,
        "asyncio.to_thread": default_pool,
        "the one parse thread": one_thread,
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(runs):
        for name, way in ways.items():
            figures[name].append(await longest_gap_s(way, at_once))
    return {
        name: (statistics.median(g for g, _ in got), statistics.median(t for _, t in got))
        for name, got in figures.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--at-once", type=int, default=8)
    args = parser.parse_args()

    print(f"body.prepare, median of {args.runs} (PARSE_INLINE = {PARSE_INLINE // 1024} KiB)")
    print(f"| shape | {' | '.join(f'{size >> 10} KiB' for size in SIZES)} |")
    print(f"|---|{'---|' * len(SIZES)}")
    for name, (make, path) in SHAPES.items():
        cells = []
        for size in SIZES:
            raw = make(size)
            if len(raw) > body.limit(path):
                cells.append("-")
                continue
            took = median_s(partial(body.prepare, path, raw, LIMITS), args.runs)
            cells.append(f"{took * 1e3:.3f} ms")
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\na thread's round trip: {asyncio.run(hop_s(args.runs)) * 1e6:.0f} µs (median)")

    print(f"\n{args.at_once} token-id bodies of 16 MiB at once, median of {args.runs}")
    print("| where | longest loop gap | all parsed |\n|---|---|---|")
    for name, (gap, took) in asyncio.run(placements(args.runs, args.at_once)).items():
        print(f"| {name} | {gap * 1e3:.0f} ms | {took * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
