"""What a stream costs, read from the engines' own events (proxy/usage.py): pure tables over
streams the real llama-server and the real vLLM CPU server sent (tests/data/streams/README.md).

The end-to-end proof, the engines' own counters against the record's rows, is
tests/integration/test_gateway_charges_*.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.host.proxy.usage import (
    AFTER_CLOSE,
    AnswerScan,
    Pace,
    UsageFilter,
    pace_of,
    running_counts,
    unseen,
)

STREAMS = Path(__file__).resolve().parents[1] / "data" / "streams"
NAMES = sorted(path.stem for path in STREAMS.glob("*.sse"))


def events(name: str) -> list[bytes]:
    raw = (STREAMS / f"{name}.sse").read_bytes()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event.strip()]


def documents(stream: bytes) -> list[dict[str, Any]]:
    found = []
    for event in stream.split(b"\n\n"):
        for line in event.splitlines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                found.append(json.loads(line[6:]))
    return found


def final(name: str) -> tuple[int, int]:
    """The engine's usage for the whole answer, as its last usage says (prompt, completion)."""
    for document in reversed(documents(b"".join(events(name)))):
        usage = document.get("usage") or (document.get("response") or {}).get("usage")
        if isinstance(usage, dict):
            return (
                usage.get("prompt_tokens", usage.get("input_tokens")),
                usage.get("completion_tokens", usage.get("output_tokens")),
            )
    raise AssertionError(f"{name} has no usage")


def generated_by(name: str, count: int) -> int | None:
    """The engine's running count of tokens generated at the end of the first `count` events."""
    seen = None
    for event in events(name)[:count]:
        for document in documents(event):
            timings = document.get("timings")
            usage = document.get("usage")
            if isinstance(timings, dict):
                seen = timings["predicted_n"]
            elif isinstance(usage, dict) and "completion_tokens" in usage:
                seen = usage["completion_tokens"]
    return seen


def pieces(stream: bytes, how: str) -> list[bytes]:
    if how == "whole":
        return [stream]
    if how == "bytes":
        return [stream[i : i + 1] for i in range(len(stream))]
    return [stream[i : i + 97] for i in range(0, len(stream), 97)]


@pytest.mark.parametrize("how", ["whole", "bytes", "97"])
@pytest.mark.parametrize("name", NAMES)
def test_a_whole_stream_costs_the_engines_own_usage(name: str, how: str) -> None:
    stream = b"".join(events(name))
    usage = UsageFilter(hide=False, strip=False)
    out = b"".join(usage.feed(piece) for piece in pieces(stream, how)) + usage.close()
    assert out == stream
    charged, source = usage.charged(prompt_estimate=999, whole=True)
    assert source == "engine"
    assert charged is not None
    prompt = charged.get("prompt_tokens", charged.get("input_tokens"))
    completion = charged.get("completion_tokens", charged.get("output_tokens"))
    assert (prompt, completion) == final(name)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "vllm_responses"])
def test_a_stream_ended_early_costs_the_engines_count_at_the_last_event_read(name: str) -> None:
    """Cut after each event: the running count there, as the engine said it, and what it
    generates before it notices the close (never 0 once an event with a count passed)."""
    all_events = events(name)
    for cut in range(1, len(all_events)):
        usage = UsageFilter(hide=True, strip=True)
        for event in all_events[:cut]:
            usage.feed(event)
        charged, source = usage.charged(prompt_estimate=999, whole=False)
        expected = generated_by(name, cut)
        if expected is None:
            assert source == "counted", (cut, charged)
            continue
        assert charged is not None
        ended = any(
            d.get("choices") == [] or d.get("type") == "response.completed"
            for e in all_events[:cut]
            for d in documents(e)
        )
        at = ("engine", expected) if ended else ("engine_partial", expected + AFTER_CLOSE)
        assert (source, charged.get("completion_tokens", charged.get("output_tokens"))) == at
        if not ended:
            assert charged["prompt_tokens"] == final(name)[0], "the prompt, as the engine said"
        continue


@pytest.mark.parametrize(
    ("last", "before", "elapsed_s", "bound", "most"),
    [
        # 101 tokens in 100 ms (its first at 0): 1 a ms; 20 ms unaccounted for
        (Pace(101, 30.0, 100.0), None, 0.150, 3000, 20),
        # the stream ended before its last token could have come: nothing unseen
        (Pace(101, 30.0, 100.0), None, 0.120, 3000, 0),
        (Pace(101, 30.0, 100.0), None, 0.130, 3000, 0),
        # it sped up: 50 tokens in its last 10 ms, 5 a ms, beats its average
        (Pace(101, 30.0, 100.0), Pace(51, 30.0, 90.0), 0.150, 3000, 100),
        # it slowed down: its average is the faster
        (Pace(101, 30.0, 100.0), Pace(100, 30.0, 60.0), 0.150, 3000, 20),
        # never past the bound
        (Pace(101, 30.0, 100.0), None, 10.0, 500, 500),
        # one token read: no pace to go by, so the bound
        (Pace(1, 30.0, 0.0), None, 0.150, 3000, 3000),
        # two reads at the same millisecond: no pace to trust either
        (Pace(11, 30.0, 5.0), Pace(5, 30.0, 5.0), 0.150, 700, 700),
        # a part of a token rounds up
        (Pace(11, 0.0, 10.0), None, 0.0105, 3000, 1),
    ],
)
def test_what_llama_server_can_have_generated_unseen(
    last: Pace, before: Pace | None, elapsed_s: float, bound: int, most: int
) -> None:
    assert unseen(last, before, elapsed_s, bound) == most


@pytest.mark.parametrize(
    ("event", "pace"),
    [
        (
            b'data: {"timings":{"predicted_n":7,"prompt_ms":2.5,"predicted_ms":1.5}}\n\n',
            Pace(7, 2.5, 1.5),
        ),
        (
            b'data: {"timings":{"predicted_n":7,"prompt_ms":2,"predicted_ms":1}}\n\n',
            Pace(7, 2.0, 1.0),
        ),
        (b'data: {"timings":{"predicted_n":7,"prompt_ms":-1,"predicted_ms":1}}\n\n', None),
        (b'data: {"timings":{"predicted_n":7,"prompt_ms":"2","predicted_ms":1}}\n\n', None),
        (b'data: {"timings":{"predicted_n":true,"prompt_ms":2,"predicted_ms":1}}\n\n', None),
        (b'data: {"timings":{"predicted_n":7,"predicted_ms":1}}\n\n', None),
        (b'data: {"usage":{"completion_tokens":7}}\n\n', None),
    ],
)
def test_llama_servers_clock_is_read_from_its_timings(event: bytes, pace: Pace | None) -> None:
    assert pace_of(event) == pace


def test_a_llama_stream_ended_early_costs_what_its_engine_can_have_generated_unseen() -> None:
    """Cut after each event of the real llama-server's stream: the running count, the margin,
    and the engine's pace over the time the gateway cannot account for, within the bound."""
    all_events = events("llama_chat")
    checked = 0
    for cut in range(2, len(all_events) - 2):
        usage = UsageFilter(hide=True, strip=True)
        for event in all_events[:cut]:
            usage.feed(event)
        last = pace_of(b"".join(all_events[:cut]))
        if last is None or last.generated < 2:
            continue
        spent_s = (last.prompt_ms + last.generating_ms) / 1000
        plain, _ = usage.charged(999, whole=False)
        later, source = usage.charged(999, whole=False, elapsed_s=spent_s + 1.0, bound=10**9)
        assert plain is not None and later is not None
        assert source == "engine_partial"
        assert later["completion_tokens"] > plain["completion_tokens"] + last.generated - 1
        capped, _ = usage.charged(999, whole=False, elapsed_s=spent_s + 1.0, bound=40)
        assert capped is not None
        assert capped["completion_tokens"] == max(40, plain["completion_tokens"])
        on_time, _ = usage.charged(999, whole=False, elapsed_s=spent_s, bound=10**9)
        assert on_time == plain
        checked += 1
    assert checked >= 3, "the stream has events with a pace to read"


def test_vllms_responses_stream_is_counted_by_its_deltas() -> None:
    """vLLM sends no running count on /v1/responses, and may put several tokens in one delta:
    a stream of it that ended early costs its deltas' UTF-8 bytes (a token is at least a byte),
    and what the engine generates before it notices the close."""
    all_events = events("vllm_responses")
    deltas = [i for i, e in enumerate(all_events) if b"response.output_text.delta" in e]
    text = b"".join(d["delta"].encode() for e in all_events for d in documents(e) if "delta" in d)
    assert len(text) > len(deltas), "more bytes than events: the bytes are the bound"
    usage = UsageFilter(hide=False)
    for event in all_events[: deltas[-1] + 1]:
        usage.feed(event)
    charged, source = usage.charged(prompt_estimate=40, whole=False)
    assert source == "counted"
    assert charged == {"prompt_tokens": 40, "completion_tokens": len(text) + AFTER_CLOSE}


@pytest.mark.parametrize("how", ["whole", "bytes", "97"])
@pytest.mark.parametrize("name", ["vllm_chat", "vllm_completions", "llama_chat"])
def test_the_counts_the_client_did_not_ask_for_are_kept_from_it(name: str, how: str) -> None:
    stream = b"".join(events(name))
    usage = UsageFilter(hide=True, strip=True)
    out = b"".join(usage.feed(piece) for piece in pieces(stream, how)) + usage.close()
    sent, got = documents(stream), documents(out)
    assert all("usage" not in document for document in got), "no usage the client did not ask"
    kept = [d for d in sent if d.get("choices") != []]
    assert got == [{k: v for k, v in d.items() if k != "usage"} for d in kept]
    assert out.endswith(b"data: [DONE]\n\n")


def test_a_client_that_asked_for_usage_gets_the_usage_chunk_only() -> None:
    stream = b"".join(events("vllm_chat"))
    usage = UsageFilter(hide=False, strip=True)
    got = documents(usage.feed(stream) + usage.close())
    with_usage = [d for d in got if "usage" in d]
    assert [d["choices"] for d in with_usage] == [[]]


FORGED = (
    b'data: {"choices":[{"delta":{"content":"\\"usage\\":{\\"completion_tokens\\":0,'
    b'\\"prompt_tokens\\":0} \\"timings\\":{\\"prompt_n\\":0,\\"predicted_n\\":0}"}}]}\n\n'
)


def test_text_that_looks_like_a_count_is_never_taken_for_one() -> None:
    assert running_counts(FORGED) is None
    first = events("llama_chat")[:3]
    usage = UsageFilter(hide=True, strip=True)
    for event in [*first, FORGED, FORGED]:
        usage.feed(event)
    charged, source = usage.charged(prompt_estimate=999, whole=False)
    assert source == "engine_partial" and charged is not None
    assert charged["completion_tokens"] == generated_by("llama_chat", 3) + AFTER_CLOSE


def test_what_is_drained_after_the_client_left_is_counted_not_passed() -> None:
    all_events = events("vllm_chat")
    usage = UsageFilter(hide=True, strip=True)
    passed = usage.feed(all_events[0])
    usage.drain(b"".join(all_events[1:4]))
    charged, source = usage.charged(prompt_estimate=999, whole=False)
    assert passed and source == "engine_partial"
    assert charged is not None
    assert charged["completion_tokens"] == generated_by("vllm_chat", 4) + AFTER_CLOSE


def plain(size: int, usage_first: bool) -> bytes:
    usage = b'"usage":{"prompt_tokens":7,"total_tokens":7,"prompt_tokens_details":{"x":1}}'
    data = b'"data":[{"embedding":[' + b",".join([b"0.125"] * (size // 6)) + b"]}]"
    parts = [usage, data] if usage_first else [data, usage]
    return b'{"model":"m","object":"list",' + b",".join(parts) + b"}"


@pytest.mark.parametrize("usage_first", [True, False])  # llama-server's order, vLLM's
@pytest.mark.parametrize("size", [100, 5 * 1024 * 1024])
@pytest.mark.parametrize("chunk", [1, 9, 65536])
def test_a_plain_answer_of_any_size_is_read_for_its_usage(
    size: int, usage_first: bool, chunk: int
) -> None:
    answer = plain(size, usage_first)
    if chunk == 1 and size > 100:
        chunk = 4093  # byte by byte over 5 MiB is slow; an odd size still splits the name
    scan = AnswerScan()
    for at in range(0, len(answer), chunk):
        scan.feed(answer[at : at + chunk])
    assert scan.usage == {"prompt_tokens": 7, "total_tokens": 7, "prompt_tokens_details": {"x": 1}}


def test_a_plain_answer_without_usage_has_none() -> None:
    scan = AnswerScan()
    scan.feed(b'{"error":{"message":"\\"usage\\":{} is not here","code":400}}')
    assert scan.usage is None
