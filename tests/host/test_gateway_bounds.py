"""Every request bounded before it reaches an engine (issue 36): tokens (`n_predict` set when the
client set no bound the engine reads, never `max_tokens`, which vLLM refuses beyond its context),
`n`, `best_of`, logprobs, messages and their length, as tables over body.prepare, then end to
end through the gateway to its fast local upstream, which records the bytes it got."""

from __future__ import annotations

import asyncio
import json
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor.host.gateway import settings
from supervisor.host.gateway.settings import parse
from supervisor.host.proxy import body
from supervisor.host.proxy.bounds import TOKEN_FIELDS
from supervisor.host.web.refusal import Refusal
from tests.host.gateway_world import AUTH, Upstream, world, write_status

ROOT = Path(__file__).resolve().parents[2]
LIMITS = """
[limits]
max_tokens = 100
max_n = 4
max_best_of = 5
max_logprobs = 3
max_messages = 3
max_message_chars = 10
"""
BOUNDS = parse(LIMITS, "test").limits.bounds


def said(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def prepared(path: str, document: dict[str, Any]) -> body.Prepared:
    return body.prepare(path, json.dumps({"model": "m", **document}).encode(), BOUNDS)


def documented_limits(text: str) -> dict[str, Any]:
    """[limits] of the first TOML block in `text`."""
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    limits: dict[str, Any] = tomllib.loads(block)["limits"]
    return limits


@pytest.mark.parametrize("where", ["settings.py", "docs/gateway.md"])
def test_the_defaults_are_those_documented(where: str) -> None:
    if where == "settings.py":
        text = settings.__doc__ or ""
    else:
        text = ROOT.joinpath(where).read_text().split("\n## Settings\n", 1)[1]
    limits = documented_limits(text)
    defaults = parse("", "test").limits
    names = (
        "max_tokens",
        "max_n",
        "max_best_of",
        "max_logprobs",
        "max_messages",
        "max_message_chars",
    )
    documented = {name: limits[name] for name in names}
    assert documented == {name: getattr(defaults, name) for name in names}
    assert (defaults.max_n, defaults.max_logprobs, defaults.max_messages) == (8, 20, 10_000)


@pytest.mark.parametrize("setting", ["max_n", "max_best_of", "max_messages", "max_message_chars"])
def test_a_bound_of_zero_is_refused_in_the_settings(setting: str) -> None:
    with pytest.raises(ValueError, match=f"limits.{setting}"):
        parse(f"[limits]\n{setting} = 0\n", "gw.toml")


REFUSED = [
    # (path, the body's fields, code, param, words)
    (body.CHAT, {"n": 5}, "n_too_large", "n", "n is 5; at most 4 ([limits] max_n)"),
    (body.COMPLETIONS, {"n": 64}, "n_too_large", "n", "n is 64; at most 4"),
    (body.CHAT, {"n_cmpl": 5}, "n_too_large", "n_cmpl", "n_cmpl is 5; at most 4"),
    (body.CHAT, {"n": 0}, "invalid_request", "n", "n must be an integer from 1 to 4, not 0"),
    (body.CHAT, {"n": True}, "invalid_request", "n", "not true"),
    (body.CHAT, {"n": 2.0}, "invalid_request", "n", "not a number"),
    (body.CHAT, {"n": "2"}, "invalid_request", "n", "not a string"),
    (
        body.COMPLETIONS,
        {"best_of": 6},
        "best_of_too_large",
        "best_of",
        "best_of is 6; at most 5 ([limits] max_best_of)",
    ),
    (body.COMPLETIONS, {"best_of": False}, "invalid_request", "best_of", "not false"),
    (
        body.CHAT,
        {"top_logprobs": 4},
        "logprobs_too_large",
        "top_logprobs",
        "top_logprobs is 4; at most 3 ([limits] max_logprobs)",
    ),
    (body.RESPONSES, {"top_logprobs": 4}, "logprobs_too_large", "top_logprobs", "is 4"),
    (body.CHAT, {"top_logprobs": -1}, "invalid_request", "top_logprobs", "from 0 to 3"),
    (body.CHAT, {"top_logprobs": True}, "invalid_request", "top_logprobs", "not true"),
    (body.CHAT, {"n_probs": 4}, "logprobs_too_large", "n_probs", "n_probs is 4"),
    (body.COMPLETIONS, {"prompt_logprobs": 4}, "logprobs_too_large", "prompt_logprobs", "is 4"),
    (body.COMPLETIONS, {"logprobs": 4}, "logprobs_too_large", "logprobs", "logprobs is 4"),
    (body.COMPLETIONS, {"logprobs": "4"}, "invalid_request", "logprobs", "not a string"),
    (
        body.CHAT,
        {"messages": [said("a")] * 4},
        "too_many_messages",
        "messages",
        "messages has 4 messages; at most 3 ([limits] max_messages)",
    ),
    (body.RESPONSES, {"input": [said("a")] * 4}, "too_many_messages", "input", "has 4"),
    (
        body.CHAT,
        {"messages": [said("a"), said("x" * 11)]},
        "message_too_long",
        "messages[1]",
        "messages[1] has 11 characters of text; at most 10 ([limits] max_message_chars)",
    ),
    (
        body.CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "x" * 6},
                        {"type": "text", "text": "é" * 5},
                    ],
                }
            ]
        },
        "message_too_long",
        "messages[0]",
        "has 11 characters",
    ),
    (body.RESPONSES, {"input": "x" * 11}, "message_too_long", "input[0]", "has 11"),
    # the token bounds: 400 invalid_request naming the field and its range, as before issue 36
    (
        body.CHAT,
        {"max_tokens": 101},
        "invalid_request",
        "max_tokens",
        "max_tokens must be an integer from 1 to 100, not 101",
    ),
    (body.CHAT, {"max_tokens": 0}, "invalid_request", "max_tokens", "from 1 to 100, not 0"),
    (body.CHAT, {"max_tokens": -1}, "invalid_request", "max_tokens", "not -1"),
    (body.CHAT, {"max_tokens": True}, "invalid_request", "max_tokens", "not true"),
    (body.CHAT, {"max_tokens": 5.0}, "invalid_request", "max_tokens", "not a number"),
    (
        body.CHAT,
        {"max_completion_tokens": 101},
        "invalid_request",
        "max_completion_tokens",
        "from 1 to 100",
    ),
    (
        body.RESPONSES,
        {"max_output_tokens": 101},
        "invalid_request",
        "max_output_tokens",
        "from 1 to 100",
    ),
    (
        body.CHAT,
        {"n_predict": 101},
        "invalid_request",
        "n_predict",
        "n_predict must be an integer from 1 to 100, or negative (until the bound), not 101",
    ),
    (body.CHAT, {"n_predict": 0}, "invalid_request", "n_predict", "not 0"),
    (body.CHAT, {"n_predict": True}, "invalid_request", "n_predict", "not true"),
]


@pytest.mark.parametrize(("path", "fields", "code", "param", "words"), REFUSED)
def test_each_bound_refuses_a_request_over_it_naming_the_bound_and_the_value(
    path: str, fields: dict[str, Any], code: str, param: str, words: str
) -> None:
    with pytest.raises(Refusal) as caught:
        prepared(path, fields)
    refusal = caught.value
    assert (refusal.status, refusal.code, refusal.param) == (400, code, param)
    assert words in refusal.message
    assert refusal.body()["error"]["type"] == "invalid_request_error"


PASSED = [
    (body.CHAT, {"n": 4, "n_cmpl": 4}),
    (body.CHAT, {"n": None}),
    (body.COMPLETIONS, {"best_of": 5, "n": 1}),
    (body.CHAT, {"logprobs": True, "top_logprobs": 3, "n_probs": 0}),
    (body.COMPLETIONS, {"logprobs": 3, "prompt_logprobs": 0}),
    (body.CHAT, {"messages": [said("x" * 10)] * 3}),
    (
        body.CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "x" * 10},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + "A" * 99},
                        },
                    ],
                }
            ]
        },
    ),
    (body.RESPONSES, {"input": "x" * 10}),
    (body.COMPLETIONS, {"prompt": "x" * 1000}),  # a prompt is bounded by the body's size
    (body.EMBEDDINGS, {"input": ["x" * 1000] * 4}),
]


@pytest.mark.parametrize(("path", "fields"), PASSED)
def test_a_request_at_its_bounds_passes(path: str, fields: dict[str, Any]) -> None:
    document = json.loads(prepared(path, fields).body)
    assert {name: document[name] for name in fields} == fields


SET = [
    # (path, the body's fields, the fields upstream gets set): only ever n_predict, which
    # llama-server takes before max_tokens and vLLM ignores (it refuses a max_tokens that its
    # max_model_len leaves no room for, and bounds itself by its context)
    (body.CHAT, {}, {"n_predict": 100}),
    (body.CHAT, {"max_tokens": None}, {"n_predict": 100}),  # the null goes on: "none" to both
    (body.CHAT, {"max_tokens": 7}, {}),
    (body.CHAT, {"max_tokens": 100}, {}),
    (body.CHAT, {"max_completion_tokens": 7}, {"n_predict": 7}),  # llama-server ignores it
    (body.CHAT, {"max_tokens": 9, "max_completion_tokens": 7}, {}),
    (body.CHAT, {"n_predict": -1}, {"n_predict": 100}),
    (body.CHAT, {"n_predict": -2, "max_tokens": 7}, {"n_predict": 7}),
    (body.CHAT, {"n_predict": -1, "max_completion_tokens": 7}, {"n_predict": 7}),
    (body.CHAT, {"n_predict": 9}, {}),  # llama-server's own; vLLM stops at its context's end
    (body.CHAT, {"n_predict": None}, {"n_predict": 100}),
    (body.CHAT, {"n_predict": None, "max_tokens": 7}, {}),
    (body.COMPLETIONS, {}, {"n_predict": 100}),
    (body.COMPLETIONS, {"max_tokens": 1}, {}),
    (body.COMPLETIONS, {"n_predict": -1}, {"n_predict": 100}),
    (body.COMPLETIONS, {"max_completion_tokens": 7}, {"n_predict": 7}),
    (body.RESPONSES, {}, {"n_predict": 100}),
    (body.RESPONSES, {"max_output_tokens": 5}, {}),
    (body.RESPONSES, {"max_output_tokens": None}, {"n_predict": 100}),
    (body.RESPONSES, {"max_tokens": 7}, {"n_predict": 7}),  # not the route's own field
    (body.RESPONSES, {"n_predict": -1, "max_output_tokens": 5}, {"n_predict": 5}),
    (body.EMBEDDINGS, {}, {}),  # an embedding generates nothing
    (body.EMBEDDINGS, {"n_predict": -1}, {}),
]


@pytest.mark.parametrize(("path", "fields", "changed"), SET)
def test_the_token_bound_is_set_where_the_client_set_none(
    path: str, fields: dict[str, Any], changed: dict[str, Any]
) -> None:
    raw = json.dumps({"model": "m", **fields}).encode()
    sent = body.prepare(path, raw, BOUNDS).body
    assert json.loads(sent) == {"model": "m", **fields, **changed}
    if not changed:
        assert sent == raw
    elif "n_predict" not in fields:
        assert sent.endswith(raw[1:])  # before the client's own bytes


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "fields", "changed"), SET)
def test_no_max_tokens_or_max_output_tokens_is_ever_added(
    path: str, fields: dict[str, Any], changed: dict[str, Any], stream: bool
) -> None:
    """vLLM answers 400 to a prompt and max_tokens over its max_model_len (the CPU test model's
    1024 against a bound of 32768): upstream gets the client's token fields, and no other."""
    sent = json.loads(prepared(path, {**fields, "stream": stream}).body)
    assert {name: sent[name] for name in TOKEN_FIELDS if name in sent} == {
        name: fields[name] for name in TOKEN_FIELDS if name in fields
    }
    added = {"n_predict", "stream_options", "timings_per_token"}
    assert set(sent) - {"model", "stream", *fields} <= added


PROMPTS = [
    '{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 \\ud83d\\ude00"}]}',
    ' \n\t{"model":"m","messages":[{"role":"user","content":"été ✓"}],"n":2}',
    '{"model": "m", "stream": true, "messages": [{"role": "user", "content": "'
    + "long " * 40000
    + '"}]}',
]


@pytest.mark.parametrize("raw", PROMPTS, ids=["escapes", "spaces", "long stream"])
def test_the_bound_goes_before_the_clients_own_bytes(raw: str) -> None:
    """The client's bytes go on as they came: its escapes, spacing and long prompt are not
    serialised again (that would turn \\u00e9 into é's escape of json.dumps, or ✓ into one)."""
    sent = body.prepare(body.CHAT, raw.encode(), parse("", "test").limits.bounds).body
    assert sent.endswith(raw.lstrip()[1:].encode())
    document = json.loads(sent)
    assert document["n_predict"] == 32768 and "max_tokens" not in document
    assert document["messages"] == json.loads(raw)["messages"]


def test_a_value_to_replace_serialises_the_body_once_and_leaves_no_second_name() -> None:
    raw = b'{"model": "m", "n_predict": -1, "stream": true, "stream_options": {}}'
    sent = body.prepare(body.CHAT, raw, BOUNDS).body
    assert sent.count(b'"n_predict"') == 1 and sent.count(b'"stream_options"') == 1
    assert json.loads(sent) == {
        "model": "m",
        "n_predict": 100,
        "stream": True,
        "timings_per_token": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


# -- end to end: the gateway in front of its fast local upstream ---------------------------------


async def post(base: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    headers = {**AUTH, "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession(headers=headers) as s,
        s.post(f"{base}/chat/completions", data=raw) as r,
    ):
        return r.status, await r.json()


def test_a_chat_without_max_tokens_reaches_the_engine_with_n_predict(tmp_path: Path) -> None:
    raw = json.dumps({"model": "tiny", "messages": [said("caf\u00e9 " * 1000)]}).encode()

    async def main() -> tuple[list[dict[str, Any]], list[bytes]]:
        async with world(tmp_path) as w:  # [limits] max_tokens = 1000
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            status, answer = await post(w.base, raw)
            assert status == 200, answer
            status, answer = await post(w.base, raw[:-1] + b', "max_tokens": 7}')
            assert status == 200, answer
            return w.upstream.bodies, w.upstream.raw

    bodies, got = asyncio.run(main())
    assert bodies[0] == {**json.loads(raw), "n_predict": 1000}  # no max_tokens: see SET
    assert got[0].endswith(raw[1:])  # the client's prompt bytes, as they came
    assert bodies[1]["max_tokens"] == 7 and got[1] == raw[:-1] + b', "max_tokens": 7}'


@pytest.mark.parametrize(
    ("fields", "code", "param", "words"),
    [
        ({"n": 64}, "n_too_large", "n", "n is 64; at most 8 ([limits] max_n)"),
        (
            {"messages": [said("hi")] * 10_001},
            "too_many_messages",
            "messages",
            "messages has 10001 messages; at most 10000 ([limits] max_messages)",
        ),
        ({"max_tokens": 1001}, "invalid_request", "max_tokens", "from 1 to 1000, not 1001"),
    ],
)
def test_a_request_over_a_bound_is_refused_and_nothing_is_forwarded(
    tmp_path: Path, fields: dict[str, Any], code: str, param: str, words: str
) -> None:
    raw = json.dumps({"model": "tiny", "messages": [said("hi")], **fields}).encode()
    upstream = Upstream()

    async def main() -> tuple[int, dict[str, Any]]:
        async with world(tmp_path, upstream=upstream) as w:
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            answer = await post(w.base, raw)
            assert (await post(w.base, b'{"model": "tiny"}'))[0] == 200  # still served
            return answer

    status, answer = asyncio.run(main())
    assert status == 400
    assert answer["error"]["code"] == code and answer["error"]["param"] == param
    assert words in answer["error"]["message"]
    assert len(upstream.bodies) == 1  # only the request after it
