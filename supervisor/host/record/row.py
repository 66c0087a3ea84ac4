"""One generation's row: who, what, which build, how it ended, its counts and times; no text.

Every string a row holds is a name checked against a rule with no room for prose (no spaces, a
bounded length), and the key id must look like one (`owner`, `inference`, `key_` and 12 hex
digits, or `probe`: the gateway's own probe of its engines, a caller no key stands for), so a
key passed by mistake is refused, not stored. The model and the engine are
served names (protocol.names) or, for a name from before that rule (a GGUF a library already
held, served still), its digest form: the gateway gives a row `names.kept(name)`, so no row is
ever lost for its name, and its tokens are charged to its key as any other's. There is no
field for a prompt, a completion or a message: a refusal is kept as its code
(`refused:rate_limited`), never its text. In a fleet, `machine` names the machine whose gateway
served the request ([fleet] machine); None when the fleet is off.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Final

from supervisor.host.keys import ID_PATTERN
from supervisor.protocol import names
from supervisor.protocol.documents import RunningEngine

UNKNOWN: Final = "unknown"  # a build or weights revision the engine's status did not name
NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")  # a build's names
PROBE_KEY_ID: Final = "probe"  # the gateway's probe (gateway/prober.py): no key is this caller
KEY_ID: Final = re.compile(rf"owner|inference|{PROBE_KEY_ID}|{ID_PATTERN.pattern}")
PLAIN_OUTCOMES: Final = frozenset(
    {"ok", "engine_error", "engine_failed", "client_gone", "timed_out"}
)
REFUSED: Final = "refused:"
# where a row's counts came from: the engine's for the whole answer, its running count when the
# answer ended early, output events counted, the request's bound (a plain answer never read
# whole), none (nothing was generated, or nothing said what)
USAGE_SOURCES: Final = frozenset({"engine", "engine_partial", "counted", "bound", "none"})
_REASON: Final = re.compile(r"[a-z0-9_]{1,64}")
MACHINE: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # [fleet] machine


class RowRefused(ValueError):
    """A value no row may hold; str() names the field and the rule, never the value."""


def _name(field: str, value: object) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise RowRefused(f"{field}: a name of letters, digits and ._:/@+- (at most 256)")
    return value


def _served(field: str, value: object) -> str:
    if isinstance(value, str) and names.is_kept(value):
        return value
    raise RowRefused(
        f"{field}: a served name ({names.CHARACTERS}, at most {names.MAX_LENGTH}) or the "
        "digest form of a name (names.kept)"
    )


def _count(field: str, value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise RowRefused(f"{field}: a count (an int >= 0) or None")
    return value


def _seconds(field: str, value: object, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if type(value) not in (int, float):
        raise RowRefused(f"{field}: seconds, finite and >= 0")
    seconds = float(value)  # type: ignore[arg-type]
    if not math.isfinite(seconds) or seconds < 0:
        raise RowRefused(f"{field}: seconds, finite and >= 0")
    return seconds


def check_outcome(value: object) -> str:
    """ok, engine_error, engine_failed, client_gone, timed_out, or refused:<code>."""
    if isinstance(value, str):
        if value in PLAIN_OUTCOMES:
            return value
        if value.startswith(REFUSED) and _REASON.fullmatch(value[len(REFUSED) :]):
            return value
    raise RowRefused(
        "outcome: ok, engine_error, engine_failed, client_gone, timed_out or refused:<code> "
        "(a code of a-z, 0-9 and _)"
    )


def refused(code: str) -> str:
    """The outcome of a refusal with this code (a Refusal's `code`)."""
    return check_outcome(REFUSED + code)


@dataclass(frozen=True, slots=True)
class Build:
    """What served a row, as the engine's status.json named it when the request was admitted."""

    engine_version: str = UNKNOWN
    image_id: str = UNKNOWN
    weights_revision: str = UNKNOWN

    def __post_init__(self) -> None:
        _name("engine_version", self.engine_version)
        _name("image_id", self.image_id)
        _name("weights_revision", self.weights_revision)

    @classmethod
    def of(cls, engine: RunningEngine | None) -> Build:
        """Pure: status.json's `engine` as a Build; what it does not name, or names in a form
        no name takes, is `unknown`, never a guess."""
        if engine is None:
            return cls()

        def named(value: str | None) -> str:
            return value if value is not None and NAME.fullmatch(value) else UNKNOWN

        return cls(
            named(engine.engine_version), named(engine.image_id), named(engine.model_revision)
        )


@dataclass(frozen=True, slots=True)
class Row:
    """One generation. `at` is when the request arrived (UTC); its UTC day is the budget's."""

    at: datetime
    key_id: str  # the caller's Identity.key_id, never the key
    model: str  # the tier or model name asked for, as routed, as names.kept gives it
    engine: str  # as names.kept gives it
    build: Build
    outcome: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    wait_s: float  # in admission (and a start on demand)
    ttft_s: float | None  # to the first byte of the answer; None when none came
    duration_s: float
    usage_source: str = "none"  # USAGE_SOURCES
    machine: str | None = None  # the fleet's machine that served it; None: no fleet

    def __post_init__(self) -> None:
        if not isinstance(self.at, datetime) or self.at.utcoffset() is None:
            raise RowRefused("at: a datetime with its time zone")
        object.__setattr__(self, "at", self.at.astimezone(UTC))
        if not isinstance(self.key_id, str) or not KEY_ID.fullmatch(self.key_id):
            raise RowRefused(
                "key_id: owner, inference, probe or key_ and 12 hex digits (a key's id)"
            )
        _served("model", self.model)
        _served("engine", self.engine)
        if not isinstance(self.build, Build):
            raise RowRefused("build: a Build")
        check_outcome(self.outcome)
        for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            _count(field, getattr(self, field))
        object.__setattr__(self, "wait_s", _seconds("wait_s", self.wait_s))
        object.__setattr__(self, "ttft_s", _seconds("ttft_s", self.ttft_s, optional=True))
        object.__setattr__(self, "duration_s", _seconds("duration_s", self.duration_s))
        if self.usage_source not in USAGE_SOURCES:
            raise RowRefused("usage_source: " + ", ".join(sorted(USAGE_SOURCES)))
        if self.machine is not None and not (
            isinstance(self.machine, str) and MACHINE.fullmatch(self.machine)
        ):
            raise RowRefused("machine: a machine's name (a-z, 0-9 and -, at most 63) or None")

    @property
    def day(self) -> date:
        return self.at.date()

    @property
    def tokens(self) -> int:
        """What the row spends of its key's daily budget: prompt and completion tokens."""
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


def _int(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def tokens_of(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """Pure: (prompt, completion, cached) tokens from an engine's `usage` object: the chat and
    completions names (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.
    cached_tokens`) or the responses API's (`input_tokens`, `output_tokens`,
    `input_tokens_details.cached_tokens`). Anything else in it is ignored; a count that is
    not a non-negative int is None."""
    if not isinstance(usage, Mapping):
        return None, None, None
    prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return prompt, completion, cached


def epoch_us(at: datetime) -> int:
    """Microseconds since the epoch: how a row's time is stored."""
    delta = at.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_epoch_us(value: int) -> datetime:
    return datetime.fromtimestamp(value // 1_000_000, UTC).replace(microsecond=value % 1_000_000)
