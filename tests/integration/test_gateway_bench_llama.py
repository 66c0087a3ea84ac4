"""The gateway bench's direct path against the real llama-server (one model, as
bench/gateway_parts.py starts it), and the fact about llama-server it is built on.

llama-server closes the connection after a streamed answer, though its headers announce
keep-alive and no `Connection: close`; a plain answer keeps it. A client that pools its
connections sends its next request into the closed one, so the bench's direct path opens one
per request.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from bench.gateway_bench import body, fresh_paths, measure
from bench.gateway_parts import MODEL, llama_upstream
from supervisor.protocol.documents import Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from tests.fixtures import RUN_ID
from tests.gateway_proc import metric, running_gateway

pytestmark = pytest.mark.docker

TOKENS = 8
TIMEOUT_S = 180  # a socket read's limit: generous, as the machine is shared with vLLM's loads


@pytest.fixture(scope="module")
def llama_url(llama_server_image: str) -> Iterator[str]:
    # One compute thread: llama-server's default, a polling thread per core, starved beside
    # the vLLM cases on two cores until a short answer took over a minute. These cases are
    # about connections, not speed.
    with llama_upstream(f"t{RUN_ID}", 2, llama_server_image, threads=1) as (url, _):
        yield url


def raw_request(stream: bool) -> bytes:
    document = json.dumps(
        {
            "model": MODEL,
            "stream": stream,
            "max_tokens": TOKENS,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}],
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: llama\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(document) + document
    )


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP answer's head and body, chunked or of a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        assert got, f"closed before the head ended: {data!r}"
        data += got
    head, rest = data.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" in head.lower():
        while not rest.endswith(b"\r\n0\r\n\r\n"):
            got = sock.recv(65536)
            assert got, f"closed before the last chunk: {rest[-200:]!r}"
            rest += got
        return head, rest
    length = int(
        next(
            line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
        ).split(b":")[1]
    )
    while len(rest) < length:
        got = sock.recv(65536)
        assert got, "closed before the body ended"
        rest += got
    return head, rest


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)


def test_a_plain_answer_keeps_its_connection(llama_url: str) -> None:
    with connect(llama_url) as sock:
        for _ in range(2):
            sock.sendall(raw_request(stream=False))
            head, _ = read_answer(sock)
            assert head.startswith(b"HTTP/1.1 200"), head


def test_a_streamed_answer_closes_its_connection_though_its_head_says_keep_alive(
    llama_url: str,
) -> None:
    with connect(llama_url) as sock:
        sock.sendall(raw_request(stream=True))
        head, answer = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"data: [DONE]" in answer
        assert b"keep-alive: timeout=" in head.lower()
        assert b"connection: close" not in head.lower()
        # the next request on this connection is never answered: the server has closed it
        try:
            sock.sendall(raw_request(stream=True))
            after = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            after = b""
        assert after == b""


def test_the_benchs_direct_path_gets_every_answer_whole(llama_url: str) -> None:
    urls = {"direct": llama_url}
    fresh = fresh_paths("auto", "llama", urls)
    assert fresh == {"direct"}
    run = measure(
        urls,
        {},
        body(TOKENS, "llama"),
        levels=[1, 4],
        requests=16,
        rounds=2,
        tokens=TOKENS,
        fresh=fresh,
    )
    results = asyncio.run(run)
    for streams, got in results.items():
        direct = got["direct"]
        assert direct.failed == Counter(), streams
        assert len(direct.total) == 2 * max(8, 4 * streams)
        assert direct.tokens == TOKENS * len(direct.total)


def test_the_gateway_answers_every_stream_though_llama_server_closes_its_connections(
    llama_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The gateway pools its upstream connections: each streamed answer leaves a closed one in
    the pool, and a request sent into it is sent again on a new connection, never answered 502
    (before, 2-26 % of the bench's requests were). Clients send back to back, as the bench's
    do, so that a connection is taken again before its close is seen."""
    data = tmp_path_factory.mktemp("solo-data")
    now = utc_now()
    status = Status(
        generation=1,
        state="running",
        since=now,
        message="serving",
        url=llama_url,
        checked_at=now,
        models=(MODEL,),
    )
    write_atomic(ensure_dir(data / "solo") / "status.json", dump(status))
    document = {
        "model": MODEL,
        "stream": True,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hello"}],
    }

    async def client(url: str, key: str, count: int) -> Counter[int]:
        seen: Counter[int] = Counter()
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            for _ in range(count):
                async with session.post(url, json=document) as answer:
                    text = await answer.read()
                    seen[answer.status if text.endswith(b"data: [DONE]\n\n") else -1] += 1
        return seen

    async def clients(url: str, key: str) -> Counter[int]:
        found = await asyncio.gather(*(client(url, key, 20) for _ in range(2)))
        return sum(found, Counter())

    with running_gateway(tmp_path_factory.mktemp("solo-gateway"), data) as gateway:
        seen = asyncio.run(clients(gateway.url + "/v1/chat/completions", gateway.issued))
        assert seen == Counter({200: 40}), seen
        assert (
            metric(
                gateway.metrics(),
                "lucia_gateway_requests_total",
                model=MODEL,
                engine="solo",
                outcome="ok",
            )
            == 40
        )
