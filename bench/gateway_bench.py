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
gateway with the record off (what the record's writer costs), `--traced` this gateway with
`[tracing]` on, exporting its spans and metrics to the tests' OTLP/HTTP receiver
(tests/otlp_receiver.py, a thread of this process: what a span per request costs; tracing is
off on every other gateway path), `--baseline REV` the gateway of
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
import os
import platform
import re
import secrets
import sys
import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Final

import aiohttp

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_figures import (  # noqa: E402
    URL_IN_MESSAGE,
    Samples,
    error_of,
    goals,
    table_of,
    verdict,
)
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
from bench.procfs import cpu_seconds  # noqa: E402
from tests.otlp_receiver import Receiver, receiving  # noqa: E402

CHAT: Final = "/v1/chat/completions"
CONTENT: Final = re.compile(rb'"content":"[^"]')  # a chunk that carries a token


def body(tokens: int, upstream: str, stream: bool = True) -> bytes:
    extra = ', "ignore_eos": true' if upstream == "llama" else ""
    return (
        f'{{"model": "{MODEL}", "stream": {str(stream).lower()}, "max_tokens": {tokens}, '
        f'"temperature": 0, "messages": [{{"role": "user", "content": "hello"}}]{extra}}}'
    ).encode()


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
        "--traced",
        action="store_true",
        help="a path: this gateway with tracing on, to an OTLP/HTTP receiver in this process",
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
    receiver: Receiver | None = None
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
        if args.traced:
            receiver = stack.enter_context(receiving())
            traced = f'[tracing]\nendpoint = "{receiver.url}"\n'
            others.append(("traced", gateway(upstream, running, None, traced)))
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
    if receiver is not None:  # the traced gateway has stopped, exporting what it held
        print(f"traced: {len(receiver.spans())} spans at the receiver\n")
    paced = args.upstream == "fast" and args.token_ms > 0
    for line in goals(results, paced=paced, upstream=args.upstream, plain=args.plain):
        print(line)
    end = os.getloadavg()
    print(f"whole run {time.monotonic() - began:.0f} s, load at end {end[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
