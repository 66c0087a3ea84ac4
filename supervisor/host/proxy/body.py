"""Pure: what a request body may be, and what goes upstream in its place.

The bounds are the operators' guide's: 2 MiB on the text routes, 16 MiB on any route; JSON that
parses, an object, with a model; then bounds.py's: tokens, `n`, `best_of`, logprobs, messages
and their length. A request whose client set no token bound gets llama-server's `n_predict` set
(bounds.py says when, to what, and why never `max_tokens`, which vLLM refuses beyond its
context), so that no engine generates past the bound.
A stream of chat or text completions gets `stream_options.include_usage` and
`continuous_usage_stats` upstream when its client did not ask for them, and every stream gets
llama-server's `timings_per_token`, so that the engine's own token counts are always seen, also
for a stream that ends early; the usage the client did not ask for is then kept from it (see
usage.py). What a request may cost is known before it is sent (`Prepared.reserve`): the
prompt's estimate (`prompt_estimate`: a token for every 4 bytes of the body, and 16) and the
tokens it may generate (its token bound times `n` or `best_of`, the larger). With `room` (what
the caller's budget has left), the token bound added where the client set none is at most what
the room holds after the prompt. A field the body does not have is put
before the client's own bytes, which go on as they came: a long prompt is not serialised again.
Only a field the client sent with another value (`stream_options` without include_usage, a
null or negative `n_predict`) makes the body serialised again: what a name given
twice means JSON leaves to each parser, so a client's value is replaced, never shadowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Final

from supervisor.host.proxy import bounds
from supervisor.host.proxy.bounds import Bounds
from supervisor.host.web.refusal import Refusal

MIB: Final = 1024 * 1024
TEXT_LIMIT: Final = 2 * MIB
ANY_LIMIT: Final = 16 * MIB
CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
RESPONSES: Final = "/v1/responses"
EMBEDDINGS: Final = "/v1/embeddings"
FORWARDED: Final = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
TEXT_ROUTES: Final = frozenset({CHAT, COMPLETIONS, RESPONSES})
USAGE_ROUTES: Final = frozenset({CHAT, COMPLETIONS})  # those with stream_options
TIMINGS: Final = "timings_per_token"  # llama-server's running count on every event
CONTINUOUS: Final = "continuous_usage_stats"  # vLLM's
# each route's own token field: when the client set it, nothing is added (bounds.py)
TOKEN_FIELD: Final = {CHAT: "max_tokens", COMPLETIONS: "max_tokens", RESPONSES: "max_output_tokens"}
MESSAGES_FIELD: Final = {CHAT: "messages", RESPONSES: "input"}


@dataclass(frozen=True)
class Prepared:
    """A checked request: its model, whether it streams, what goes upstream."""

    model: str
    stream: bool
    hide_usage: bool  # include_usage was added here: the usage chunk is not the client's
    body: bytes
    strip_usage: bool = False  # continuous usage was added here: each event's is not its own
    prompt_estimate: int = 0  # the prompt's tokens, as body.py estimates them
    generation_bound: int = 0  # the most tokens it may generate, every sequence together
    sequences: int = 1  # how many it generates (n, best_of)
    raw: bytes = b""  # the body as the client sent it (what a peer gateway prepares again)

    @property
    def reserve(self) -> int:
        """The most tokens this request may cost, as far as the gateway bounds it."""
        return self.prompt_estimate + self.generation_bound


def estimate_prompt(raw: bytes) -> int:
    """Pure: a prompt's tokens from its body's size, with room for a chat template."""
    return len(raw) // 4 + 16


def sequences(document: dict[str, Any]) -> int:
    """Pure: how many sequences a request generates (checked by bounds.settle first)."""
    counts = [document.get(name) for name in ("n", "n_cmpl", "best_of")]
    return max([c for c in counts if type(c) is int and c > 0], default=1)


def limit(path: str) -> int:
    return TEXT_LIMIT if path in TEXT_ROUTES else ANY_LIMIT


def too_large(path: str) -> Refusal:
    size = limit(path) // MIB
    return Refusal(413, "request_too_large", f"the body of {path} is limited to {size} MiB")


def _bad(message: str, param: str | None = None) -> Refusal:
    return Refusal(400, "invalid_request", message, param=param)


def decode(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 naming where it broke."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise _bad(f"the body is not UTF-8: byte {exc.start} is invalid") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        ) from None
    except RecursionError:
        raise _bad("malformed JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise _bad(f"the body must be a JSON object, not {type(value).__name__}")
    return value


def prepare(
    path: str,
    raw: bytes,
    limits: Bounds,
    room: int | None = None,
    default: str | None = None,
) -> Prepared:
    """Check a body read within limit(path), and say what goes upstream. `room`: the tokens
    the caller's budget has left, None for no budget; `default`: the tier a body that names no
    model (none, or null) goes to, None to refuse it. Such a body goes upstream naming it."""
    if len(raw) > limit(path):
        raise too_large(path)
    document = decode(raw)
    model = document.get("model")
    named = model is not None
    if not named and default is not None:
        model = default
    if not isinstance(model, str) or not model:
        unset = "" if named else " ([tiers] default names none to send it to)"
        raise _bad(f"model must be a non-empty string{unset}", param="model")
    token_field = TOKEN_FIELD.get(path)
    estimate = estimate_prompt(raw)
    many = sequences(document) if token_field is not None else 1
    cap = None if room is None else max((room - estimate) // many, 1)
    settled = bounds.settle(
        document,
        limits,
        token_field=token_field,
        messages_field=MESSAGES_FIELD.get(path),
        cap=cap,
    )
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", param="stream")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    asked = bool(options.get("include_usage")) if options else False
    continuous = bool(options.get(CONTINUOUS)) if options else False
    counted = stream and path in USAGE_ROUTES
    hide_usage = counted and not asked
    strip_usage = counted and not continuous
    changes: dict[str, Any] = {} if named else {"model": model}
    if hide_usage or strip_usage:
        changes["stream_options"] = {**(options or {}), "include_usage": True, CONTINUOUS: True}
    if stream and path in TEXT_ROUTES and TIMINGS not in document:
        changes[TIMINGS] = True
    changes.update(settled.fields)
    return Prepared(
        model,
        stream,
        hide_usage,
        body=_with(raw, document, changes),
        strip_usage=strip_usage,
        prompt_estimate=estimate,
        generation_bound=many * settled.tokens,
        sequences=many,
        raw=raw,
    )


def _with(raw: bytes, document: dict[str, Any], changes: dict[str, Any]) -> bytes:
    """The body with `changes` made: before the client's own bytes where it has none of them."""
    if not changes:
        return raw
    if any(name in document for name in changes):
        return json.dumps({**document, **changes}).encode()
    first = json.dumps(changes, separators=(",", ":"))[:-1].encode()  # without its closing }
    return first + b"," + raw.lstrip()[1:]


def as_sent(prepared: Prepared, model: str) -> bytes:
    """The client's body as it came, naming `model` (a tier alias resolved, or the default
    tier's model for a body that named none): what a peer gateway is sent to prepare again."""
    document = json.loads(prepared.raw)
    if document.get("model") == model:
        return prepared.raw
    document["model"] = model
    return json.dumps(document).encode()


def with_model(prepared: Prepared, model: str) -> Prepared:
    """The same request for another model name (a tier alias resolved)."""
    document = json.loads(prepared.body)
    document["model"] = model
    return replace(prepared, model=model, body=json.dumps(document).encode())
