"""Pure: the bounds every request keeps before it reaches an engine, and the fields they set.

The RFC's "how many messages, how long, how many tokens", and what multiplies an engine's work:
- tokens: `max_tokens`, `max_completion_tokens` and `max_output_tokens` from 1 to `max_tokens`
  (today's 400 `invalid_request`), and llama-server's `n_predict`, which it takes before
  `max_tokens`: the same, or negative ("until the end"), which is bounded as a missing value;
- `n_predict` is set where the client set neither a positive one nor the route's own field
  (`token_field`: `max_tokens` on chat and text completions, `max_output_tokens` on
  /v1/responses; none on embeddings, which generate nothing; a null is none), and in place of
  a negative one: to the smallest token count the client asked for (a `max_completion_tokens`,
  which llama-server ignores, or the `max_tokens` a negative `n_predict` overrides), else the
  bound. Never `max_tokens` or `max_output_tokens`: vLLM refuses with 400 ("This model's
  maximum context length is N tokens. However, you requested ...") any request whose prompt
  and `max_tokens` exceed its `max_model_len`, so a bound of 32768 added there would refuse
  every request to a model with a shorter context; vLLM ignores `n_predict` (it accepts and
  logs fields it does not know) and bounds itself by its context, while llama-server takes
  `n_predict` before `max_tokens` and stops at the end of its context for a larger one;
- `n` and llama-server's `n_cmpl` from 1 to `max_n` (`n_too_large`), `best_of` from 1 to
  `max_best_of` (`best_of_too_large`), `top_logprobs`, llama-server's `n_probs`, vLLM's
  `prompt_logprobs` and the text completions' integer `logprobs` from 0 to `max_logprobs`
  (`logprobs_too_large`; chat's `logprobs` is a flag);
- the route's messages (`messages_field`: chat's `messages`, /v1/responses' `input`, whose
  string is one message): at most `max_messages` of them (`too_many_messages`), each with at
  most `max_message_chars` characters of text (`message_too_long`): its `content` when a
  string, else the `text` of each part (an image, audio or file is bounded by the body's size).

A value of the wrong type is `invalid_request`; each refusal names the field in `param` and says
the value and the bound. Nothing here parses or writes bytes: body.py does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from supervisor.host.web.refusal import Refusal

TOKEN_FIELDS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
N_PREDICT: Final = "n_predict"  # llama-server's: before max_tokens; negative: until the end
N_FIELDS: Final = ("n", "n_cmpl")  # llama-server's n_cmpl: before n
LOGPROB_FIELDS: Final = ("top_logprobs", "n_probs", "prompt_logprobs", "logprobs")


@dataclass(frozen=True)
class Bounds:
    """The bounds of one request ([limits] in settings.py, where each default is)."""

    max_tokens: int
    max_n: int
    max_best_of: int
    max_logprobs: int
    max_messages: int
    max_message_chars: int


def _count(value: object) -> int | None:
    """An integer as JSON has it (a bool is none), else None."""
    return value if type(value) is int else None


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    kinds = {str: "a string", float: "a number", list: "an array", dict: "an object"}
    return kinds.get(type(value), "null" if value is None else type(value).__name__)


def _invalid(name: str, rule: str, value: object) -> Refusal:
    return Refusal(
        400, "invalid_request", f"{name} must be {rule}, not {_shown(value)}", param=name
    )


def _over(code: str, name: str, value: int, setting: str, bound: int) -> Refusal:
    return Refusal(
        400, code, f"{name} is {value}; at most {bound} ([limits] {setting})", param=name
    )


def _asked_tokens(document: dict[str, Any], maximum: int) -> list[int]:
    """The token counts the client asked for (each checked); a negative n_predict is none."""
    asked = []
    rule = f"an integer from 1 to {maximum}"
    for name in TOKEN_FIELDS:
        value = document.get(name)
        if value is None:
            continue
        count = _count(value)
        if count is None or not 1 <= count <= maximum:
            raise _invalid(name, rule, value)
        asked.append(count)
    value = document.get(N_PREDICT)
    if value is not None:
        count = _count(value)
        if count is None or count == 0 or count > maximum:
            raise _invalid(N_PREDICT, f"{rule}, or negative (until the bound)", value)
        if count > 0:
            asked.append(count)
    return asked


def _check(
    document: dict[str, Any], name: str, *, low: int, bound: int, setting: str, code: str
) -> None:
    value = document.get(name)
    if value is None or (name == "logprobs" and isinstance(value, bool)):  # chat's flag
        return
    count = _count(value)
    if count is None or count < low:
        raise _invalid(name, f"an integer from {low} to {bound}", value)
    if count > bound:
        raise _over(code, name, count, setting, bound)


def text_chars(message: object) -> int:
    """The characters of a message's text: its content, or the text of each of its parts."""
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    parts: Iterator[object] = (part.get("text") for part in content if isinstance(part, dict))
    return sum(len(text) for text in parts if isinstance(text, str))


def _check_messages(document: dict[str, Any], name: str, bounds: Bounds) -> None:
    messages = document.get(name)
    if isinstance(messages, str):  # /v1/responses' input as one message's text
        messages = [{"content": messages}]
    if not isinstance(messages, list):
        return  # a wrong type, which the engine refuses
    if len(messages) > bounds.max_messages:
        raise Refusal(
            400,
            "too_many_messages",
            f"{name} has {len(messages)} messages; at most {bounds.max_messages} "
            "([limits] max_messages)",
            param=name,
        )
    for index, message in enumerate(messages):
        chars = text_chars(message)
        if chars > bounds.max_message_chars:
            raise Refusal(
                400,
                "message_too_long",
                f"{name}[{index}] has {chars} characters of text; at most "
                f"{bounds.max_message_chars} ([limits] max_message_chars)",
                param=f"{name}[{index}]",
            )


@dataclass(frozen=True)
class Settled:
    """What settle found: the fields to set upstream, and the most tokens one sequence of the
    request may generate (0 where nothing is generated)."""

    fields: dict[str, int]
    tokens: int


def settle(
    document: dict[str, Any],
    bounds: Bounds,
    *,
    token_field: str | None,
    messages_field: str | None,
    cap: int | None = None,
) -> Settled:
    """Check every bound (a Refusal for the first one broken); the fields to set upstream.

    At most `n_predict`, where the client set no bound the engine reads: `token_field` is the
    route's own token field, None where nothing is generated. `cap` (at least 1) lowers the
    bound set there, never one the client set: what the caller's budget has room for.
    """
    asked = _asked_tokens(document, bounds.max_tokens)
    for name in N_FIELDS:
        _check(document, name, low=1, bound=bounds.max_n, setting="max_n", code="n_too_large")
    _check(
        document,
        "best_of",
        low=1,
        bound=bounds.max_best_of,
        setting="max_best_of",
        code="best_of_too_large",
    )
    for name in LOGPROB_FIELDS:
        _check(
            document,
            name,
            low=0,
            bound=bounds.max_logprobs,
            setting="max_logprobs",
            code="logprobs_too_large",
        )
    if messages_field is not None:
        _check_messages(document, messages_field, bounds)
    if token_field is None:  # embeddings: nothing generated, nothing to bound
        return Settled({}, 0)
    tokens = min(asked, default=bounds.max_tokens)
    predict = document.get(N_PREDICT)
    if predict is not None and predict > 0:  # checked above: an int, within the bound
        return Settled({}, tokens)  # llama-server's own; vLLM ignores it (its context bounds it)
    if predict is None and document.get(token_field) is not None:
        return Settled({}, tokens)  # the route's own field, which both engines read
    if cap is not None:
        tokens = min(tokens, max(cap, 1))
    return Settled({N_PREDICT: tokens}, tokens)  # never max_tokens: see above
