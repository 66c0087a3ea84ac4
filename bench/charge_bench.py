"""What charging costs the gateway: `.venv/bin/python -m bench.charge_bench [options]`.

Requests a second through the real gateway at 64 concurrent streams, this tree against a
baseline tree (`--baseline`, a git revision: the gateway before the budgets' reservations and
the counting of every event), in the same run: two gateway processes (bench/gateway_parts.py's),
each recording into SQLite with a daily budget on the key it is sent (so that every request is
reserved and released on this tree), in front of one fast local upstream that streams
`--tokens` SSE chunks with no pause, each with a running count as llama-server's
`timings_per_token` gives it (the counts this tree reads on every event; the baseline passes
them on unread). Each round sends `--requests` streamed chat completions through each gateway,
64 at a time, the two in an order that flips round by round. Per gateway: the median of the
rounds' requests a second, their spread, the ratio of the medians, and the median of the rounds'
own ratios; the gateway's CPU per request from /proc. The issue's goal: the reservation and the
counting cost at most 2 % at 64 streams. Prints tables; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_parts import fast_upstream, gateway  # noqa: E402
from bench.record_gateway_bench import Config, body, measure  # noqa: E402
from bench.standalone import machine, table  # noqa: E402

BASELINE: Final = "f44c43d"  # main before issue 36's reservations and counting
BUDGET: Final = "[budget]\ndaily_tokens = 1000000000000\n"


@contextmanager
def tree(revision: str) -> Iterator[Path]:
    """A worktree of this repository at `revision`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lucia-bench-baseline-") as tmp:
        where = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), revision],
            check=True,
            capture_output=True,
        )
        try:
            yield where
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                check=False,
                capture_output=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.charge_bench")
    parser.add_argument("--baseline", default=BASELINE, help="the git revision to compare with")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=1000, help="per gateway and round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="lucia-bench-charge-") as tmp,
        tree(args.baseline) as baseline,
    ):
        configs = [
            Config(f"baseline {args.baseline}", f'{BUDGET}[record]\npath = "{tmp}/before.db"\n'),
            Config("this tree", f'{BUDGET}[record]\npath = "{tmp}/now.db"\n'),
        ]
        roots = [baseline, ROOT]
        print(
            f"{machine()}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.streams} "
            f"streams, {args.tokens} tokens an answer with a running count on each, "
            f"{args.requests} requests per gateway and round, {args.rounds} rounds",
            flush=True,
        )
        began = time.monotonic()
        with ExitStack() as stack:
            upstream, _ = stack.enter_context(fast_upstream(args.tokens, 0.0, counts=True))
            for config, root in zip(configs, roots, strict=True):
                config.url, config.pid = stack.enter_context(
                    gateway(upstream, 2 * args.streams, None, config.extra, root=root)
                )
            asyncio.run(
                measure(configs, body(args.tokens), args.streams, args.requests, args.rounds)
            )
    before, now = configs
    base = statistics.median(before.rates)
    rows = []
    for config in configs:
        median = statistics.median(config.rates)
        paired = statistics.median(r / b for r, b in zip(config.rates, before.rates, strict=True))
        rows.append(
            (
                config.name,
                f"{median:.0f}",
                f"{min(config.rates):.0f}-{max(config.rates):.0f}",
                f"x{median / base:.3f}",
                f"x{paired:.3f}",
                f"{config.cpu / config.measured * 1e6:.0f}",
            )
        )
    print()
    print(
        f"Requests a second at {args.streams} streams ({args.rounds} rounds, "
        f"{time.monotonic() - began:.0f} s):"
    )
    table(rows, ("gateway", "median", "min-max", "vs baseline", "paired", "CPU µs/req"))
    end = os.getloadavg()
    print(f"load at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    ratio = statistics.median(now.rates) / base
    print(f"this tree: x{ratio:.3f} of the baseline's requests a second (goal: at least x0.98)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
