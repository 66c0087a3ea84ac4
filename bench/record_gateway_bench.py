"""The record's cost in the gateway: `.venv/bin/python -m bench.record_gateway_bench [options]`.

Requests a second through the real gateway at 64 concurrent streams with the record off, on
SQLite and on PostgreSQL, in the same run: three gateway processes (bench/gateway_parts.py's,
`[record] enabled = false`, `path = ...` and `dsn = ...`) in front of one fast local upstream
that streams `--tokens` SSE chunks with no pause, so that the gateway's own work is all there is
to slow a request. Each round sends `--requests` streamed chat completions through each
gateway, 64 at a time (each of the 64 client lanes takes the next request when its last one
ended), the three in an order that rotates round by round. Per configuration: the median of the
rounds' requests a second, their spread (min-max), the ratio of the medians to the record off,
and the median of the rounds' own ratios (each round's figure over the record off's in that
round); the gateway's CPU per request from /proc, and PostgreSQL's (the server and its
backends, which run on the same cores).

After the last round the gateways stop (SIGTERM: the store commits what is queued) and the
record is counted: every answered request (the warm-up too) must have its row, on SQLite (its
file) and on PostgreSQL (a cluster of the bench's own, tests/postgres.py).

The load generator (an aiohttp client in this process), the upstream and the gateways share
the machine's cores; the load average at the start and end is printed. The issue's goal: the
record costs at most 5 % of the requests a second, on SQLite and on PostgreSQL. Prints tables;
asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_parts import INFERENCE_KEY, MODEL, fast_upstream, gateway  # noqa: E402
from bench.procfs import cpu_seconds  # noqa: E402
from bench.standalone import filesystem, machine, table  # noqa: E402

CHAT: Final = "/v1/chat/completions"
DONE: Final = b"data: [DONE]"


@dataclass
class Config:
    """One gateway: its record's settings, where it answers, and what it did."""

    name: str
    extra: str  # the settings' [record] section
    url: str = ""
    pid: int = 0
    answered: int = 0  # whole answers, the warm-up included
    rates: list[float] = field(default_factory=list)  # requests a second, one per round
    cpu: float = 0.0  # the gateway's CPU seconds over the measured rounds
    server: int = 0  # the database server's pid (PostgreSQL's postmaster), or 0: none
    server_cpu: float = 0.0  # its CPU seconds, its backends' too, over the measured rounds
    measured: int = 0  # requests in the measured rounds


def body(tokens: int) -> bytes:
    return (
        f'{{"model": "{MODEL}", "stream": true, "max_tokens": {tokens}, '
        f'"messages": [{{"role": "user", "content": "hello"}}]}}'
    ).encode()


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> None:
    """One streamed answer, read to its end; SystemExit for anything but a whole answer."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {INFERENCE_KEY}"}
    tail = b""
    async with session.post(url + CHAT, data=data, headers=headers) as response:
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status} {await response.text()}")
        async for chunk in response.content.iter_any():
            tail = (tail + chunk)[-64:]
    if DONE not in tail:
        raise SystemExit(f"{url}: a stream ended before [DONE]")


async def round_of(
    session: aiohttp.ClientSession, config: Config, data: bytes, streams: int, requests: int
) -> float:
    """`requests` answers, `streams` at a time: the wall seconds."""
    queue = iter(range(requests))

    async def lane() -> None:
        for _ in queue:
            await one(session, config.url, data)
            config.answered += 1

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(streams)))
    return time.perf_counter() - start


async def measure(
    configs: list[Config], data: bytes, streams: int, requests: int, rounds: int
) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        for config in configs:  # warm each gateway, its pools and its record
            await round_of(session, config, data, streams, 4 * streams)
        for index in range(rounds):
            shift = index % len(configs)
            figures = []
            for config in configs[shift:] + configs[:shift]:
                cpu = cpu_seconds(config.pid)
                server = cpu_seconds(config.server) if config.server else 0.0
                wall = await round_of(session, config, data, streams, requests)
                config.cpu += cpu_seconds(config.pid) - cpu
                if config.server:
                    config.server_cpu += cpu_seconds(config.server) - server
                config.measured += requests
                config.rates.append(requests / wall)
                figures.append(f"{config.name} {requests / wall:.0f}")
            load = os.getloadavg()[0]
            print(f"  round {index + 1}: {', '.join(figures)} req/s; load {load:.2f}", flush=True)


def rows_in_sqlite(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM generations").fetchone()[0])


def rows_in_postgres(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn) as db:
        found = db.execute("SELECT count(*) FROM generations").fetchone()
        return int(found[0]) if found else 0


@contextmanager
def postgres(wanted: bool) -> Iterator[tuple[str, int] | None]:
    """A new database in a cluster of the bench's own: its DSN and the postmaster's pid; None
    when not wanted."""
    if not wanted:
        yield None
        return
    from tests.postgres import cluster

    with cluster() as pg:
        yield pg.database(), int((pg.data / "postmaster.pid").read_text().split()[0])


def results(configs: list[Config], tokens: int) -> list[tuple[str, ...]]:
    off = configs[0]
    base = statistics.median(off.rates)
    rows: list[tuple[str, ...]] = []
    for config in configs:
        median = statistics.median(config.rates)
        paired = statistics.median(r / o for r, o in zip(config.rates, off.rates, strict=True))
        rows.append(
            (
                config.name,
                f"{median:.0f}",
                f"{min(config.rates):.0f}-{max(config.rates):.0f}",
                f"x{median / base:.3f}",
                f"x{paired:.3f}",
                f"{config.cpu / config.measured * 1e6:.0f}",
                f"{config.cpu / config.measured / tokens * 1e6:.1f}",
                f"{config.server_cpu / config.measured * 1e6:.0f}" if config.server else "-",
            )
        )
    return rows


def committed(configs: list[Config], counted: dict[str, int]) -> list[tuple[str, ...]]:
    """Each record's rows against the answers its gateway gave."""
    rows: list[tuple[str, ...]] = []
    for config in configs:
        if config.name in counted:
            rows_in = counted[config.name]
            check = "every one" if rows_in == config.answered else "MISSING ROWS"
            rows.append((config.name, str(config.answered), str(rows_in), check))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.record_gateway_bench")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=2000, help="per gateway and round")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args(argv)
    began, load = time.monotonic(), os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="lucia-bench-record-") as tmp,
        postgres(not args.no_postgres) as pg,
    ):
        sqlite = Path(tmp) / "record.sqlite3"
        configs = [
            Config("off", "[record]\nenabled = false\n"),
            Config("SQLite", f'[record]\npath = "{sqlite}"\n'),
        ]
        if pg is not None:
            dsn = pg[0]
            configs.append(Config("PostgreSQL", f'[record]\ndsn = "{dsn}"\n', server=pg[1]))
        print(
            f"{machine()}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; SQLite on "
            f"{filesystem(Path(tmp))}; {args.streams} streams, {args.tokens} tokens an answer, "
            f"{args.requests} requests per gateway and round, {args.rounds} rounds",
            flush=True,
        )
        with ExitStack() as stack:
            upstream, _ = stack.enter_context(fast_upstream(args.tokens, 0.0))
            for config in configs:
                running = 2 * args.streams
                config.url, config.pid = stack.enter_context(
                    gateway(upstream, running, None, config.extra)
                )
            asyncio.run(
                measure(configs, body(args.tokens), args.streams, args.requests, args.rounds)
            )
        # the gateways have stopped: their stores committed what was queued
        counted = {"SQLite": rows_in_sqlite(sqlite)}
        if pg is not None:
            counted["PostgreSQL"] = rows_in_postgres(pg[0])
    end = os.getloadavg()
    print()
    print(f"Requests a second at {args.streams} streams ({args.rounds} rounds):")
    table(
        results(configs, args.tokens),
        (
            "record",
            "median",
            "min-max",
            "vs off",
            "paired",
            "CPU µs/req",
            "CPU µs/token",
            "server µs/req",
        ),
    )
    print("Rows committed after the gateways stopped:")
    table(committed(configs, counted), ("record", "answered", "rows", "check"))
    off = statistics.median(configs[0].rates)
    for config in configs[1:]:
        ratio = statistics.median(config.rates) / off
        print(
            f"{config.name}: x{ratio:.3f} of the record off's requests a second "
            f"(goal >= x0.95): {'met' if ratio >= 0.95 else 'MISSED'}"
        )
    print(f"whole run {time.monotonic() - began:.0f} s; load at end {end[0]:.2f} {end[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
