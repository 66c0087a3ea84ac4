"""A span per request on the real parts: the real gateway process with tracing on, exporting to
the tests' OTLP/HTTP receiver (tests/otlp_receiver.py: the protocol's own protobuf messages, as
neither Debian nor PyPI carries a Collector or Jaeger here), in front of the real llama-server,
asked through the official `openai` client.

Between the gateway and llama-server sits a relay that records the headers each request
brought (llama-server logs none), so the traceparent the engine got can be read. Streamed,
plain, a refusal and a client that leaves mid-stream: the spans' tree and attributes, the
caller's trace continued, no prompt, answer or key anywhere in what was exported, and the
Lucia.Inference metrics. Last, a receiver that is down and one that never answers fail and
hold no request, and the gateway still stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import docker
import openai
import pytest
from aiohttp import web

from tests.fixtures import free_port
from tests.gateway_proc import Gateway, running_gateway
from tests.gguf_fixtures import TinyLlama, write_llama
from tests.host.gateway_world import write_status
from tests.integration.test_gateway_charges_llama import start_llama
from tests.otlp_receiver import ReceivedSpan, Receiver, receiving
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

MODEL = "tiny"  # start_llama's alias
ENGINE = "traced"
CONTEXT = 4096
PROMPT = "zebra lantern quartz: say something"  # searched for in every exported byte
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
ROOT = "POST /v1/chat/completions"
TRACING = '[tracing]\nendpoint = "{url}"\nmetrics_interval_s = 1\ntimeout_s = {timeout}\n'


class Relay:
    """An HTTP relay to llama-server on 127.0.0.1 that records each request's headers and
    passes its body and the answer on as they come (a stream chunk by chunk)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        body = await request.read()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                self.target + request.path,
                data=body,
                headers={"Content-Type": "application/json"},
            ) as upstream,
        ):
            kind = upstream.headers.get("Content-Type", "application/json")
            answer = web.StreamResponse(status=upstream.status, headers={"Content-Type": kind})
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    def _run(self) -> None:
        async def main() -> None:
            app = web.Application()
            app.router.add_post("/v1/{route:.*}", self._handle)
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.url = f"http://127.0.0.1:{port}"
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop.run_until_complete(main())

    def __enter__(self) -> Relay:
        self._thread.start()
        assert self._ready.wait(30), "the relay did not start"
        return self

    def __exit__(self, *_: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@contextlib.contextmanager
def heartbeat(data: Path, url: str) -> Iterator[None]:
    """The engine's status.json, as a worker keeps it fresh, naming the relay's URL."""

    def beat() -> None:
        write_status(data, ENGINE, "running", url=url, models=(MODEL,), generation=1)

    beat()
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(5):
            beat()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="module")
def llama_url(
    client: docker.DockerClient,
    llama_server_image: str,
    llama_network: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    models = tmp_path_factory.mktemp("tracing-models")
    write_llama(models / "tiny.gguf", TinyLlama(context=CONTEXT))
    models.chmod(0o755)
    container, url = start_llama(client, llama_server_image, llama_network, models)
    yield url
    container.remove(force=True)


@pytest.fixture(scope="module")
def relay(llama_url: str) -> Iterator[Relay]:
    with Relay(llama_url) as found:
        yield found


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as found:
        yield found


@pytest.fixture(scope="module")
def gateway(
    relay: Relay, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("traced-gateway")
    data = work / "data"
    with (
        heartbeat(data, relay.url),
        running_gateway(work / "gateway", data, TRACING.format(url=receiver.url, timeout=10)) as gw,
    ):
        yield gw


def the_request(receiver: Receiver, check: Callable[[ReceivedSpan], bool]) -> list[ReceivedSpan]:
    """The spans of the one request whose root span passes `check`: its root first, once its
    export came (the batch processor exports every few seconds)."""
    found: list[ReceivedSpan] = []

    def exported() -> bool:
        every = receiver.spans()
        roots = [span for span in every if span.name == ROOT and check(span)]
        if len(roots) != 1:
            return False
        root = roots[0]
        found[:] = [root, *[span for span in every if span.parent_id == root.span_id]]
        return True

    wait_for(exported, 60, "the request's spans at the receiver")
    return found


def tree(spans: list[ReceivedSpan]) -> tuple[ReceivedSpan, dict[str, ReceivedSpan]]:
    root, children = spans[0], {span.name: span for span in spans[1:]}
    assert len(children) == len(spans) - 1
    for child in children.values():
        assert child.trace_id == root.trace_id
        assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns
    return root, children


def sent_to_engine(relay: Relay, root: ReceivedSpan) -> dict[str, str]:
    """The headers of the request the engine got under this root span."""
    parent = f"00-{root.trace_id}-{root.span_id}-01"
    found = [headers for headers in relay.headers if headers.get("traceparent") == parent]
    assert len(found) == 1, [headers.get("traceparent") for headers in relay.headers]
    return found[0]


def test_a_plain_chat_continues_the_callers_trace_and_the_engine_gets_the_gateway_span(
    gateway: Gateway, relay: Relay, receiver: Receiver
) -> None:
    answer = gateway.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        extra_headers={"traceparent": CALLER},
        extra_body={"ignore_eos": True},
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 24
    root, children = tree(the_request(receiver, lambda span: span.trace_id == CALLER_TRACE))
    assert root.parent_id == CALLER_SPAN  # the caller's trace, continued
    assert set(children) == {"lucia.wait", "lucia.dial", "lucia.answer"}
    assert children["lucia.dial"].end_ns <= children["lucia.answer"].start_ns
    attributes = root.attributes
    assert attributes["lucia.outcome"] == "ok" and attributes["lucia.engine"] == ENGINE
    assert attributes["lucia.model"] == MODEL and attributes["lucia.key_id"].startswith("key_")
    assert attributes["lucia.completion_tokens"] == 24 and attributes["lucia.prompt_tokens"] > 0
    assert attributes["lucia.usage_source"] == "engine"
    assert attributes["http.response.status_code"] == 200
    headers = sent_to_engine(relay, root)
    assert "Authorization" not in headers and "authorization" not in headers
    content = answer.choices[0].message.content or ""
    exported = receiver.exported()
    assert PROMPT.encode() not in exported and gateway.issued.encode() not in exported
    if len(content.strip()) >= 12:  # an answer long enough to be told from chance bytes
        assert content.encode() not in exported


def test_a_stream_has_its_answer_and_its_own_trace(
    gateway: Gateway, relay: Relay, receiver: Receiver
) -> None:
    before = {span.trace_id for span in receiver.spans()}
    stream = gateway.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    root, children = tree(
        the_request(
            receiver,
            lambda span: (
                span.trace_id not in before and span.attributes.get("lucia.completion_tokens") == 16
            ),
        )
    )
    assert root.parent_id == "" and root.trace_id != CALLER_TRACE  # a trace of its own
    assert set(children) == {"lucia.wait", "lucia.dial", "lucia.answer"}
    assert root.attributes["lucia.outcome"] == "ok"
    sent_to_engine(relay, root)
    if len(text.strip()) >= 12:
        assert text.encode() not in receiver.exported()


def test_a_refusal_is_a_span_marked_as_an_error(gateway: Gateway, receiver: Receiver) -> None:
    with pytest.raises(openai.BadRequestError):
        gateway.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=99
        )
    root, children = tree(
        the_request(
            receiver, lambda span: span.attributes.get("lucia.outcome") == "refused:n_too_large"
        )
    )
    assert children == {}  # refused before it asked for a slot
    assert root.attributes["http.response.status_code"] == 400
    assert (root.status_code, root.status_message) == (2, "refused:n_too_large")  # ERROR


def test_a_client_that_leaves_mid_stream_ends_its_span_as_gone(
    gateway: Gateway, relay: Relay, receiver: Receiver
) -> None:
    stream = gateway.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for got, _ in enumerate(stream):
        if got == 3:
            break
    stream.close()
    root, children = tree(
        the_request(receiver, lambda span: span.attributes.get("lucia.outcome") == "client_gone")
    )
    assert "lucia.answer" in children
    assert root.status_code == 0  # a client leaving is no error of the gateway's
    assert root.attributes["lucia.usage_source"] in ("engine_partial", "counted")
    sent_to_engine(relay, root)


def test_the_figures_reach_the_receiver_under_the_meter_lucia_inference(
    gateway: Gateway, receiver: Receiver
) -> None:
    gateway.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    wanted = {
        "lucia.inference.input_tokens",
        "lucia.inference.output_tokens",
        "lucia.inference.time_to_first_token",
        "lucia.inference.duration",
    }

    def seen() -> set[str]:
        return {
            point.metric
            for point in receiver.points()
            if point.scope == "Lucia.Inference" and point.attributes.get("model") == MODEL
        }

    wait_for(lambda: seen() >= wanted, 60, "the Lucia.Inference metrics")
    outcomes = {
        point.attributes["outcome"]
        for point in receiver.points()
        if point.metric == "lucia.inference.duration"
    }
    assert "ok" in outcomes
    assert gateway.issued.encode() not in receiver.exported()


@pytest.mark.parametrize("receiver_is", ["down", "stuck"])
def test_a_receiver_that_is_down_or_stuck_never_fails_or_holds_a_request(
    receiver_is: str, relay: Relay, tmp_path: Path
) -> None:
    """Once an export is under way (to a port nothing listens on, retried; or to a receiver
    that reads and never answers, for up to 600 s), requests are answered as before, each
    bounded by its client's 60 s. The gateway still stops at SIGTERM, and says the exporter's
    trouble at most once a minute for each kind of line."""
    data = tmp_path / "data"
    with contextlib.ExitStack() as stack:
        stuck = stack.enter_context(receiving(hang=True)) if receiver_is == "stuck" else None
        # nothing listens on a free port
        url = stuck.url if stuck is not None else f"http://127.0.0.1:{free_port()}"
        stack.enter_context(heartbeat(data, relay.url))
        gw = stack.enter_context(
            running_gateway(tmp_path / "gateway", data, TRACING.format(url=url, timeout=600))
        )
        client = gw.client(timeout=60)

        def ask() -> None:
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2
            )
            assert answer.choices

        ask()
        if stuck is not None:  # the metrics' first export (every second) is held there
            wait_for(lambda: stuck.posts > 0, 60, "an export held by the stuck receiver")
        else:
            wait_for(lambda: "tracing: the exporter says" in gw.log_text(), 60, "a failed export")
        for _ in range(12):
            ask()
        proc = gw.proc
    assert proc.returncode == 0, gw.log_text()[-3000:]
    log = gw.log_text()
    assert log.count("tracing: the exporter says") <= 6, log[-3000:]
    assert "not all spans and figures were exported at the stop" in log
    assert PROMPT not in log and gw.issued not in log
