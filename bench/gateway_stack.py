"""Which HTTP stack the gateway stands on: what a pass-through proxy adds over a direct call.

`python -m bench.gateway_stack [--requests N] [--rounds N] [--chunks N]`

One fast local upstream streams SSE chunks with no delay, which isolates the proxy's overhead.
Four paths reach it in the same run, interleaved round by round: direct; an aiohttp server with
an aiohttp client, on asyncio's loop and on uvloop's; and uvicorn (uvloop, httptools) serving a
bare ASGI app with an aiohttp client. Each proxy reads the request body, opens the upstream
request and passes every chunk on as it comes. The load generator is an aiohttp client in this
process; the upstream and each proxy are processes of their own. Prints p50 and p99 of the time
to the first chunk (TTFT) and to the end, at 1 and 16 concurrent streams, and each path minus
direct. It reports; it asserts nothing. Beyond the project's dependencies it needs uvicorn,
uvloop and httptools (`pip install uvicorn uvloop httptools`), for the paths it compares.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
from aiohttp import web

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

PATH = "/v1/chat/completions"
PROXIES = ("aiohttp", "aiohttp-uv", "uvicorn")
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the upstream ----------------------------------------------------------------------------


def serve_upstream(port: int, chunks: int) -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post(PATH, completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the proxies -----------------------------------------------------------------------------


def serve_aiohttp(port: int, upstream: str, uvloop: bool = False) -> None:
    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(
            upstream + PATH, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            response = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
            )
            await response.prepare(request)
            async for data in up.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post(PATH, proxy)
    if uvloop:
        import uvloop as loops

        asyncio.set_event_loop_policy(loops.EventLoopPolicy())
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_uvicorn(port: int, upstream: str) -> None:
    import uvicorn

    session: list[aiohttp.ClientSession] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session.append(
                        aiohttp.ClientSession(
                            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
                        )
                    )
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await session[0].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        async with session[0].post(
            upstream + PATH, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            await send(
                {
                    "type": "http.response.start",
                    "status": up.status,
                    "headers": [(b"content-type", up.headers["Content-Type"].encode())],
                }
            )
            async for data in up.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


# -- the load generator ----------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    start = time.perf_counter()
    first = 0.0
    async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as r:
        async for _ in r.content.iter_any():
            if not first:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


async def round_of(
    session: aiohttp.ClientSession, url: str, streams: int, requests: int
) -> list[tuple[float, float]]:
    results: list[tuple[float, float]] = []
    queue = iter(range(requests))

    async def lane() -> None:
        for _ in queue:
            results.append(await one(session, url))

    await asyncio.gather(*(lane() for _ in range(streams)))
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(paths: dict[str, str], requests: int, rounds: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in paths.values():  # warm every path and its connection pools
            await round_of(session, url + PATH, 16, 64)
        for streams in (1, 16):
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
            for _ in range(rounds):
                for name, url in paths.items():
                    samples[name] += await round_of(
                        session, url + PATH, streams, requests // rounds
                    )
            base_ttft = statistics.median(t for t, _ in samples["direct"])
            print(f"\n{streams} stream(s), {len(samples['direct'])} requests per path (ms)")
            print(
                f"{'path':<10}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}"
                f"{'total p99':>11}{'+ttft p50':>11}{'+total p50':>12}{'+total p99':>12}"
            )
            direct = samples["direct"]
            for name, got in samples.items():
                ttft = [t * 1000 for t, _ in got]
                total = [t * 1000 for _, t in got]
                dt = [t * 1000 for _, t in direct]
                print(
                    f"{name:<10}{pct(ttft, 0.5):>10.3f}{pct(ttft, 0.99):>10.3f}"
                    f"{pct(total, 0.5):>11.3f}{pct(total, 0.99):>11.3f}"
                    f"{pct(ttft, 0.5) - base_ttft * 1000:>11.3f}"
                    f"{pct(total, 0.5) - pct(dt, 0.5):>12.3f}"
                    f"{pct(total, 0.99) - pct(dt, 0.99):>12.3f}"
                )


def wait_listening(port: int, timeout: float = 30.0) -> None:
    """Return once something accepts on 127.0.0.1:port (bench/gateway_parts.py's too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_stack")
    parser.add_argument("--requests", type=int, default=800, help="per path and concurrency")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--chunks", type=int, default=64, help="SSE chunks per response")
    parser.add_argument("--serve", nargs=3, metavar=("KIND", "PORT", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, port, arg = args.serve
        {
            "upstream": lambda: serve_upstream(int(port), int(arg)),
            "aiohttp": lambda: serve_aiohttp(int(port), arg),
            "aiohttp-uv": lambda: serve_aiohttp(int(port), arg, uvloop=True),
            "uvicorn": lambda: serve_uvicorn(int(port), arg),
        }[kind]()
        return
    ports = {name: free_port() for name in ("direct", *PROXIES)}
    upstream = f"http://127.0.0.1:{ports['direct']}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.gateway_stack",
                "--serve",
                "upstream",
                str(ports["direct"]),
                str(args.chunks),
            ]
        ),
        *(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.gateway_stack",
                    "--serve",
                    kind,
                    str(ports[kind]),
                    upstream,
                ]
            )
            for kind in PROXIES
        ),
    ]
    try:
        for port in ports.values():
            wait_listening(port)
        print(
            f"python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {args.chunks} chunks"
        )
        asyncio.run(
            measure(
                {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}, args.requests, args.rounds
            )
        )
    finally:
        for child in children:
            child.send_signal(signal.SIGINT)
        for child in children:
            child.wait(timeout=10)


if __name__ == "__main__":
    main()
