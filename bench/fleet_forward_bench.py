"""A forwarded request against a local one: `.venv/bin/python -m bench.fleet_forward_bench`.

What a fleet's forwarding adds (issue 41): two real gateways (bench/gateway_parts.py's, each a
process of its own) with `[fleet]` on and the record and catalog on PostgreSQL (a cluster of the
bench's own, tests/postgres.py), machines `a` and `b` of one peers file, in front of one fast
local upstream (gateway_parts' `fast`, no pause between tokens: the gateways' own work is all
there is to slow a request). B's engine serves the model; A's engine serves another, so A sends
every request for the model to B under `/fleet/v1/...` with its peer key. Three paths, the same
model, in the same interleaved rounds (bench/gateway_bench.py's `measure`: the order flips each
round), at 1 and 64 streams, streamed and plain:

- `direct`: the upstream itself;
- `local`: gateway B serving its own engine;
- `forwarded`: gateway A, forwarding to B, which serves it (and records the row).

The forwarded path minus the local one is what the fleet adds: to the whole answer's p50 and
p99 at 1 stream (the issue's goal: p50 under +2 ms), and the ratio of tokens a second at 64
streams (goal: at least 0.9x). The table's CPU lines are A's per request on the forwarded path
and B's on the local one, from /proc. The load generator (this process), the upstream, both
gateways and PostgreSQL share the machine's cores: on one machine the forwarded path pays A's
CPU out of the cores B and the upstream use, which a fleet of separate machines does not.
`--profile PATH` runs A under cProfile.

`--pin` emulates separate machines on this one: every thread of gateway A on one CPU of the
bench's own, and everything else (B, the upstream, the PostgreSQL cluster and this process, the
load generator) on the others, for every path of the run, so the local path is measured with
the same CPUs B, the upstream and the client have when A forwards. What it emulates: A's CPU
not taken from B's. What it does not: a network between the machines (the hop from A to B is
loopback, with no latency or bandwidth of a real link), nor separate memory, caches or kernels.
It needs at least 2 CPUs. Prints tables and the goals met or MISSED; asserts nothing about
timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_bench import body, measure  # noqa: E402
from bench.gateway_figures import Samples, rate  # noqa: E402
from bench.gateway_parts import (  # noqa: E402
    INFERENCE_KEY,
    MODEL,
    fast_upstream,
    free_port,
    gateway,
)
from bench.record_gateway_bench import postgres  # noqa: E402
from bench.standalone import machine  # noqa: E402

OTHER: Final = "only-on-a"  # what A's own engine serves: never the model asked for
MODES: Final = ("streamed", "plain")


def fleet_section(name: str, port: int, dsn: str, peers: Path) -> str:
    """Pure: a gateway's `[record]` and `[fleet]` settings as machine `name` of the fleet."""
    return (
        f'[record]\ndsn = "{dsn}"\n'
        f'[fleet]\nmachine = "{name}"\nadvertise = "http://127.0.0.1:{port}"\n'
        f'peers_file = "{peers}"\n'
    )


def serves(listing: dict[str, object], model: str, where: str) -> bool:
    """Pure: whether a /v1/models answer lists `model` on machine `where`, fresh."""
    data = listing.get("data")
    return isinstance(data, list) and any(
        isinstance(m, dict)
        and m.get("id") == model
        and m.get("machine") == where
        and m.get("fresh")
        for m in data
    )


def wait_seen(url: str, model: str, where: str, timeout: float = 60.0) -> None:
    """Until the gateway at `url` lists `model` on machine `where` (the catalog has it)."""
    headers = {"Authorization": f"Bearer {INFERENCE_KEY}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(url + "/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as answer:
            if serves(json.load(answer), model, where):
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not list {model} on machine {where} within {timeout:g} s")


@contextmanager
def fleet_of_two(
    upstream: str, dsn: str, running: int, profile: Path | None
) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """Gateways a and b of one fleet: the paths' urls and the gateways' pids by path."""
    with tempfile.TemporaryDirectory(prefix="lucia-bench-fleet-") as tmp:
        peers = Path(tmp) / "peers.keys"
        peers.write_text("".join(f"{m} {secrets.token_urlsafe(32)}\n" for m in "ab"))
        peers.chmod(0o600)
        port_a, port_b = free_port(), free_port()
        b_extra = fleet_section("b", port_b, dsn, peers)
        a_extra = fleet_section("a", port_a, dsn, peers)
        with (
            gateway(upstream, running, None, b_extra, port=port_b) as (b_url, b_pid),
            gateway(upstream, running, profile, a_extra, port=port_a, model=OTHER) as (a, a_pid),
        ):
            wait_seen(a, MODEL, "b")
            urls = {"direct": upstream, "local": b_url, "forwarded": a}
            yield urls, {"local": b_pid, "forwarded": a_pid}


def fleet_goals(results: dict[int, dict[str, Samples]], mode: str) -> list[str]:
    """Pure: the issue's goals for forwarding these figures speak to, each met or MISSED."""
    lines = []

    def goal(text: str, met: bool) -> None:
        lines.append(f"{mode}: {text}: {'met' if met else 'MISSED'}")

    one = results.get(1)
    if one is not None:
        forwarded, local = one["forwarded"], one["local"]
        p50, p99 = (
            forwarded.ms(forwarded.total, q) - local.ms(local.total, q) for q in (0.5, 0.99)
        )
        goal(
            f"1 stream, forwarded minus local, whole answer p50 {p50:+.3f} ms (goal < +2 ms)",
            p50 < 2,
        )
        lines.append(f"{mode}: 1 stream, forwarded minus local, whole answer p99 {p99:+.3f} ms")
    many = results.get(64)
    if many is not None:
        ratio = rate(many["forwarded"]) / rate(many["local"])
        goal(
            f"64 streams, forwarded {ratio:.3f}x local's tokens a second (goal >= 0.9x)",
            ratio >= 0.9,
        )
        a = many["forwarded"]
        if a.attempted:
            lines.append(
                f"{mode}: 64 streams, A's CPU {a.cpu / a.attempted * 1e6:.0f} µs a request"
            )
    for streams, got in results.items():
        for name, s in got.items():
            if s.failures:
                lines.append(
                    f"{mode}: {streams} stream(s): {name} failed {s.failures} of {s.attempted} "
                    "(left out of its times)"
                )
    return lines


@dataclass(frozen=True)
class Split:
    """Which CPUs gateway A gets under `--pin`, and which everything else gets."""

    a: frozenset[int]
    rest: frozenset[int]


def split_cpus(cpus: Iterable[int]) -> Split:
    """Pure: the highest CPU of `cpus` for A, the others for the rest; SystemExit with fewer
    than 2 (there is nothing to split)."""
    ordered = sorted(set(cpus))
    if len(ordered) < 2:
        raise SystemExit(
            f"--pin: this process may run on {len(ordered)} CPU(s) ({ordered}); pinning gateway A "
            "apart from the rest needs at least 2"
        )
    return Split(a=frozenset(ordered[-1:]), rest=frozenset(ordered[:-1]))


def pin(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process `pid` onto `cpus`, until no new one appears (a thread made later
    inherits its maker's CPUs)."""
    done: set[int] = set()
    while fresh := {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done:
        for tid in fresh:
            with suppress(ProcessLookupError):  # the thread ended since the listing
                os.sched_setaffinity(tid, cpus)
        done |= fresh


def affinity(pid: int) -> str:
    """The CPUs each thread of `pid` may run on, as `cpus 1 (5 threads)`, one part per set."""
    sets: dict[tuple[int, ...], int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            key = tuple(sorted(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            continue
        sets[key] = sets.get(key, 0) + 1
    return "; ".join(
        f"cpus {','.join(map(str, cpus))} ({n} thread{'s' * (n != 1)})"
        for cpus, n in sorted(sets.items())
    )


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_forward_bench", description=__doc__
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--streams", default="1,64", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=1000, help="per path and level")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per level")
    parser.add_argument("--modes", default=",".join(MODES), help="streamed, plain or both")
    parser.add_argument("--profile", type=Path, help="run gateway A under cProfile, to PATH")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="emulate separate machines: gateway A on one CPU, B, the upstream, PostgreSQL and "
        "the load generator on the others, for every path; no network between them (loopback); "
        "needs 2 CPUs or more",
    )
    return parser


def modes_of(text: str) -> list[str]:
    """Pure: `--modes` as a list; SystemExit naming one that is not a mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    wrong = [m for m in modes if m not in MODES]
    if wrong or not modes:
        raise SystemExit(f"--modes: {', '.join(wrong) or 'none'}; choose from {', '.join(MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    args = parser_of().parse_args(argv)
    levels = [int(n) for n in args.streams.split(",")]
    modes = modes_of(args.modes)
    split = split_cpus(os.sched_getaffinity(0)) if args.pin else None
    if split is not None:  # before any child or thread: each inherits this process's CPUs
        pin(os.getpid(), split.rest)
    pinned = (
        f"; pinned: A on cpus {sorted(split.a)}, the rest on {sorted(split.rest)}" if split else ""
    )
    began, load = time.monotonic(), os.getloadavg()
    print(
        f"{machine()}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.tokens} tokens an "
        f"answer, {args.requests} requests per path and level, {args.rounds} rounds; "
        f"{', '.join(modes)}{pinned}",
        flush=True,
    )
    verdicts: list[str] = []
    running = 2 * max(levels)
    with (
        postgres(True) as pg,
        fast_upstream(args.tokens, 0.0) as (upstream, upstream_pid),
        fleet_of_two(upstream, pg[0] if pg else "", running, args.profile) as (urls, pids),
    ):
        if split is not None:
            pin(pids["forwarded"], split.a)
            named = {
                "gateway a": pids["forwarded"],
                "gateway b": pids["local"],
                "upstream": upstream_pid,
                "load generator (this)": os.getpid(),
            }
            if pg is not None:
                named["postgres (postmaster)"] = pg[1]
            for name, pid in named.items():
                print(f"affinity: {name}, pid {pid}: {affinity(pid)}", flush=True)
        for mode in modes:
            print(f"\n{mode}:", flush=True)
            data = body(args.tokens, "fast", stream=mode == "streamed")
            results = asyncio.run(
                measure(
                    urls,
                    pids,
                    data,
                    levels=levels,
                    requests=args.requests,
                    rounds=args.rounds,
                    tokens=args.tokens,
                )
            )
            verdicts += fleet_goals(results, mode)
    for line in verdicts:
        print(line)
    end = os.getloadavg()
    print(f"whole run {time.monotonic() - began:.0f} s; load at end {end[0]:.2f} {end[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
