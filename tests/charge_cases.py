"""The ways of asking that tests/charges.py measures, through the official `openai` client.

Each takes the gateway's client, the route, the model and the tokens of a long answer (one that
is left early or outlasts the deadline: the engine's context bounds it); it returns when the
client is done
(a stream left early is closed by the client after a few events; one past its deadline ends
with the gateway's error event; a plain one past it with 504).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai

ROUTES = ("chat", "completions", "responses", "embeddings")
HELLO = "the quick brown fox jumps over the lazy dog"
SHORT = 12  # tokens of an answer read whole
LEFT_AFTER = 4  # events a client reads before it leaves


def create(client: openai.OpenAI, route: str, model: str, tokens: int, stream: bool) -> Any:
    extra = {"ignore_eos": True}  # llama-server's; vLLM's too: every answer is `tokens` long
    if route == "chat":
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": HELLO}],
            max_tokens=tokens,
            stream=stream,
            extra_body=extra,
        )
    if route == "completions":
        return client.completions.create(
            model=model, prompt=HELLO, max_tokens=tokens, stream=stream, extra_body=extra
        )
    if route == "responses":
        return client.responses.create(
            model=model, input=HELLO, max_output_tokens=tokens, stream=stream, extra_body=extra
        )
    assert route == "embeddings"
    return client.embeddings.create(model=model, input=[HELLO, HELLO + " again"])


def plain(client: openai.OpenAI, route: str, model: str, long: int) -> None:
    create(client, route, model, SHORT, stream=False)


def streamed(client: openai.OpenAI, route: str, model: str, long: int) -> None:
    for _ in create(client, route, model, SHORT, stream=True):
        pass


def left(client: openai.OpenAI, route: str, model: str, long: int) -> None:
    stream = create(client, route, model, long, stream=True)
    for index, _ in enumerate(stream):
        if index + 1 >= LEFT_AFTER + (4 if route == "responses" else 0):  # its opening events
            break
    stream.close()


def timed_out(client: openai.OpenAI, route: str, model: str, long: int) -> None:
    """Against the engine with the short deadline: the stream ends with the gateway's error
    event (the openai client raises it), a plain request gets 504."""
    try:
        for _ in create(client, route, model, long, stream=True):
            pass
    except openai.APIError:
        pass


def timed_out_plain(client: openai.OpenAI, route: str, model: str, long: int) -> None:
    try:
        create(client, route, model, long, stream=False)
    except openai.APIStatusError as error:
        assert error.status_code == 504, error


WAYS: dict[str, Callable[[openai.OpenAI, str, str, int], None]] = {
    "plain": plain,
    "streamed": streamed,
    "left mid-stream": left,
    "timed out": timed_out,
    "timed out, plain": timed_out_plain,
}
LATE_WAYS = frozenset({"timed out", "timed out, plain"})  # against charges.LATE


def cases(routes: tuple[str, ...]) -> list[tuple[str, str]]:
    """(route, way) for every way that applies: embeddings are asked plain only."""
    found = []
    for route in routes:
        for way in WAYS:
            if route == "embeddings" and way != "plain":
                continue
            found.append((route, way))
    return found
