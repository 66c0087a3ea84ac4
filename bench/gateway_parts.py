"""What bench/gateway_bench.py stands up: the upstreams, and the real gateway in its own process.

- `fast`: an OpenAI-shaped local upstream (aiohttp) that streams a chat completion of N tokens
  as SSE chunks, one per token, then a chunk with its finish (`length`), with the usage chunk
  when `stream_options.include_usage` asks for it (as vLLM and llama-server do), each token
  `token_ms` after the last (0: none); a request with no `stream` gets the plain answer, after
  the same time. Its chunks are encoded once, at start, so that it costs as little as a real
  engine's HTTP side.
- `llama`: the real llama-server (scripts/llama-server-image.sh's image) with a tiny llama
  GGUF (tests/gguf_fixtures.py), published on 127.0.0.1 only, removed at the end.
- the gateway: `python -m supervisor.cli gateway` (the service the lucia-gateway unit runs)
  over a data directory whose one engine's status.json names the upstream's url, refreshed
  every few seconds as a worker's heartbeat is, with key files of mode 0600.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from aiohttp import web

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_stack import wait_listening  # noqa: E402
from supervisor.protocol.documents import Status, dump, utc_now  # noqa: E402
from supervisor.protocol.files import ensure_dir, write_atomic  # noqa: E402

ENGINE: Final = "bench"
MODEL: Final = "tiny"
INFERENCE_KEY: Final = "bench-inference-" + "k" * 40
OWNER_KEY: Final = "bench-owner-" + "o" * 40
HEARTBEAT_S: Final = 5.0
CONTAINER_PORT: Final = 8080


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_answering(url: str, timeout: float = 60.0) -> None:
    """Until GET url answers 200 (a process or container that has just been started)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except Exception as exc:  # anything, before it is up
            last = exc
        time.sleep(0.05)
    raise SystemExit(f"{url} did not answer within {timeout:g} s: {last}")


# -- the fast upstream -----------------------------------------------------------------------


def fast_chunks(tokens: int, counts: bool = False) -> tuple[list[bytes], bytes]:
    """The SSE events of one streamed answer of `tokens` tokens, and its usage event; with
    `counts`, every event carries a running count as llama-server's `timings_per_token` does."""

    def event(document: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"

    def timings(generated: int) -> dict[str, object]:
        if not counts:
            return {}
        return {
            "timings": {
                "cache_n": 0,
                "prompt_n": 8,
                "prompt_ms": 1.5,
                "prompt_per_token_ms": 0.19,
                "prompt_per_second": 5333.3,
                "predicted_n": generated,
                "predicted_ms": 0.3 * generated,
                "predicted_per_token_ms": 0.3,
                "predicted_per_second": 3333.3,
            }
        }

    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chunks = [
        event(
            {
                **head,
                "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
                **timings(index + 1),
            }
        )
        for index in range(tokens)
    ]
    chunks.append(
        event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    )
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    return chunks, event({**head, "choices": [], "usage": usage})


def fast_answer(tokens: int) -> bytes:
    """The plain (not streamed) answer of `tokens` tokens, with its usage."""
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok" * tokens},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        },
        separators=(",", ":"),
    ).encode()


def serve_fast(port: int, tokens: int, token_ms: float, counts: bool = False) -> None:
    chunks, usage = fast_chunks(tokens, counts)
    plain = fast_answer(tokens)
    pause = token_ms / 1000

    async def completions(request: web.Request) -> web.StreamResponse:
        document = json.loads(await request.read())
        if not document.get("stream"):
            if pause:
                await asyncio.sleep(pause * tokens)
            return web.Response(body=plain, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            if pause:
                await asyncio.sleep(pause)
            await response.write(chunk)
        if (document.get("stream_options") or {}).get("include_usage"):
            await response.write(usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


@contextmanager
def fast_upstream(tokens: int, token_ms: float, counts: bool = False) -> Iterator[tuple[str, int]]:
    """The fast upstream's url and pid, in a process of its own; `counts`: see fast_chunks."""
    port = free_port()
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.gateway_parts",
            "fast",
            str(port),
            str(tokens),
            str(token_ms),
            *(["counts"] if counts else []),
        ],
        cwd=ROOT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_answering(url + "/health")
        yield url, child.pid
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=10)


# -- the real llama-server -------------------------------------------------------------------


def llama_image() -> str:
    """scripts/llama-server-image.sh's image (it only reads the tag when it was built)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "llama-server-image.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"scripts/llama-server-image.sh failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


@contextmanager
def llama_upstream(
    run_id: str, slots: int, image: str | None = None, threads: int | None = None
) -> Iterator[tuple[str, int | None]]:
    """The real llama-server with a tiny llama model, on 127.0.0.1; its url (no pid: it runs
    in its container). `image`: scripts/llama-server-image.sh's unless given; `threads`:
    llama-server's own default (every core, polling) unless given."""
    from tests.gguf_fixtures import write_llama

    image = image or llama_image()
    port = free_port()
    name = f"lucia-bench-{run_id}-llama"
    with tempfile.TemporaryDirectory(prefix=f"lucia-bench-{run_id}-") as tmp:
        write_llama(Path(tmp) / "tiny.gguf")
        os.chmod(tmp, 0o755)
        args = [
            "docker",
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "--label",
            f"lucia.bench.run={run_id}",
            "--publish",
            f"127.0.0.1:{port}:{CONTAINER_PORT}",
            "--volume",
            f"{tmp}:/models:ro",
            image,
            "--model",
            "/models/tiny.gguf",
            "--alias",
            MODEL,
            "--host",
            "0.0.0.0",
            "--port",
            str(CONTAINER_PORT),
            "--parallel",
            str(slots),
            "--ctx-size",
            str(256 * slots),
            *(["--threads", str(threads)] if threads else []),
        ]
        subprocess.run(args, check=True, capture_output=True, timeout=120)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_answering(url + "/health", timeout=120)
            print(f"llama-server: {image}, {' '.join(args[args.index(image) + 1 :])}", flush=True)
            yield url, None
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)


# -- the floor: a bare aiohttp pass-through proxy (bench/gateway_stack.py's) ----------------


@contextmanager
def floor_proxy(
    upstream: str, wanted: bool, kind: str = "aiohttp"
) -> Iterator[tuple[str, int] | None]:
    """bench/gateway_stack.py's aiohttp proxy in front of `upstream`: what any proxy on the
    same stack costs, without the gateway's checks (its url and pid), when `wanted`. `kind`:
    `aiohttp` on asyncio's loop, `aiohttp-uv` on uvloop's."""
    if not wanted:
        yield None
        return
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "bench.gateway_stack",
        "--serve",
        kind,
        str(port),
        upstream,
    ]
    # quiet: a bare proxy has no retry, and logs every request llama-server's closed
    # connections broke (its failures are counted in the table)
    child = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        yield f"http://127.0.0.1:{port}", child.pid
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=10)


# -- the gateway -----------------------------------------------------------------------------


def write_status(data: Path, url: str, model: str = MODEL) -> None:
    """The worker's side of the file protocol: the engine runs at `url` and serves `model`."""
    now = utc_now()
    status = Status(
        generation=0,
        state="running",
        since=now,
        message="running",
        url=url,
        checked_at=now,
        models=(model,),
    )
    write_atomic(ensure_dir(data / ENGINE) / "status.json", dump(status))


def settings_text(port: int, owner: Path, inference: Path, running: int, extra: str = "") -> str:
    return f"""
[listen]
address = "127.0.0.1"
port = {port}

[keys]
owner_file = "{owner}"
inference_file = "{inference}"

[limits]
running = {running}
waiting = {running}

[probe]
interval_s = 0
{extra}"""


@contextmanager
def gateway(
    upstream: str,
    running: int,
    profile: Path | None,
    extra: str = "",
    root: Path = ROOT,
    *,
    port: int = 0,
    model: str = MODEL,
) -> Iterator[tuple[str, int]]:
    """The real gateway service in its own process, in front of `upstream`; its url and pid.
    With `profile`, it runs under cProfile, whose figures are written there at its stop.
    `extra` is appended to its settings (a `[record]` section, say). `root`: the source tree
    it runs from (another version's, for a baseline). `port`: 0, a free one; `model`: what
    its one engine serves."""
    with tempfile.TemporaryDirectory(prefix="lucia-bench-gateway-") as tmp:
        home = Path(tmp)
        data = home / "data"
        owner, inference = home / "owner.key", home / "inference.key"
        for path, key in ((owner, OWNER_KEY), (inference, INFERENCE_KEY)):
            path.write_text(key + "\n")
            path.chmod(0o600)
        port = port or free_port()
        settings = home / "gateway.toml"
        settings.write_text(settings_text(port, owner, inference, running, extra))
        write_status(data, upstream, model)
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT_S):
                write_status(data, upstream, model)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        wrap = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
        command = [
            sys.executable,
            *wrap,
            "-m",
            "supervisor.cli",
            "gateway",
            "--settings",
            str(settings),
            "--data-dir",
            str(data),
        ]
        env = {**os.environ, "PYTHONPATH": str(root), "XDG_CONFIG_HOME": str(home)}
        child = subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_answering(url + "/metrics")
            yield url, child.pid
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=60)
            stop.set()
            beat.join()


if __name__ == "__main__":
    if sys.argv[1] == "fast":
        serve_fast(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), "counts" in sys.argv)
