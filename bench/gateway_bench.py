"""Gateway overhead benchmark: `.venv/bin/python -m bench.gateway_bench [options]`.

What the gateway adds over a direct call: both paths against the same upstream in the same
run, interleaved round by round (the order flips each round), at 1, 16 and 64 concurrent
streams. The gateway is the real service (`lucia-supervisor gateway`, bench/gateway_parts.py)
in its own process, checking the key, routing by status.json, admitting, adding
`stream_options.include_usage` upstream and keeping the usage chunk from the client, as it does
for any streamed chat completion whose client did not ask for usage.

Upstreams (`--upstream`):
- `fast` (default): a local OpenAI-shaped upstream that streams `--tokens` SSE chunks, with no
  pause (isolates the overhead) or `--token-ms` between tokens (a paced engine);
- `llama`: the real llama-server with a tiny llama GGUF (needs docker and the image that
  scripts/llama-server-image.sh builds), `ignore_eos` so every answer has `--tokens` tokens.

The load generator is an aiohttp client in this process: every stream is a chat completion
with `stream: true`; the time to first token (TTFT) is to the first chunk that carries content,
the total to the end of the stream. An answer counts when it is whole: status 200, `[DONE]` at
its end, no error event, no finish other than `length`; any other is counted as failed, with
its reason, and left out of the times. Tokens a second: `--tokens` per whole answer over the
wall time of each path's rounds (llama-server sends a token that ends inside a UTF-8 character
with the next one, so its chunks are fewer than its tokens; `ignore_eos` makes it generate all
of them). The gateway's CPU per request comes from /proc; the load generator's own (this process's,
per path) shows when it, on the same cores, is what limits a path.

Client connections (`--client-connections`): each path has its own client pool. llama-server
closes the connection after every streamed answer, yet announces keep-alive (no `Connection:
close`), so a client that reuses it sends its next request into a closed socket ("Server
disconnected", "Can not write request body"). `auto` (default) opens a new connection per
request on the direct path to llama-server, as any client of it must, and keeps connections
elsewhere (the gateway serves keep-alive); `new` opens one per request on every path; `keep`
reuses on every path (it shows the failures).

More paths, each a process of its own in front of the same upstream, in the same interleaved
rounds: `--floor` a bare aiohttp pass-through proxy (bench/gateway_stack.py's, on asyncio's
loop), `--floor-uv` the same on uvloop's (what that loop buys a proxy), `--unrecorded` this
gateway with the record off (what the record's writer costs), `--baseline REV` the gateway of
revision REV (path `@REV`; repeatable), and LiteLLM's proxy when `--litellm` or
LUCIA_BENCH_LITELLM names its virtual environment (bench/gateway_peers.py; left out, said so,
when neither does). `--plain` asks for plain (not streamed) answers: their first token is
their end.

Prints a table; asserts nothing about timings. The goals (issue 39) it prints met or MISSED,
as far as the run speaks to them: with the fast upstream and no pause, added to the whole
answer at 1 stream p50 < +0.5 ms and p99 < +2 ms, at 64 streams >= 0.8x direct tokens a
second and above the floor proxy, and the gateway's CPU < 8 µs a token; paced
(`--token-ms`), >= 0.97x direct at 64 streams; with llama-server, < +5 ms added to the first
token's p50 at 16 streams; beside LiteLLM, at most 0.03x what it adds to the p50.
`--profile PATH` runs the gateway under cProfile and writes its figures to PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import sys
import time
from collections import Counter
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_parts import (  # noqa: E402
    INFERENCE_KEY,
    MODEL,
    fast_upstream,
    floor_proxy,
    gateway,
    llama_upstream,
)
from bench.gateway_peers import (  # noqa: E402
    LITELLM_KEY,
    find_litellm,
    litellm_proxy,
    revision_tree,
)
from bench.procfs import cpu_seconds, percentile  # noqa: E402

CHAT: Final = "/v1/chat/completions"
CONTENT: Final = re.compile(rb'"content":"[^"]')  # a chunk that carries a token
DONE: Final = b"data: [DONE]"
ERROR_EVENT: Final = re.compile(rb'^data: (\{"error".*)$', re.MULTILINE)
FINISH: Final = re.compile(rb'"finish_reason":"([^"]*)"')
URL_IN_MESSAGE: Final = re.compile(r" for https?://\S+")


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0  # the gateway's CPU seconds over these rounds
    client: float = 0.0  # the load generator's own CPU seconds over these rounds
    failed: Counter[str] = field(default_factory=Counter)  # reason -> answers not whole

    @property
    def attempted(self) -> int:
        return len(self.total) + self.failures

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    def ms(self, values: list[float], q: float) -> float:
        return percentile(values, q) * 1000


def body(tokens: int, upstream: str, stream: bool = True) -> bytes:
    extra = ', "ignore_eos": true' if upstream == "llama" else ""
    return (
        f'{{"model": "{MODEL}", "stream": {str(stream).lower()}, "max_tokens": {tokens}, '
        f'"temperature": 0, "messages": [{{"role": "user", "content": "hello"}}]{extra}}}'
    ).encode()


def error_of(document: bytes) -> str:
    """Pure: an OpenAI-shaped error document as `code: message`, short (the document itself
    when it is not one)."""
    try:
        error = json.loads(document)["error"]
        text = f"{error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        text = document.decode(errors="replace")
    return URL_IN_MESSAGE.sub("", text)[:160]


def verdict(answer: bytes, stream: bool = True) -> str | None:
    """Pure: why an answer is not whole, or None when it is: a stream's `[DONE]` at its end
    and no error event; a plain answer's finish; and no finish other than `length` (its
    tokens all generated)."""
    error = ERROR_EVENT.search(answer)
    if error:
        return "error event: " + error_of(error.group(1))
    if stream and not answer.rstrip().endswith(DONE):
        return "ended before [DONE]"
    found = {reason.decode() for reason in FINISH.findall(answer)}
    if not stream and not found:
        return "no finish: " + error_of(answer)
    finishes = sorted(found - {"length"})
    return f"finished: {', '.join(finishes)}" if finishes else None


async def one(
    session: aiohttp.ClientSession, url: str, data: bytes, key: str = INFERENCE_KEY
) -> tuple[float, float] | str:
    """One answer: seconds to the first token and to the end, or why it is not whole (a plain
    answer's first token is its end)."""
    stream = b'"stream": true' in data
    start = time.perf_counter()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    first = 0.0
    parts: list[bytes] = []
    try:
        async with session.post(url + CHAT, data=data, headers=headers) as response:
            if response.status != 200:
                return f"status {response.status}: {error_of(await response.read())}"
            async for chunk in response.content.iter_any():
                if stream and not first and CONTENT.search(chunk):
                    first = time.perf_counter() - start
                parts.append(chunk)
    except aiohttp.ClientError as exc:
        return URL_IN_MESSAGE.sub("", f"{type(exc).__name__}: {exc}")
    end = time.perf_counter() - start
    return verdict(b"".join(parts), stream) or (first or end, end)


async def round_of(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    *,
    streams: int,
    requests: int,
    tokens: int,
    into: Samples,
    pid: int | None = None,
    key: str = INFERENCE_KEY,
) -> None:
    queue = iter(range(requests))

    async def lane() -> None:
        for _ in queue:
            got = await one(session, url, data, key)
            if isinstance(got, str):
                into.failed[got] += 1
                continue
            into.ttft.append(got[0])
            into.total.append(got[1])
            into.tokens += tokens

    cpu = cpu_seconds(pid) if pid else 0.0
    client = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(streams)))
    into.wall += time.perf_counter() - start
    into.cpu += (cpu_seconds(pid) - cpu) if pid else 0.0
    into.client += time.process_time() - client


def session_for(new_connections: bool) -> aiohttp.ClientSession:
    """A client pool of its own: connections kept and reused, or a new one per request."""
    connector = aiohttp.TCPConnector(limit=0, force_close=new_connections)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False)


async def measure(
    urls: dict[str, str],
    pids: dict[str, int],
    data: bytes,
    *,
    levels: list[int],
    requests: int,
    rounds: int,
    tokens: int,
    fresh: frozenset[str] = frozenset(),
    keys: dict[str, str] | None = None,
) -> dict[int, dict[str, Samples]]:
    """Every level's samples by path; the paths named in `fresh` open a connection per
    request; `keys`: a path's bearer key where it is not the gateway's inference key."""
    key = (keys or {}).get
    results: dict[int, dict[str, Samples]] = {}
    sessions = {name: session_for(name in fresh) for name in urls}
    try:
        for name, url in urls.items():  # warm every path and its connection pool
            await round_of(
                sessions[name],
                url,
                data,
                streams=max(levels),
                requests=2 * max(levels),
                tokens=tokens,
                into=Samples(),
                key=key(name, INFERENCE_KEY),
            )
        for streams in levels:
            got = {name: Samples() for name in urls}
            per_round = max(requests // rounds, 4 * streams)
            for index in range(rounds):
                names = list(urls)
                for name in names if index % 2 == 0 else names[::-1]:
                    await round_of(
                        sessions[name],
                        urls[name],
                        data,
                        streams=streams,
                        requests=per_round,
                        tokens=tokens,
                        into=got[name],
                        pid=pids.get(name),
                        key=key(name, INFERENCE_KEY),
                    )
            results[streams] = got
            print(table_of(streams, got), flush=True)
    finally:
        for session in sessions.values():
            await session.close()
    return results


def table_of(streams: int, got: dict[str, Samples]) -> str:
    direct = got["direct"]
    rows = [
        f"{streams} stream(s), {direct.attempted} requests per path, ms:",
        f"  {'path':<11}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}{'total p99':>11}"
        f"{'tokens/s':>11}{'vs direct':>11}{'failed':>8}",
    ]
    rate = {name: s.tokens / s.wall if s.wall else 0.0 for name, s in got.items()}
    for name, s in got.items():
        versus = rate[name] / rate["direct"] if rate["direct"] else float("nan")
        rows.append(
            f"  {name:<11}{s.ms(s.ttft, 0.5):>10.3f}{s.ms(s.ttft, 0.99):>10.3f}"
            f"{s.ms(s.total, 0.5):>11.3f}{s.ms(s.total, 0.99):>11.3f}{rate[name]:>11.0f}"
            f"{versus:>10.3f}x{s.failures:>8}"
        )
    for name, s in got.items():
        if name == "direct":
            continue
        added = [s.ms(s.ttft, q) - direct.ms(direct.ttft, q) for q in (0.5, 0.99)]
        added += [s.ms(s.total, q) - direct.ms(direct.total, q) for q in (0.5, 0.99)]
        rows.append(
            f"  {'+' + name:<11}{added[0]:>+10.3f}{added[1]:>+10.3f}{added[2]:>+11.3f}"
            f"{added[3]:>+11.3f}"
        )
    for name, s in got.items():
        if s.cpu:
            rows.append(
                f"  {name} CPU: {s.cpu / s.attempted * 1e6:.0f} µs per request, "
                f"{s.cpu / max(1, s.tokens) * 1e6:.1f} µs per token"
            )
    rows.append(
        "  client CPU per request: "
        + ", ".join(f"{name} {s.client / s.attempted * 1e6:.0f} µs" for name, s in got.items())
    )
    for name, s in got.items():
        for reason, count in s.failed.most_common():
            rows.append(f"  {name} failed {count} of {s.attempted}: {reason}")
    return "\n".join(rows) + "\n"


def rate(s: Samples) -> float:
    return s.tokens / s.wall if s.wall else float("nan")


def added(got: dict[str, Samples], name: str, q: float, what: str = "total") -> float:
    """ms that path `name` adds to the direct path's percentile `q` of `what`."""
    path, direct = got[name], got["direct"]
    return path.ms(getattr(path, what), q) - direct.ms(getattr(direct, what), q)


def goals(
    results: dict[int, dict[str, Samples]], *, paced: bool, upstream: str, plain: bool
) -> list[str]:
    """Pure: the issue's goals this run's figures speak to, each met or MISSED."""
    lines = []

    def goal(text: str, met: bool) -> None:
        lines.append(f"{text}: {'met' if met else 'MISSED'}")

    one = results.get(1)
    if one is not None and upstream == "fast" and not paced:
        p50, p99 = added(one, "gateway", 0.5), added(one, "gateway", 0.99)
        goal(f"1 stream, added to the whole answer, p50: {p50:+.3f} ms (goal < +0.5 ms)", p50 < 0.5)
        goal(f"1 stream, added, p99: {p99:+.3f} ms (goal < +2 ms)", p99 < 2.0)
    many = results.get(64)
    if many is not None and upstream == "fast" and not plain:
        ratio = rate(many["gateway"]) / rate(many["direct"])
        if paced:
            goal(f"64 paced streams: {ratio:.3f}x direct tokens/s (goal >= 0.97x)", ratio >= 0.97)
        else:
            floor = rate(many["floor"]) / rate(many["direct"]) if "floor" in many else None
            above = floor is None or ratio > floor
            versus = f", the floor proxy {floor:.3f}x" if floor is not None else ""
            goal(
                f"64 unpaced streams: {ratio:.3f}x direct tokens/s{versus} (goal >= 0.8x and "
                f"above the floor)",
                ratio >= 0.8 and above,
            )
            g = many["gateway"]
            per_token = g.cpu / max(1, g.tokens) * 1e6
            goal(
                f"64 unpaced streams: gateway CPU {per_token:.1f} µs per token (goal < 8)",
                per_token < 8,
            )
    sixteen = results.get(16)
    if sixteen is not None and upstream == "llama" and not plain:
        first = added(sixteen, "gateway", 0.5, "ttft")
        goal(
            f"llama-server, 16 streams, added to the first token, p50: {first:+.3f} ms "
            "(goal < +5 ms)",
            first < 5.0,
        )
    for streams, got in results.items():
        if "litellm" not in got:
            continue
        ours, theirs = added(got, "gateway", 0.5), added(got, "litellm", 0.5)
        ratio = ours / theirs if theirs > 0 else float("nan")
        kind = "plain chat" if plain else "streamed"
        goal(
            f"{streams} stream(s), {kind}, added p50: gateway {ours:+.3f} ms, LiteLLM "
            f"{theirs:+.3f} ms: {ratio:.3f}x (goal <= 0.03x)",
            ratio <= 0.03,
        )
    for streams, got in results.items():
        for name, s in got.items():
            if s.failures:
                lines.append(
                    f"{streams} stream(s): {name} failed {s.failures} of {s.attempted} requests "
                    f"({s.failures / s.attempted:.1%}), left out of its times"
                )
    return lines


def fresh_paths(policy: str, upstream: str, urls: dict[str, str]) -> frozenset[str]:
    """Pure: the paths whose client opens a new connection per request (`--client-connections`)."""
    if policy == "new":
        return frozenset(urls)
    if policy == "auto" and upstream == "llama":
        return frozenset({"direct"})
    return frozenset()


def upstream_of(
    args: argparse.Namespace, run_id: str
) -> AbstractContextManager[tuple[str, int | None]]:
    if args.upstream == "llama":
        return llama_upstream(run_id, args.slots)
    return fast_upstream(args.tokens, args.token_ms)


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__)
    parser.add_argument("--upstream", choices=("fast", "llama"), default="fast")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--token-ms", type=float, default=0.0, help="fast: ms between tokens")
    parser.add_argument("--streams", default="1,16,64", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=400, help="per path and level")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per level")
    parser.add_argument("--slots", type=int, default=8, help="llama: llama-server's --parallel")
    parser.add_argument("--plain", action="store_true", help="plain chat answers, not streams")
    parser.add_argument(
        "--client-connections",
        choices=("auto", "new", "keep"),
        default="auto",
        help="a new connection per request: auto, on the direct path to llama-server; new, on "
        "every path; keep, on none",
    )
    parser.add_argument(
        "--floor", action="store_true", help="a path: a bare aiohttp pass-through proxy"
    )
    parser.add_argument(
        "--floor-uv", action="store_true", help="a path: the same proxy on uvloop's event loop"
    )
    parser.add_argument(
        "--unrecorded", action="store_true", help="a path: this gateway with the record off"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        action="append",
        default=[],
        help="a path: the gateway of revision REV (again for more)",
    )
    parser.add_argument(
        "--litellm",
        metavar="PATH",
        help="a path: LiteLLM's proxy, from this litellm command or virtual environment "
        "(default: $LUCIA_BENCH_LITELLM; left out, said so, when neither names one)",
    )
    parser.add_argument("--profile", type=Path, help="run the gateway under cProfile, to PATH")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser_of().parse_args(argv)
    levels = [int(n) for n in args.streams.split(",")]
    run_id = secrets.token_hex(3)
    began = time.monotonic()
    load = os.getloadavg()
    litellm, litellm_line = find_litellm(args.litellm)
    running = max(levels) * 2
    with ExitStack() as stack:
        upstream, _ = stack.enter_context(upstream_of(args, run_id))
        through, pid = stack.enter_context(gateway(upstream, running, args.profile))
        urls = {"direct": upstream, "gateway": through}
        pids = {"gateway": pid}
        others: list[tuple[str, AbstractContextManager[tuple[str, int] | None]]] = [
            ("floor", floor_proxy(upstream, args.floor)),
            ("floor-uv", floor_proxy(upstream, args.floor_uv, "aiohttp-uv")),
        ]
        if args.unrecorded:
            unrecorded = "[record]\nenabled = false\n"
            others.append(("unrecorded", gateway(upstream, running, None, unrecorded)))
        for revision in args.baseline:
            root = stack.enter_context(revision_tree(revision))
            others.append((f"@{revision}", gateway(upstream, running, None, root=root)))
        if litellm is not None:
            others.append(("litellm", litellm_proxy(litellm, upstream)))
        for name, context in others:
            got = stack.enter_context(context)
            if got is not None:
                urls[name], pids[name] = got
        fresh = fresh_paths(args.client_connections, args.upstream, urls)
        pace = f", {args.token_ms:g} ms apart" if args.upstream == "fast" else ""
        slots = f", --parallel {args.slots}" if args.upstream == "llama" else ""
        kind = "plain answers" if args.plain else "streams"
        baseline = f"; @REV: the gateway of {', '.join(args.baseline)}" if args.baseline else ""
        print(
            f"gateway bench {run_id}: upstream {args.upstream}{slots}, {args.tokens} tokens{pace}, "
            f"{kind}; a new connection per request on: {', '.join(sorted(fresh)) or 'none'}; "
            f"python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
            f"{os.cpu_count()} cores; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
            f"{baseline}\n{litellm_line}\n",
            flush=True,
        )
        data = body(args.tokens, args.upstream, stream=not args.plain)
        run = measure(
            urls,
            pids,
            data,
            levels=levels,
            requests=args.requests,
            rounds=args.rounds,
            tokens=args.tokens,
            fresh=fresh,
            keys={"litellm": LITELLM_KEY},
        )
        results = asyncio.run(run)
    paced = args.upstream == "fast" and args.token_ms > 0
    for line in goals(results, paced=paced, upstream=args.upstream, plain=args.plain):
        print(line)
    end = os.getloadavg()
    print(f"whole run {time.monotonic() - began:.0f} s, load at end {end[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
