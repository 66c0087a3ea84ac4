"""An SSE stream passed on event by event, and what its events say of the tokens generated.

Only an unfinished event is held back; every finished one goes on at once. The bytes are not
split into events for every chunk: a few searches of each chunk's bytes find what counts.

What a stream costs is read from the engine's own counts, in this order:
- `engine`: its usage for the whole answer: a usage chunk (`choices` empty) at the end of a
  chat or text completions stream, /v1/responses' `response.completed` (also
  `response.incomplete` and `response.failed`) with `response.usage`, or the running count of
  the last event of a stream that ended whole (llama-server puts the usage of its text
  completions beside the last choice);
- `engine_partial`: a stream that ended before that (a client that left, a deadline, an engine
  that died) costs the engine's running count at the last event read, and AFTER_CLOSE tokens a
  sequence that it generates before it notices the close. The gateway asks both
  engines for one on every event (body.py): llama-server's `timings` (`timings_per_token`:
  `prompt_n` and `cache_n` make the prompt, `predicted_n` the tokens generated) and vLLM's
  `usage` (`stream_options.continuous_usage_stats`). llama-server's generating slot runs
  ahead of the thread that sends its events, by more the busier the machine, and what it
  generated but never sent is in no event: so a llama-server stream also costs what the
  engine, at its own pace (`Pace`), can have generated in the time the gateway cannot account
  for (`unseen`), within the request's bound;
- `counted`: an engine that sends neither (vLLM's /v1/responses), or a stream that ended before
  its first count, costs the events that carried output, one token each, or, on /v1/responses,
  the UTF-8 bytes of their deltas where those are more (vLLM puts several tokens in one delta
  when its client falls behind; every token of a tokenizer is at least a byte), and AFTER_CLOSE
  a sequence when it ended early; and the prompt's estimate (body.py).

A usage chunk the client did not ask for is kept from it (`hide`), and so is the running usage
of each event when the client did not ask for it (`strip`). No count is taken from the text an
engine generated: in JSON a quote inside a string is escaped, so `"usage":` or `"timings":` in
an event is always one of its names, never its content.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

# an event's end: a blank line (the "\r" before "\n\r\n" is the event's own); starting with a
# literal "\n" lets the regex engine skip to it rather than try every byte
_END: Final = re.compile(rb"\n\r?\n")
_DATA: Final = b"data:"
_USAGE: Final = b'"usage"'
# a count's object, with the whitespace JSON allows (the engines send none)
_TIMINGS: Final = re.compile(rb'"timings"\s*:\s*\{')
_RUNNING: Final = re.compile(rb'"usage"\s*:\s*\{')
_TIMINGS_EXACT: Final = b'"timings":{'
_RUNNING_EXACT: Final = b'"usage":{'
_NAME_BYTES: Final = 32  # the most bytes of one of those names that a chunk's end can split
_MAY_END: Final = b"[]"  # a usage chunk's empty choices
# an event's running usage, flat (vLLM's continuous usage has no nested object but a null)
_RUNNING_FIELD: Final = re.compile(rb',\s*"usage"\s*:\s*\{[^{}]*\}')
# an event that carries output: a chat or text completions choice, a responses delta
_CHOICE: Final = b'"choices":[{'
_DELTA: Final = re.compile(rb'"type":"response\.[a-z_]+\.delta"')
_DELTA_END: Final = b'.delta"'
_FINAL_RESPONSE: Final = ("response.completed", "response.incomplete", "response.failed")
_DECODER: Final = json.JSONDecoder()
_OBJECT_BYTES: Final = 4096  # a usage object, its details too
_COUNT_BYTES: Final = 1024  # a running count's object is a few hundred bytes

Source = Literal["engine", "engine_partial", "counted", "bound", "none"]
# tokens a sequence an engine generates after the last event the gateway read of a stream that
# ended early, before it notices the close (none for vLLM, whose running count is its count;
# llama-server's, past what its pace covers (`unseen`), is its slot's step after the cancel)
AFTER_CLOSE: Final = 16


@dataclass(frozen=True)
class Counts:
    """Tokens as one source gave them."""

    prompt: int
    completion: int
    cached: int | None = None

    def usage(self) -> dict[str, Any]:
        """The counts as a usage object (record.row.tokens_of reads it)."""
        found: dict[str, Any] = {"prompt_tokens": self.prompt, "completion_tokens": self.completion}
        if self.cached is not None:
            found["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return found


def last_end(data: bytes, before: int | None = None) -> int:
    """Where the last finished event in `data[:before]` ends (0: none)."""
    stop = len(data) if before is None else before
    plain, crlf = data.rfind(b"\n\n", 0, stop), data.rfind(b"\n\r\n", 0, stop)
    return max(plain + 2 if plain >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _document(event: bytes) -> dict[str, Any] | None:
    lines = [line[len(_DATA) :].strip() for line in event.splitlines() if line.startswith(_DATA)]
    try:
        document = json.loads(b"".join(lines))
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def final_usage(event: bytes) -> tuple[dict[str, Any] | None, bool]:
    """Pure: the usage of the whole answer, if this event carries it, and whether the event
    carries nothing else (a usage chunk: `choices` empty). A usage beside choices is a running
    count (running_counts), also where it is the last one."""
    document = _document(event)
    if document is None:
        return None, False
    kind = document.get("type")
    if isinstance(kind, str):  # /v1/responses
        response = document.get("response")
        if kind in _FINAL_RESPONSE and isinstance(response, dict):
            usage = response.get("usage")
            return (usage, False) if isinstance(usage, dict) else (None, False)
        return None, False
    usage = document.get("usage")
    if isinstance(usage, dict) and document.get("choices") == []:
        return usage, True
    return None, False


def _last(pattern: re.Pattern[bytes], exact: bytes, data: bytes) -> int:
    """Where the last match of `pattern` in data opens its object (`{`), else -1: `exact`, the
    name as the engines send it (no whitespace), is searched first, from the end."""
    at = data.rfind(exact)
    if at >= 0:
        return at + len(exact) - 1
    for match in pattern.finditer(data):
        at = match.end() - 1
    return at


def _object(data: bytes, start: int, most: int = _OBJECT_BYTES) -> dict[str, Any] | None:
    """The JSON object that starts at data[start], within `most` bytes, if it parses."""
    text = data[start : start + most].decode(errors="ignore")
    try:
        found, _ = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def running_counts(done: bytes) -> Counts | None:
    """Pure: the engine's running count at the last finished event in `done` that has one."""
    timings_at = _last(_TIMINGS, _TIMINGS_EXACT, done) if b'"timings"' in done else -1
    usage_at = _last(_RUNNING, _RUNNING_EXACT, done) if _USAGE in done else -1
    if timings_at > usage_at:
        timings = _object(done, timings_at, _COUNT_BYTES)
        if timings is not None:
            prompt, cached = _count(timings.get("prompt_n")), _count(timings.get("cache_n"))
            generated = _count(timings.get("predicted_n"))
            if prompt is not None and generated is not None:
                return Counts(prompt + (cached or 0), generated, cached)
    if usage_at >= 0:
        usage = _object(done, usage_at, _COUNT_BYTES)
        if usage is not None:
            prompt, generated = (
                _count(usage.get("prompt_tokens")),
                _count(usage.get("completion_tokens")),
            )
            if prompt is not None and generated is not None:
                return Counts(prompt, generated)
    return None


@dataclass(frozen=True)
class Pace:
    """llama-server's own clock at one event (its `timings`): the tokens generated, and the
    milliseconds it spent on the prompt and on generating them."""

    generated: int
    prompt_ms: float
    generating_ms: float


def pace_of(done: bytes) -> Pace | None:
    """Pure: llama-server's clock at the last finished event in `done` that has timings."""
    at = _last(_TIMINGS, _TIMINGS_EXACT, done) if b'"timings"' in done else -1
    timings = _object(done, at, _COUNT_BYTES) if at >= 0 else None
    if timings is None:
        return None
    generated = _count(timings.get("predicted_n"))
    prompt_ms, generating_ms = _ms(timings.get("prompt_ms")), _ms(timings.get("predicted_ms"))
    if generated is None or prompt_ms is None or generating_ms is None:
        return None
    return Pace(generated, prompt_ms, generating_ms)


def _ms(value: object) -> float | None:
    if type(value) is int or type(value) is float:
        return float(value) if 0 <= value < math.inf else None
    return None


def unseen(last: Pace, before: Pace | None, elapsed_s: float, bound: int) -> int:
    """Pure: the most tokens a sequence can have generated past `last`, the last event read,
    when the stream ended `elapsed_s` after the gateway sent the request; at most `bound`.

    The engine's last token read came at least its prompt's and its generation's milliseconds
    after the request was sent, so it generated past it for at most what is left of
    `elapsed_s`. It generates at its pace: the faster of its average since its first token
    and its pace between `before` and `last` (a machine that got less busy speeds it up). An
    engine with no pace to read (a single token) may have generated up to the bound."""
    window_s = elapsed_s - (last.prompt_ms + last.generating_ms) / 1000
    if window_s <= 0:
        return 0
    rates = []
    if last.generated > 1 and last.generating_ms > 0:  # its first token is at its clock's 0
        rates.append((last.generated - 1) / last.generating_ms)
    if before is not None and last.generated > before.generated:
        spent_ms = last.generating_ms - before.generating_ms
        rates.append(math.inf if spent_ms <= 0 else (last.generated - before.generated) / spent_ms)
    if not rates:
        return bound
    most = max(rates) * window_s * 1000
    return bound if most >= bound else math.ceil(most)


def delta_bytes(done: bytes) -> int:
    """Pure: the UTF-8 bytes of the deltas of the /v1/responses events in `done`."""
    total = 0
    for match in _DELTA.finditer(done):
        end = _END.search(done, match.end())
        document = _document(done[last_end(done, match.start()) : end.end() if end else None])
        delta = document.get("delta") if document is not None else None
        if isinstance(delta, str):
            total += len(delta.encode())
    return total


class UsageFilter:
    """Feed it the upstream's bytes; it returns what the client gets, and keeps the counts."""

    def __init__(self, hide: bool, strip: bool = False) -> None:
        self.hide = hide  # the final usage chunk is not the client's
        self.strip = strip  # nor is each event's running usage
        self.usage: dict[str, Any] | None = None  # the engine's, for the whole answer
        self._running: Counts | None = None  # the engine's, at the last event read
        self._pending: bytes | None = None  # the last events read with a count, not parsed yet
        # the last two reads with llama-server's timings: its pace, read only if it ends early
        self._timed: tuple[bytes | None, bytes | None] = (None, None)
        self.outputs = 0  # events that carried output
        self.delta_bytes = 0  # the UTF-8 bytes of /v1/responses' deltas, while no count came
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        held = self._held + data if self._held else data
        end = last_end(held)
        self._held = held[end:]
        done = held[:end]  # finished events only
        if not done:
            return done
        self.count(done)
        if _USAGE not in done:
            return done
        out: list[bytes] = []
        start = 0
        at = done.find(_USAGE)
        while at >= 0:
            begin = max(start, last_end(done, at))
            match = _END.search(done, at)
            stop = match.end() if match is not None else end
            event = done[begin:stop]
            usage, alone = (
                final_usage(event) if _MAY_END in event or b"response." in event else (None, False)
            )
            if usage is not None:
                self.usage = usage
                if alone and self.hide:
                    out.append(done[start:begin])
                    start = stop
            elif self.strip and _RUNNING.search(event):
                out.append(done[start:begin])
                out.append(_RUNNING_FIELD.sub(b"", event))
                start = stop
            at = done.find(_USAGE, stop)
        out.append(done[start:])
        return b"".join(out)

    def count(self, done: bytes) -> None:
        """Note the running count of finished events, also of those not passed on (what was
        read from the engine after its client left); while none came, their outputs. Only the
        last events with a count are kept, and parsed when the count is asked for: the counts
        only grow, and most events are never asked about."""
        if _TIMINGS_EXACT in done or _RUNNING_EXACT in done:
            self._pending = done
            if _TIMINGS_EXACT in done:
                self._timed = (self._timed[1], done)
        elif b'"timings"' in done or _USAGE in done:  # a count with whitespace: parsed now
            self._take(done)
        if self._pending is not None or self._running is not None:
            return  # the engine counts: the outputs are not needed
        self.outputs += done.count(_CHOICE)
        if _DELTA_END in done:
            self.outputs += len(_DELTA.findall(done))
            self.delta_bytes += delta_bytes(done)

    def _take(self, done: bytes) -> None:
        running = running_counts(done)
        if running is not None and (
            self._running is None or running.completion >= self._running.completion
        ):
            self._running = running

    @property
    def running(self) -> Counts | None:
        """The engine's running count at the last event read that had one."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._take(pending)
        return self._running

    def close(self) -> bytes:
        """What is left of an unfinished last event: passed on as it came."""
        held, self._held = self._held, b""
        return held

    def drain(self, data: bytes) -> None:
        """Bytes the client will not get (it left): counted, not passed on."""
        held = self._held + data
        end = last_end(held)
        self._held = held[end:]
        if end:
            self.count(held[:end])

    def charged(
        self,
        prompt_estimate: int,
        whole: bool,
        sequences: int = 1,
        *,
        elapsed_s: float | None = None,
        bound: int | None = None,
    ) -> tuple[dict[str, Any] | None, Source]:
        """The usage the row keeps and where it came from; `whole`: the stream ended as the
        engine ended it, so its last running count is the answer's. A stream that ended before
        its usage also costs AFTER_CLOSE tokens a sequence: what an engine generates between
        the last event read and its noticing that the gateway closed the stream; and, given
        `elapsed_s` (from sending the request to the stream's end) and its `bound` (the most it
        may generate), what llama-server can have generated unseen (`unseen`), so that the
        whole completion stays within the bound."""
        if self.usage is not None:
            return self.usage, "engine"
        running = self.running
        if running is not None and whole:
            return running.usage(), "engine"
        after = AFTER_CLOSE * sequences
        if running is not None:
            completion = running.completion + after
            last = pace_of(self._timed[1]) if self._timed[1] is not None else None
            if last is not None and elapsed_s is not None and bound is not None:
                before = pace_of(self._timed[0]) if self._timed[0] is not None else None
                most = max(0, bound - completion)
                completion += min(most, unseen(last, before, elapsed_s, most) * sequences)
            counts = Counts(running.prompt, completion, running.cached)
            return counts.usage(), "engine_partial"
        if self.outputs or not whole:  # also a stream left before its first output
            generated = max(self.outputs, self.delta_bytes) + (0 if whole else after)
            return Counts(prompt_estimate, generated).usage(), "counted"
        return None, "none"


class AnswerScan:
    """A plain answer's usage, found as its bytes pass: only what follows its last `"usage":`
    is kept (a few KiB), so that an answer of any size is charged."""

    def __init__(self) -> None:
        self._edge = b""  # the end of the bytes before: a name split between two chunks
        self._found: bytes | None = None  # from the last usage object's `{` on

    def feed(self, data: bytes) -> None:
        joined = self._edge + data
        at = _last(_RUNNING, _RUNNING_EXACT, joined) if _USAGE in joined else -1
        if at >= 0:
            self._found = joined[at : at + _OBJECT_BYTES]
        elif self._found is not None and len(self._found) < _OBJECT_BYTES:
            self._found += data[: _OBJECT_BYTES - len(self._found)]
        self._edge = joined[-_NAME_BYTES:]

    @property
    def usage(self) -> dict[str, Any] | None:
        return None if self._found is None else _object(self._found, 0)
