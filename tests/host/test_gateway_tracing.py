"""A span per request and the Lucia.Inference metrics: the pure parts in tables, then the
gateway in front of a fast local upstream that records the headers it got, exporting to the
tests' OTLP/HTTP receiver (tests/otlp_receiver.py). The proof on the real gateway process and
the real llama-server is tests/integration/test_gateway_tracing_llama.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from supervisor.host.gateway import spans
from supervisor.host.gateway.app import Intervals, create_app
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.gateway.tracing import METER, Tracing
from supervisor.host.proxy.forward import Trace
from tests.host.gateway_world import (
    AUTH,
    KEYS,
    SETTINGS,
    Upstream,
    World,
    serve_upstream,
    until,
    write_status,
)
from tests.otlp_receiver import ReceivedSpan, Receiver, receiving

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a secret prompt"}]}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_PARENT = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"


# -- the pure parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (CALLER_PARENT, True),
        (f"00-{CALLER_TRACE}-00f067aa0ba902b7-00", True),  # not sampled: still a context
        (f"01-{CALLER_TRACE}-00f067aa0ba902b7-01-more", True),  # a later version may add
        (f"00-{CALLER_TRACE}-00f067aa0ba902b7-01-more", False),  # version 00 may not
        (f"ff-{CALLER_TRACE}-00f067aa0ba902b7-01", False),  # version ff is invalid
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", False),  # an all-zero trace id
        (f"00-{CALLER_TRACE}-{'0' * 16}-01", False),  # an all-zero parent id
        (f"00-{CALLER_TRACE.upper()}-00f067aa0ba902b7-01", False),  # lowercase only
        (f"00-{CALLER_TRACE[:-1]}-00f067aa0ba902b7-01", False),  # a short trace id
        ("00-a-b-01", False),
        ("", False),
        (f" {CALLER_PARENT}", False),
    ],
)
def test_a_traceparent_is_taken_only_in_the_w3c_format(value: str, valid: bool) -> None:
    assert spans.valid_traceparent(value) is valid


@pytest.mark.parametrize(
    ("headers", "passed"),
    [
        ({}, None),
        ({"traceparent": CALLER_PARENT}, {"traceparent": CALLER_PARENT}),
        (
            {"traceparent": CALLER_PARENT, "tracestate": "vendor=abc,other=1"},
            {"traceparent": CALLER_PARENT, "tracestate": "vendor=abc,other=1"},
        ),
        ({"traceparent": CALLER_PARENT, "tracestate": "x" * 513}, {"traceparent": CALLER_PARENT}),
        ({"traceparent": CALLER_PARENT, "tracestate": "é=1"}, {"traceparent": CALLER_PARENT}),
        ({"traceparent": "nonsense", "tracestate": "vendor=abc"}, None),
        ({"tracestate": "vendor=abc"}, None),
    ],
)
def test_with_tracing_off_a_valid_caller_context_is_passed_on_as_it_came(
    headers: dict[str, str], passed: dict[str, str] | None
) -> None:
    assert spans.passed_on(headers) == passed


def _trace(**times: float | None) -> Trace:
    trace = Trace(arrived=0.0)
    for name, value in times.items():
        setattr(trace, name, value)
    return trace


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        # refused before it asked for a slot: no child at all
        ({}, []),
        # admitted at once, sent, answered
        (
            {"queued": 1.0, "admitted": 1.0, "sent": 1.5, "answered": 2.0},
            [("lucia.wait", 1.0, 1.0), ("lucia.dial", 1.5, 2.0), ("lucia.answer", 2.0, 9.0)],
        ),
        # a start on demand inside the wait
        (
            {"queued": 1.0, "starting": 1.0, "started": 5.0, "admitted": 5.5, "sent": 6.0},
            [
                ("lucia.wait", 1.0, 5.5),
                ("lucia.start", 1.0, 5.0),
                ("lucia.dial", 6.0, 9.0),  # never answered: it ends with the request
            ],
        ),
        # refused or gone while waiting: the wait ends with the request
        ({"queued": 1.0}, [("lucia.wait", 1.0, 9.0)]),
        # a clock that steps back never makes a span end before it starts
        ({"queued": 9.5, "admitted": 9.2}, [("lucia.wait", 9.5, 9.5)]),
    ],
)
def test_a_request_span_has_a_child_for_each_stretch_it_went_through(
    times: dict[str, float], expected: list[tuple[str, float, float]]
) -> None:
    found = spans.stretches(_trace(**times), 9.0)
    assert [(s.name, s.start, s.end) for s in found] == expected


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ('endpoint = "ftp://collector:4318"', "an OTLP/HTTP base URL"),
        ('endpoint = "collector:4318"', "an OTLP/HTTP base URL"),
        ('endpoint = "http://user:secret@collector:4318"', "no credentials in the URL"),
        ('endpoint = "http://collector:4318/?token=1"', "no query or fragment"),
        ('endpoint = "http://collector:99999"', "tracing.endpoint"),
        ("sample_ratio = 1.5", "tracing.sample_ratio"),
        ("metrics_interval_s = 0.1", "tracing.metrics_interval_s"),
        ("timeout_s = 0", "tracing.timeout_s"),
        ('service_name = "lucia gateway"', "tracing.service_name"),
        ('headers = "x"', "tracing.headers: unknown setting"),
    ],
)
def test_bad_tracing_settings_are_refused_naming_the_setting(section: str, error: str) -> None:
    with pytest.raises(SettingsError, match=error) as raised:
        parse(f"[tracing]\n{section}\n", "gateway.toml")
    assert "secret" not in str(raised.value)


def test_tracing_is_off_by_default_and_an_endpoint_names_both_signals() -> None:
    assert parse("", "t").tracing.endpoint == ""
    on = parse('[tracing]\nendpoint = "https://collector.example:4318/otlp/"\n', "t").tracing
    assert on.endpoint == "https://collector.example:4318/otlp"


# -- the gateway in front of a fast upstream -----------------------------------------------


@asynccontextmanager
async def traced(
    tmp_path: Path,
    receiver_url: str | None,
    upstream: Upstream | None = None,
    timeout_s: float = 10,
) -> AsyncIterator[tuple[World, Tracing | None]]:
    """The gateway with tracing to `receiver_url` (None: off) in front of a fast upstream;
    `timeout_s`: how long an export waits for the receiver."""
    data = tmp_path / "data"
    data.mkdir()
    up = upstream or Upstream()
    engine = await serve_upstream(up)
    text = SETTINGS
    if receiver_url is not None:
        text += (
            f'[tracing]\nendpoint = "{receiver_url}"\nmetrics_interval_s = 3600\n'
            f"timeout_s = {timeout_s}\n"
        )
    settings = parse(text, "test")
    tracing = Tracing(settings.tracing) if settings.tracing.endpoint else None
    app = create_app(
        settings,
        data,
        KEYS,
        Intervals(keepalive_s=0.05, poll_s=0.02, idle_check_s=0.02, bounds_s=0.02),
        tracing=tracing,
    )
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    try:
        yield World(data, up, gateway, engine), tracing
    finally:
        await gateway.close()
        await engine.close()
        if tracing is not None:
            await tracing.close()


def serving(w: World) -> None:
    write_status(w.data, "small", "running", url=w.upstream.url, generation=1)


def by_name(found: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named = {span.name: span for span in found}
    assert len(named) == len(found), [span.name for span in found]
    return named


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def exported(receiver: Receiver, tracing: Tracing, spans_at_least: int) -> list[ReceivedSpan]:
    tracing.flush()
    return receiver.spans() if len(receiver.spans()) >= spans_at_least else []


def test_a_plain_request_is_one_span_with_its_stretches_and_its_row(tmp_path: Path) -> None:
    upstream = Upstream()
    with receiving() as receiver:

        async def scenario() -> None:
            async with traced(tmp_path, receiver.url, upstream) as (w, tracing):
                assert tracing is not None
                serving(w)
                headers = {**AUTH, "traceparent": CALLER_PARENT, "tracestate": "vendor=abc"}
                async with (
                    aiohttp.ClientSession(headers=headers) as s,
                    s.post(f"{w.base}/chat/completions", json=CHAT) as r,
                ):
                    assert r.status == 200
                    await r.read()
                await until(lambda: bool(exported(receiver, tracing, 4)))

        run(scenario)
    named = by_name(receiver.spans())
    assert set(named) == {"POST /v1/chat/completions", "lucia.wait", "lucia.dial", "lucia.answer"}
    root = named["POST /v1/chat/completions"]
    assert (root.trace_id, root.parent_id) == (CALLER_TRACE, "00f067aa0ba902b7")
    assert root.service == "lucia-gateway" and root.scope == "lucia.gateway"
    assert root.kind == 2  # SPAN_KIND_SERVER
    for child in ("lucia.wait", "lucia.dial", "lucia.answer"):
        assert named[child].parent_id == root.span_id and named[child].trace_id == CALLER_TRACE
        assert root.start_ns <= named[child].start_ns <= named[child].end_ns <= root.end_ns
    assert named["lucia.dial"].end_ns <= named["lucia.answer"].start_ns
    attributes = root.attributes
    assert attributes["lucia.key_id"] == "inference"
    assert (attributes["lucia.model"], attributes["lucia.engine"]) == ("tiny", "small")
    assert attributes["lucia.outcome"] == "ok" and attributes["http.response.status_code"] == 200
    assert (attributes["lucia.prompt_tokens"], attributes["lucia.completion_tokens"]) == (5, 3)
    assert attributes["lucia.usage_source"] == "engine"
    assert attributes["lucia.build.engine_version"] == "unknown"
    assert root.status_code == 0  # unset: no error
    # the engine got a traceparent naming the gateway's span, in the caller's trace
    got = upstream.headers[0]
    assert got["traceparent"] == f"00-{CALLER_TRACE}-{root.span_id}-01"
    assert got["tracestate"] == "vendor=abc"
    assert "Authorization" not in got
    everything = receiver.exported()
    assert b"a secret prompt" not in everything and KEY_BYTES not in everything


KEY_BYTES = AUTH["Authorization"].removeprefix("Bearer ").encode()


def test_a_refusal_before_routing_and_a_stream_each_have_their_span(tmp_path: Path) -> None:
    with receiving() as receiver:

        async def scenario() -> None:
            async with traced(tmp_path, receiver.url) as (w, tracing):
                assert tracing is not None
                serving(w)
                async with aiohttp.ClientSession(headers=AUTH) as s:
                    unknown = {**CHAT, "model": "nowhere"}
                    async with s.post(f"{w.base}/chat/completions", json=unknown) as r:
                        assert r.status == 404
                    streamed = {**CHAT, "stream": True}
                    async with s.post(f"{w.base}/chat/completions", json=streamed) as r:
                        assert (await r.read()).endswith(b"data: [DONE]\n\n")
                await until(lambda: bool(exported(receiver, tracing, 5)))

        run(scenario)
    roots = [span for span in receiver.spans() if span.parent_id == ""]
    assert len(roots) == 2 and roots[0].trace_id != roots[1].trace_id  # each its own trace
    refused, stream = sorted(roots, key=lambda span: span.start_ns)
    assert refused.attributes["lucia.outcome"].startswith("refused:")
    assert refused.attributes["http.response.status_code"] == 404
    assert "lucia.model" not in refused.attributes  # a name no row may keep is not kept
    assert (refused.status_code, refused.status_message) == (2, refused.attributes["lucia.outcome"])
    assert not [span for span in receiver.spans() if span.parent_id == refused.span_id]
    children = {span.name for span in receiver.spans() if span.parent_id == stream.span_id}
    assert children == {"lucia.wait", "lucia.dial", "lucia.answer"}
    assert stream.attributes["lucia.outcome"] == "ok"
    assert b"nowhere" not in receiver.exported()


def test_a_start_on_demand_is_a_stretch_of_its_own_inside_the_wait(tmp_path: Path) -> None:
    with receiving() as receiver:

        async def scenario() -> None:
            async with traced(tmp_path, receiver.url) as (w, tracing):
                assert tracing is not None
                write_status(w.data, "small", "stopped")
                async with aiohttp.ClientSession(headers=AUTH) as s:
                    asked = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=CHAT))
                    await until(lambda: w.desired() is not None)
                    serving(w)  # the worker answers: running
                    async with await asked as r:
                        assert r.status == 200
                await until(lambda: bool(exported(receiver, tracing, 5)))

        run(scenario)
    named = by_name(receiver.spans())
    wait, start = named["lucia.wait"], named["lucia.start"]
    assert wait.start_ns <= start.start_ns <= start.end_ns <= wait.end_ns
    assert start.parent_id == named["POST /v1/chat/completions"].span_id


def test_with_tracing_off_the_engine_gets_the_callers_context_and_nothing_more(
    tmp_path: Path,
) -> None:
    upstream = Upstream()

    async def scenario() -> None:
        async with traced(tmp_path, None, upstream) as (w, tracing):
            assert tracing is None and w.app.tracing is None
            serving(w)
            async with aiohttp.ClientSession(headers=AUTH) as s:
                for extra in ({"traceparent": CALLER_PARENT}, {}, {"traceparent": "bad"}):
                    async with s.post(f"{w.base}/chat/completions", json=CHAT, headers=extra) as r:
                        assert r.status == 200

    run(scenario)
    passed, none, bad = (headers.get("traceparent") for headers in upstream.headers)
    assert (passed, none, bad) == (CALLER_PARENT, None, None)
    assert all("tracestate" not in headers for headers in upstream.headers)


def test_the_figures_are_offered_under_the_meter_lucia_inference(tmp_path: Path) -> None:
    with receiving() as receiver:

        async def scenario() -> None:
            async with traced(tmp_path, receiver.url) as (w, tracing):
                assert tracing is not None
                serving(w)
                async with aiohttp.ClientSession(headers=AUTH) as s:
                    for stream in (False, True):
                        async with s.post(
                            f"{w.base}/chat/completions", json={**CHAT, "stream": stream}
                        ) as r:
                            await r.read()
                tracing.flush()

        run(scenario)
    points = [point for point in receiver.points() if point.scope == METER]
    by_metric: dict[str, list[Any]] = {}
    for point in points:
        by_metric.setdefault(point.metric, []).append(point)
    assert set(by_metric) >= {
        "lucia.inference.input_tokens",
        "lucia.inference.output_tokens",
        "lucia.inference.time_to_first_token",
        "lucia.inference.duration",
    }
    for point in points:
        assert point.attributes == {"model": "tiny", "outcome": "ok"}
    assert by_metric["lucia.inference.output_tokens"][0].value >= 3
    assert by_metric["lucia.inference.duration"][0].count == 2
    assert by_metric["lucia.inference.duration"][0].unit == "s"


def test_a_receiver_that_never_answers_holds_no_request_and_no_stop(tmp_path: Path) -> None:
    """Its exports wait in the SDK's threads, each up to its timeout of 600 s; the requests go
    on (each bounded by the client's 60 s), and the stop gives up on what was left after its
    bound (said in the journal)."""
    with receiving(hang=True) as receiver:

        async def scenario() -> None:
            async with traced(tmp_path, receiver.url, timeout_s=600) as (w, tracing):
                assert tracing is not None
                serving(w)
                bound = aiohttp.ClientTimeout(total=60)
                async with aiohttp.ClientSession(headers=AUTH, timeout=bound) as s:
                    for _ in range(300):  # more spans than a batch: an export is under way
                        async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                            assert r.status == 200
                            await r.read()
                await until(lambda: receiver.posts > 0)
                await tracing.close(within_s=0.2)

        run(scenario)
