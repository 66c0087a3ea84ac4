"""Pure: what a request body may be, and what goes upstream in its place.

The bounds are the operators' guide's: 2 MiB on the text routes, 16 MiB on any route; JSON that
parses, an object, with a model; then bounds.py's: tokens, `n`, `best_of`, logprobs, messages
and their length. A request whose client set no token bound gets llama-server's `n_predict` set
(bounds.py says when, to what, and why never `max_tokens`, which vLLM refuses beyond its
context), so that no engine generates past the bound.
A stream of chat or text completions gets `stream_options.include_usage` upstream when its
client did not ask for it, so that the engine's own token counts are always seen; the extra
usage chunk is then kept from that client (see usage.py). A field the body does not have is put
before the client's own bytes, which go on as they came: a long prompt is not serialised again.
Only a field the client sent with another value (`stream_options` without include_usage, a
null or negative `n_predict`) makes the body serialised again: what a name given
twice means JSON leaves to each parser, so a client's value is replaced, never shadowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Final

from supervisor.host.gateway import bounds
from supervisor.host.gateway.bounds import Bounds
from supervisor.host.gateway.refusal import Refusal

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


def prepare(path: str, raw: bytes, limits: Bounds) -> Prepared:
    """Check a body read within limit(path), and say what goes upstream."""
    if len(raw) > limit(path):
        raise too_large(path)
    document = decode(raw)
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model must be a non-empty string", param="model")
    settled = bounds.settle(
        document, limits, token_field=TOKEN_FIELD.get(path), messages_field=MESSAGES_FIELD.get(path)
    )
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", param="stream")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    asked = bool(options.get("include_usage")) if options else False
    hide_usage = stream and path in USAGE_ROUTES and not asked
    changes: dict[str, Any] = {}
    if hide_usage:
        changes["stream_options"] = {**(options or {}), "include_usage": True}
    changes.update(settled)
    return Prepared(model, stream, hide_usage, body=_with(raw, document, changes))


def _with(raw: bytes, document: dict[str, Any], changes: dict[str, Any]) -> bytes:
    """The body with `changes` made: before the client's own bytes where it has none of them."""
    if not changes:
        return raw
    if any(name in document for name in changes):
        return json.dumps({**document, **changes}).encode()
    first = json.dumps(changes, separators=(",", ":"))[:-1].encode()  # without its closing }
    return first + b"," + raw.lstrip()[1:]


def with_model(prepared: Prepared, model: str) -> Prepared:
    """The same request for another model name (a tier alias resolved)."""
    document = json.loads(prepared.body)
    document["model"] = model
    return replace(prepared, model=model, body=json.dumps(document).encode())
