"""Fuzzing desired.json: never an unhandled exception, never an action on invalid input, always a
one-line message naming the problem (issue 7, "Fuzzing").

Properties, with the "lucia-fuzz" profile (tests/fuzz/conftest.py; derandomized):

- test_desired_bytes_follow_the_contract (10,000 examples, plus the tests/corpus.py documents):
  bytes written to a real file, then files.read_text + protocol.parse_desired either return a
  DesiredFile or raise exactly FileRefused / InvalidDocument. A differential oracle (json.loads
  plus a strict checker written here) decides independently: parse_desired accepts iff the oracle
  does, with the same generation and desired. A refusal is one non-empty printable line of at most
  300 characters that names one of the problems the oracle found.
- test_the_worker_never_acts_on_invalid_input (2 x 1,000 examples): the worker's intake as the
  loop runs it (read_request and intake(), the very functions Worker._read_request calls,
  shown, and the real Heartbeat writing status.json and file_sd). After generation 5
  "running" was accepted (acknowledged, and settled as running), a fuzzed desired.json is
  written atomically: invalid content leaves the request and file_sd untouched and sets
  status.json's `refused` (status.json stays valid); valid content with a new request moves
  the request to it. The intake is pure but for those file writes, so it has no way to reach
  Docker; the conformance suite's refused-input case runs the real worker.

The strategies: arbitrary bytes; arbitrary JSON values (st.recursive, NaN and Infinity included)
through json.dumps; the valid document mutated at the JSON-text level (fields replaced by
arbitrary or edge values, extra, removed, duplicated and re-cased or \\u-escaped keys, numbers
around 2**53, floats, bools, huge ints, unicode, deep nesting, whitespace, BOM, trailing data);
byte-level corruptions of those; and documents padded to the 64 KiB read limit.

Findings this fuzzing reported are fixed; each keeps a regression test at the end.
"""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from supervisor.notify import Notifier
from supervisor.protocol import documents as protocol
from supervisor.protocol import files
from supervisor.protocol.documents import MAX_GENERATION, DesiredFile, TargetGroup
from supervisor.protocol.files import FileRefused
from supervisor.protocol.layout import DESIRED, STATUS
from supervisor.protocol.strictjson import InvalidDocument
from supervisor.worker.heartbeat import Heartbeat
from supervisor.worker.intake import intake, read_request
from supervisor.worker.plan import Answer, Decision, shown
from supervisor.worker.pursuit import Pursuit
from supervisor.worker.telemetry import TELEMETRY_DIR, FileSdWriter, WorkerMetrics
from tests.corpus import INVALID, VALID, materialise

FUZZ = settings.get_profile("lucia-fuzz")
WORKER_FUZZ = settings(FUZZ, max_examples=max(50, FUZZ.max_examples // 10))

MAX_DEPTH = 5_000  # openers; up to 2 levels each
MAX_DIGITS = 10_000
MAX_KEY = 5_000
MAX_MESSAGE = 300
JITER_MAX_DEPTH = 200  # pydantic's JSON parser refuses deeper nesting as "invalid JSON"

KEYS = ("schemaVersion", "generation", "desired")
OPTIONAL = ("requestedBy", "requestedAt")  # absent or null: not said
WANTS = ("running", "stopped")
REQUESTERS = ("operator", "gateway")
FLEET = re.compile(r"operator@[a-z0-9][a-z0-9-]{0,62}")  # another machine's operator
# RFC 3339 as the contract takes it, with each part's range checked by hand below
TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:Z|([+-])(\d\d):(\d\d))",
    re.ASCII,
)


# --- the oracle: the contract, checked independently of protocol.py -----------------------------


class _Object(list[tuple[str, Any]]):
    """A JSON object as the (key, value) pairs it was written with, duplicates kept."""


class _Constant(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _Constant(name)


Accepted = tuple[int, str, str | None, datetime | None]  # generation, desired, by whom, when


@dataclass(frozen=True)
class Verdict:
    accepted: Accepted | None = None  # when the contract holds
    file_problem: str | None = None  # what files.read_text must say, when it must refuse
    problems: tuple[str, ...] = ()  # fragments, one of which a refusal must contain


class _Huge:
    """A number too long for int(): never a valid value, judged (and named) by its field."""


def _bounded_int(digits: str) -> int | _Huge:
    return int(digits) if len(digits) <= 1000 else _Huge()


def oracle(data: bytes) -> Verdict:
    if len(data) > files.MAX_READ:
        return Verdict(file_problem=f"the limit is {files.MAX_READ}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Verdict(file_problem="not valid UTF-8")
    if text.startswith("\ufeff"):
        return Verdict(problems=("byte-order mark",))
    if not text.strip():  # str.strip: Unicode whitespace too, as check_json does
        return Verdict(problems=("empty",))
    try:
        value = json.loads(
            text, object_pairs_hook=_Object, parse_constant=_reject_constant, parse_int=_bounded_int
        )
    except _Constant as exc:  # a duplicate key met earlier in the text is reported first
        return Verdict(problems=(f"{exc} is not valid JSON", "duplicate key"))
    except json.JSONDecodeError:
        return Verdict(problems=("not valid JSON", "duplicate key"))
    except (RecursionError, ValueError):  # too deep, too many digits: not the contract either
        return Verdict(problems=("not valid JSON", "invalid JSON", "nest", "deep", "digit", "long"))
    problems = [f"duplicate key {_quoted(key)}" for key in _duplicates(value)]
    if _depth(value) > JITER_MAX_DEPTH or _has_surrogate(value):
        problems.append("invalid JSON")
    if not isinstance(value, _Object):
        problems.append("document: input should be an object")
        return Verdict(problems=tuple(problems))
    fields = dict(value)
    problems += _schema_problems(fields)
    if problems:
        return Verdict(problems=tuple(problems))
    return Verdict(
        accepted=(
            cast(int, fields["generation"]),
            cast(str, fields["desired"]),
            fields.get("requestedBy"),
            _time(fields.get("requestedAt")),
        )
    )


def _time(value: Any) -> datetime | None:
    """An RFC 3339 time with a zone, every part in its range (no leap second); else None."""
    match = TIME.fullmatch(value) if type(value) is str else None
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    fraction, sign, zone_h, zone_m = match.groups()[6:]
    days = [
        31,
        29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28,
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ]
    if not (
        year >= 1
        and 1 <= month <= 12
        and 1 <= day <= days[month - 1]
        and hour < 24
        and minute < 60
        and second < 60
    ):
        return None
    offset = timedelta(0)
    if sign is not None:
        if int(zone_h) > 23 or int(zone_m) > 59:
            return None
        offset = (1 if sign == "+" else -1) * timedelta(hours=int(zone_h), minutes=int(zone_m))
    micro = int((fraction or "0").ljust(6, "0"))
    try:  # the instant must be one in UTC too (years 1 to 9999)
        at = datetime(year, month, day, hour, minute, second, micro, timezone(offset))
        return at.astimezone(UTC)
    except OverflowError:
        return None


def _quoted(key: str) -> str:
    """A key as a message quotes it: its first 60 characters, then an ellipsis (bounded)."""
    return repr(key[:60]) + ("…" if len(key) > 60 else "")


def _schema_problems(fields: dict[str, Any]) -> list[str]:
    """The contract, field by field: exactly these keys, with exactly these types and values."""
    problems = [f"missing field {key!r}" for key in KEYS if key not in fields]
    problems += [
        f"unknown field {_quoted(key)}" for key in fields if key not in KEYS and key not in OPTIONAL
    ]
    version, generation, want = (fields.get(key) for key in KEYS)
    if "schemaVersion" in fields and not (type(version) is int and version == 1):
        problems.append("schemaVersion: ")
    if "generation" in fields and not (
        type(generation) is int and 0 <= generation <= MAX_GENERATION
    ):
        problems.append("generation: ")
    if "desired" in fields and not (type(want) is str and want in WANTS):
        problems.append("desired: ")
    by, at = (fields.get(key) for key in OPTIONAL)
    if by is not None and not (type(by) is str and (by in REQUESTERS or FLEET.fullmatch(by))):
        problems.append("requestedBy: ")
    if at is not None and _time(at) is None:
        problems.append("requestedAt: ")
    return problems


def _children(value: Any) -> list[Any]:
    if isinstance(value, _Object):
        return [v for _, v in value]
    return list(value) if isinstance(value, list) else []


def _walk(value: Any) -> list[tuple[Any, int]]:
    """Every value in the tree with its nesting depth, iteratively (the tree may be deep)."""
    found, todo = [], [(value, 0)]
    while todo:
        node, depth = todo.pop()
        found.append((node, depth))
        todo.extend((child, depth + 1) for child in _children(node))
    return found


def _duplicates(value: Any) -> set[str]:
    found: set[str] = set()
    for node, _ in _walk(value):
        if isinstance(node, _Object):
            keys = [key for key, _ in node]
            found |= {key for key in keys if keys.count(key) > 1}
    return found


def _depth(value: Any) -> int:
    """Nesting depth: 1 for [] or {}, 0 for a scalar."""
    return (
        max(depth + 1 for node, depth in _walk(value) if isinstance(node, list))
        if isinstance(value, list)
        else 0
    )


def _has_surrogate(value: Any) -> bool:
    def bad(text: str) -> bool:
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)

    for node, _ in _walk(value):
        if isinstance(node, str) and bad(node):
            return True
        if isinstance(node, _Object) and any(bad(key) for key, _ in node):
            return True
    return False


def assert_one_line(message: str, limit: int = MAX_MESSAGE) -> None:
    """One printable, non-empty line of at most `limit` characters."""
    assert message.strip(), "empty message"
    assert len(message.splitlines()) == 1 and "\n" not in message and "\r" not in message, message
    controls = [ch for ch in message if unicodedata.category(ch) == "Cc"]
    assert not controls, f"control characters {controls!r} in {message!r}"
    assert len(message) <= limit, f"{len(message)} characters: {message[:200]!r}..."


def assert_names_a_problem(message: str, verdict: Verdict) -> None:
    assert any(fragment in message for fragment in verdict.problems), (
        f"{message!r} names none of {verdict.problems}"
    )


def check_document(path: Path, data: bytes) -> None:
    """The property of one desired.json: contract-exact acceptance, or a clean refusal."""
    verdict = oracle(data)
    try:
        document = protocol.parse_desired(files.read_text(path))
    except FileRefused as exc:
        assert verdict.file_problem is not None, f"read_text refused readable text: {exc}"
        assert str(exc).startswith(f"{path}: ")
        assert verdict.file_problem in exc.reason, exc.reason
        assert_one_line(exc.reason)
        event("refused: file")
        return
    except InvalidDocument as exc:
        assert verdict.file_problem is None, f"{verdict.file_problem} should have been refused"
        assert verdict.accepted is None, f"a valid document was refused: {exc}"
        assert_one_line(str(exc))
        assert_names_a_problem(str(exc), verdict)
        event(f"refused: {str(exc).split(':')[0].split(' ')[0]}")
        return
    event("accepted")
    assert isinstance(document, DesiredFile)
    got = (document.generation, document.desired, document.requested_by, document.requested_at)
    assert verdict.accepted == got, (
        f"accepted what the contract refuses ({verdict.problems or verdict.file_problem}): "
        f"{data[:300]!r}"
    )
    assert type(document.generation) is int and 0 <= document.generation <= MAX_GENERATION
    assert document.desired in WANTS
    assert type(document.schema_version) is int and document.schema_version == 1


# --- strategies -------------------------------------------------------------------------------


def json_values(max_key: int = MAX_KEY) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=40)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=max_key), inner, max_size=4)
        ),
        max_leaves=12,
    )


JSON_VALUES = json_values()


@st.composite
def json_texts(draw: st.DrawFn) -> bytes:
    """Arbitrary JSON values, as json.dumps writes them (NaN and Infinity included)."""
    text = json.dumps(
        draw(JSON_VALUES),
        allow_nan=True,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 0, 2, "\t"])),
        sort_keys=draw(st.booleans()),
    )
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate makes invalid UTF-8


EDGE_NUMBERS = [
    "0",
    "-0",
    "1",
    "-1",
    "01",
    "+1",
    ".1",
    "1.",
    "0x1",
    "1.0",
    "1e0",
    "1E0",
    "1e+0",
    "10e-1",
    "0.1e1",
    "5e-324",
    "1e-400",
    "1e400",
    "-1e400",
    "2e308",
    str(MAX_GENERATION - 1),
    str(MAX_GENERATION),
    str(MAX_GENERATION + 1),
    str(MAX_GENERATION + 2),
    str(-MAX_GENERATION),
    f"{MAX_GENERATION}.0",
    f"{MAX_GENERATION}e0",
    "9007199254740992e0",
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    str(-(2**63) - 1),
    "9" * 40,
]
EDGE_TOKENS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "nan",
    "inf",
    "true",
    "false",
    "True",
    "null",
    "None",
    '"1"',
    '"1.0"',
    '"5"',
    "[]",
    "{}",
    "[1]",
    '["running"]',
    '{"value": 1}',
    "''",
    "'running'",
    "running",
    '""',
    '"\\ud800"',
    '"\\udc00running"',
    '"running\\""',
    '"\\u0000"',
]
WANT_VARIANTS = [
    "running",
    "stopped",
    "Running",
    "RUNNING",
    "Stopped",
    " running",
    "running ",
    "run",
    "runningg",
    "paused",
    "starting",
    "failed",
    "",
    "running\x00",
    "running\n",
    "stopped\t",
    "\uff52\uff55\uff4e\uff4e\uff49\uff4e\uff47",
    "\u0155unning",
    "runn\u0456ng",
    "\u200brunning",
    "running\u2028",
    "🏃",
]
REQUESTER_VARIANTS = [
    "operator",
    "gateway",
    "Operator",
    "GATEWAY",
    " operator",
    "gateway\x00",
    "root",
    "worker",
    "",
    "op\u0435rator",
]
TIME_VARIANTS = [
    "2026-11-30T17:14:35.239Z",
    "2026-11-30T17:14:35Z",
    "2026-11-30T17:14:35.123456+01:00",
    "2026-11-30T17:14:35-00:00",
    "2024-02-29T00:00:00Z",
    "0001-01-01T00:00:00Z",
    "9999-12-31T23:59:59.999999Z",
    "2026-11-30T17:14:35.1234567Z",
    "2026-11-30T17:14:35.Z",
    "2025-02-29T00:00:00Z",
    "2026-02-30T00:00:00Z",
    "2026-13-01T00:00:00Z",
    "2026-00-10T00:00:00Z",
    "0000-01-01T00:00:00Z",
    "2026-11-30T24:00:00Z",
    "2026-11-30T23:60:00Z",
    "2026-12-31T23:59:60Z",
    "2026-11-30T17:14:35+24:00",
    "2026-11-30T17:14:35+01:60",
    "2026-11-30T17:14:35+0100",
    "9999-12-31T23:59:59-00:01",
    "0001-01-01T00:00:00+00:01",
    "9999-12-31T23:59:59+00:01",
    "0001-01-01T00:00:00-00:01",
    "2026-11-30T17:14:35+01",
    "2026-11-30T17:14:35z",
    "2026-11-30t17:14:35Z",
    "2026-11-30 17:14:35Z",
    "2026-11-30T17:14Z",
    "2026-11-30",
    "2026-11-30T17:14:35",
    "1700000000",
    "20261130T171435Z",
    "+2026-11-30T17:14:35Z",
    "2026-11-30T17:14:35,5Z",
    "\uff12026-11-30T17:14:35Z",
    "2026-11-30T17:14:35Z\n",
]
WANT_ESCAPED = ['"\\u0072unning"', '"run\\u006Eing"', '"\\u0073topped"', '"stoppe\\u0064"']
SPACES = ["", " ", "  ", "\n", "\t", "\r\n", " \n\t ", "\u00a0", "\x0b", "\x00"]


def _escape_one(key: str, index: int, upper: bool) -> str:
    """Key as JSON text with one character written as a \\u escape (the same key, decoded)."""
    code = f"\\u{ord(key[index]):04x}"
    return (
        '"'
        + key[:index]
        + (code.upper().replace("\\U", "\\u") if upper else code)
        + (key[index + 1 :] + '"')
    )


@functools.lru_cache(maxsize=64)
def key_texts(name: str) -> st.SearchStrategy[str]:
    """JSON text of a key that may or may not be `name`."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    variants = {
        name,
        name.upper(),
        name.lower(),
        name.swapcase(),
        name.title(),
        snake,
        snake.replace("_", "-"),
        f" {name}",
        f"{name} ",
        f"{name}\x00",
        name[:-1],
        name + "s",
        name.replace("e", "\u0435"),
    }
    texts = st.sampled_from(sorted(json.dumps(v) for v in variants))
    if not name:
        return texts
    return texts | st.builds(
        _escape_one, st.just(name), st.integers(0, len(name) - 1), st.booleans()
    )


NESTINGS = {"[": "]", '{"a":': "}", '{"k": [': "]}", "[{}, ": "]", '[1, {"': ""}


_PATTERNS = st.lists(st.sampled_from(sorted(NESTINGS)), min_size=1, max_size=3)


@st.composite
def nested(draw: st.DrawFn) -> str:
    """A value nested up to MAX_DEPTH deep, from a short repeated pattern of openers."""
    depth = draw(st.integers(1, MAX_DEPTH))
    pattern = draw(_PATTERNS)
    opens = [pattern[i % len(pattern)] for i in range(depth)]
    closed = draw(st.booleans()) or '[1, {"' in opens
    inner = "1" if not closed else "1" + "".join(NESTINGS[o] for o in reversed(opens))
    return "".join(opens) + inner


VALUE_TEXTS: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.sampled_from(EDGE_TOKENS),
    st.sampled_from(WANT_ESCAPED),
    st.sampled_from(WANT_VARIANTS).map(json.dumps),
    st.sampled_from(REQUESTER_VARIANTS + TIME_VARIANTS).map(json.dumps),
    (st.integers(MAX_GENERATION - 3, MAX_GENERATION + 3) | st.integers(-3, 10)).map(str),
    st.integers().map(str),
    st.integers(1, MAX_DIGITS).map(lambda n: "9" * n),
    st.floats(allow_nan=True, allow_infinity=True).map(json.dumps),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    nested(),
)
EXTRA_KEYS = st.text(max_size=MAX_KEY) | st.sampled_from([*KEYS, *OPTIONAL, "image", "command", ""])
SPACE = st.sampled_from(SPACES[:7])
LAYOUTS = st.sampled_from(["compact", "spaced", "indented", "mixed"])
GENERATIONS = st.integers(0, MAX_GENERATION) | st.sampled_from([0, 1, 5, MAX_GENERATION])
OPS = st.sampled_from(["replace", "extra", "remove", "rekey", "duplicate"])
# around the object: JSON whitespace, and one time in eight something that breaks it
FRAMING = st.sampled_from([("", ""), ("", "\n"), (" \r\n", "\t "), ("\n", "\n\n")])
BAD_FRAMING = st.sampled_from(
    [
        ("\ufeff", ""),
        ("\u00a0", ""),
        ("[", ""),
        ("x", ""),
        ("", "\x00"),
        ("", ","),
        ("", "}"),
        ("", "\n{}"),
        ("", "//"),
        ("\x0c", ""),
    ]
)
ONE_IN_EIGHT = st.integers(0, 7)
SMALL = st.integers(0, 3)
INDEX = st.integers(0, 255)  # taken modulo the length it indexes
WANT = st.sampled_from(WANTS)
# what a host writes for who asked and when: each said, null or left out
SAID_BY = [*REQUESTERS, "operator@b", "operator@B", None]  # another machine's operator too
REQUESTER = st.sampled_from(SAID_BY).map(json.dumps) | st.none()
REQUEST_TIME = (
    st.datetimes(timezones=st.sampled_from([UTC, timezone(timedelta(hours=-7))])).map(
        lambda at: json.dumps(at.isoformat())
    )
    | st.just("null")
    | st.none()
)


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """The valid document, then a few mutations of its JSON text."""
    members: list[list[str]] = [
        ["schemaVersion", '"schemaVersion"', "1"],
        ["generation", '"generation"', str(draw(GENERATIONS))],
        ["desired", '"desired"', json.dumps(draw(WANT))],
    ]
    for key, value in (("requestedBy", draw(REQUESTER)), ("requestedAt", draw(REQUEST_TIME))):
        if value is not None:
            members.append([key, json.dumps(key), value])
    for _ in range(draw(SMALL)):
        op = draw(OPS)
        if op == "extra" or not members:
            key = draw(EXTRA_KEYS)
            text = json.dumps(key, ensure_ascii=draw(st.booleans()))
            members.insert(draw(INDEX) % (len(members) + 1), [key, text, draw(VALUE_TEXTS)])
            continue
        index = draw(INDEX) % len(members)
        if op == "replace":
            members[index][2] = draw(VALUE_TEXTS)
        elif op == "remove":
            del members[index]
        elif op == "rekey":
            members[index][1] = draw(key_texts(members[index][0]))
        else:
            copy = [*members[index]]
            if draw(st.booleans()):
                copy[2] = draw(VALUE_TEXTS)
            members.insert(draw(INDEX) % (len(members) + 1), copy)
    if draw(st.booleans()):
        members = list(draw(st.permutations(members)))
    layout = draw(LAYOUTS)

    def space() -> str:
        return {"compact": "", "spaced": " ", "indented": "\n  "}.get(layout) or draw(SPACE)

    parts = [f"{key}{space()}:{space()}{value}" for _, key, value in members]
    body = "{" + space() + f",{space()}".join(parts) + space() + "}"
    prefix, suffix = draw(BAD_FRAMING if draw(ONE_IN_EIGHT) == 7 else FRAMING)
    return (prefix + body + suffix).encode("utf-8", "surrogatepass")


INSERTS = st.sampled_from(
    [
        b",",
        b"}",
        b"{",
        b"]",
        b'"',
        b"\\",
        b":",
        b"\x00",
        b"\xff",
        b"\xef\xbb\xbf",
        b"\xc3",
        b"\xed\xa0\x80",
        b"\xe2\x80\xa8",
        b"\xc2\xa0",
        b"NaN",
        b"-",
        b"e",
        b".",
        b"0",
    ]
) | st.binary(min_size=1, max_size=3)
EDITS = st.sampled_from(["delete", "insert", "replace", "truncate", "repeat"])
POSITION = st.integers(0, 1 << 16)  # taken modulo the length it indexes
BYTE = st.integers(0, 255)
SPAN = st.integers(1, 8)
EDIT_COUNT = st.integers(1, 3)


@st.composite
def corrupted(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """Byte-level edits of a document: deletions, insertions, replacements, truncation."""
    data = bytearray(draw(base))
    for _ in range(draw(EDIT_COUNT)):
        op = draw(EDITS)
        at = draw(POSITION) % (len(data) + 1)
        if op == "delete":
            del data[at : at + draw(SPAN) // 2 + 1]
        elif op == "insert":
            data[at:at] = draw(INSERTS)
        elif op == "replace" and at < len(data):
            data[at] = draw(BYTE)
        elif op == "truncate":
            del data[at:]
        else:
            data[at:at] = data[at : at + draw(SPAN)]
    return bytes(data)


@st.composite
def near_the_limit(draw: st.DrawFn) -> bytes:
    """A valid document padded with JSON whitespace to within two bytes of the read limit."""
    core = b'{"schemaVersion": 1, "generation": 9, "desired": "stopped"}'
    size = draw(st.integers(files.MAX_READ - 2, files.MAX_READ + 2))
    pad = size - len(core)
    before = draw(st.integers(0, pad))
    fill = draw(st.sampled_from([b" ", b"\n", b"\t", b"\r\n"]))
    padding = (fill * pad)[:pad]
    if fill == b"\r\n" and pad % 2:
        padding = padding[:-1] + b" "
    return padding[:before] + core + padding[before:]


def desired_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(  # documents() three times: weighted towards the schema
        documents(),
        documents(),
        documents(),
        corrupted(documents()),
        st.binary(max_size=200),
        json_texts(),
        st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
        near_the_limit(),
    )


def _with_corpus(test: Any) -> Any:
    """The shared corpus (tests/corpus.py) as explicit examples, besides the generated ones."""
    for case in INVALID:
        if case.kind == "bytes":
            test = example(case.content)(test)
    for _, content, _, _ in VALID:
        test = example(content)(test)
    return test


# --- 1. bytes -> read_text -> parse_desired ---------------------------------------------------


def test_desired_bytes_follow_the_contract(tmp_path: Path) -> None:
    path = tmp_path / DESIRED

    @FUZZ
    @_with_corpus
    @given(desired_bytes())
    def check(data: bytes) -> None:
        path.unlink(missing_ok=True)  # a fresh file: ext4 flushes a truncated one (auto_da_alloc)
        path.write_bytes(data)
        check_document(path, data)

    check()


def test_the_oracle_agrees_with_the_shared_corpus() -> None:
    """The oracle itself, on documents whose verdict is known."""
    for case in INVALID:
        if case.kind == "bytes":
            verdict = oracle(case.content)
            assert verdict.accepted is None, case.name
    for name, content, generation, want in VALID:
        accepted = oracle(content).accepted
        assert accepted is not None and accepted[:2] == (generation, want), name


# --- 2. the worker's intake: never an action on invalid input --------------------------------


def put(path: Path, data: bytes) -> None:
    """Replace desired.json atomically (temp file + rename), as the host does."""
    tmp = path.with_name(f".{path.name}.fuzz")
    tmp.write_bytes(data)
    if path.is_file():  # no reader runs meanwhile; spares ext4's flush on rename-over
        path.unlink()
    os.replace(tmp, path)


VALID_5 = b'{"schemaVersion": 1, "generation": 5, "desired": "running"}'
URL = "http://172.30.0.1:8888"
TARGETS = (TargetGroup(targets=["172.30.0.1:8888"], labels={"engine": "tensorfold"}),)


class Scene:
    """The worker's intake after it accepted generation 5 "running": acknowledged, or settled
    as running. What the worker does with desired.json is read_request, then accept, then the
    answer shown with the refusal, written by the real Heartbeat to status.json and file_sd: a
    chain of pure functions and file writes, with no way to reach Docker."""

    def __init__(self, root: Path, settled: bool) -> None:
        data = root / "data"
        self.directory = files.ensure_dir(data / "fuzz")
        self.desired = self.directory / DESIRED
        self.status = self.directory / STATUS
        self.file_sd = data / TELEMETRY_DIR / "fuzz.json"
        self.heartbeat = Heartbeat(
            self.status, FileSdWriter(data, "fuzz"), 15.0, Notifier(), WorkerMetrics("fuzz")
        )
        self.settled = settled
        self.pursuit: Pursuit | None = None
        self.decision: Decision | None = None
        self.refused: str | None = None
        self.reset()

    def intake(self) -> None:
        """One pass of the worker loop's desired.json handling: the same read_request and
        intake() that Worker._read_request calls, and the same Heartbeat."""
        taken = intake(self.pursuit, self.decision, read_request(self.desired))
        self.pursuit, self.refused = taken.pursuit, taken.refused
        self.decision = taken.shown(self.decision)
        assert self.decision is not None
        self.heartbeat.show(
            shown(self.decision.answer, self.refused), self.refused, self.decision.targets
        )

    def reset(self) -> None:
        self.pursuit, self.decision, self.refused = None, None, None
        put(self.desired, VALID_5)
        self.intake()
        if self.settled:
            assert self.pursuit is not None
            self.pursuit = replace(self.pursuit, ready="c1")
            self.decision = Decision(
                self.pursuit, Answer(5, "running", f"serving at {URL}", URL), TARGETS
            )
            self.intake()
        assert self.pursuit is not None
        assert (self.pursuit.generation, self.pursuit.desired) == (5, "running")
        assert self.refused is None
        status = self.read_status()
        assert status.state == ("running" if self.settled else "starting")
        assert status.refused is None

    def read_status(self) -> protocol.Status:
        return protocol.parse_status(files.read_text(self.status))

    def _targets(self) -> bytes | None:
        """The file_sd file's bytes, or None while nothing has been written."""
        return self.file_sd.read_bytes() if self.file_sd.exists() else None

    def check(self, data: bytes) -> None:
        self.reset()
        pursuit, before = self.pursuit, self.read_status()
        targets = self._targets()
        verdict = oracle(data)
        put(self.desired, data)
        self.intake()
        status = self.read_status()  # valid per the contract, whatever happened
        if verdict.accepted is None:
            refused = self.refused
            assert self.pursuit is pursuit, "an invalid desired.json changed the request"
            assert refused, "an invalid desired.json was not refused"
            assert refused.startswith(f"{self.desired}: "), refused
            assert_one_line(refused, limit=MAX_MESSAGE + len(str(self.desired)) + 2)
            if verdict.file_problem is not None:
                assert verdict.file_problem in refused, refused
            else:
                assert_names_a_problem(refused, verdict)
            assert status.refused == protocol.clean_message(refused)
            assert (status.generation, status.state) == (before.generation, before.state)
            assert status.url == before.url
            if self.settled:
                assert status.message.startswith("request refused: "), status.message
            else:
                assert status.message == before.message
            assert self._targets() == targets, "file_sd changed on invalid input"
            return
        generation, want = verdict.accepted[:2]
        assert self.refused is None and status.refused is None
        assert self.pursuit is not None
        assert (self.pursuit.generation, self.pursuit.desired) == (generation, want)
        if (generation, want) == (5, "running"):
            assert self.pursuit is pursuit, "the same request was accepted again"
            assert status.state == before.state
        else:
            assert status.generation == generation
            assert status.state == ("starting" if want == "running" else "stopping")


@pytest.mark.parametrize("settled", [False, True], ids=["acknowledged", "settled-running"])
def test_the_worker_never_acts_on_invalid_input(tmp_path: Path, settled: bool) -> None:
    scene = Scene(tmp_path, settled)

    @WORKER_FUZZ
    @_with_corpus
    @given(desired_bytes())
    def check(data: bytes) -> None:
        scene.check(data)

    check()


@pytest.mark.parametrize("case", [c for c in INVALID if c.kind != "bytes"], ids=lambda c: c.name)
@pytest.mark.parametrize("settled", [False, True], ids=["acknowledged", "settled-running"])
def test_the_worker_refuses_what_is_not_a_file(tmp_path: Path, case: Any, settled: bool) -> None:
    """FIFO, directory and symlink (tests/corpus.py) through the same intake."""
    scene = Scene(tmp_path, settled)
    pursuit = scene.pursuit
    materialise(case, scene.desired, elsewhere=tmp_path / "elsewhere")
    scene.intake()
    assert scene.pursuit is pursuit
    refused = scene.refused
    assert refused and all(needle in refused for needle in case.expect), refused
    assert_one_line(refused, limit=MAX_MESSAGE + len(str(scene.desired)))
    assert scene.read_status().refused == refused


# --- regressions of findings this fuzzing reported (each fixed) -------------------------------

DEEP = [
    "[" * 5_000 + "]" * 5_000,
    "[" * 20_000,
    '{"a": ' * 3_000 + "1" + "}" * 3_000,
    '{"schemaVersion": 1, "generation": 3, "desired": "running", "x": '
    + "[" * 10_000
    + "]" * 10_000
    + "}",
]
LONG_INTEGERS = [
    '{"schemaVersion": 1, "generation": ' + "1" * 4_301 + ', "desired": "running"}',
    "9" * 5_000,
    '{"x": -' + "1" * 60_000 + "}",
]
LONG_KEYS = [
    '{"schemaVersion": 1, "generation": 3, "desired": "running", "' + "k" * 60_000 + '": 1}',
    '{"' + "k" * 30_000 + '": 1, "' + "k" * 30_000 + '": 2}',
    '{"schemaVersion": 1, "generation": 3, "desired": "running", "' + "\\u0001" * 1_000 + '": 1}',
]


@pytest.mark.parametrize("text", DEEP, ids=["array", "unclosed", "object", "extra-field"])
def test_deeply_nested_json_is_refused(tmp_path: Path, text: str) -> None:
    """Was: RecursionError escaped protocol.check_json and ended the worker loop."""
    with pytest.raises(InvalidDocument) as caught:
        protocol.parse_desired(text)
    assert_one_line(str(caught.value))
    scene = Scene(tmp_path, settled=False)
    put(scene.desired, text.encode())
    scene.intake()
    assert scene.refused


@pytest.mark.parametrize("text", LONG_INTEGERS, ids=["generation", "bare", "extra-field"])
def test_integers_beyond_4300_digits_are_refused(tmp_path: Path, text: str) -> None:
    """Was: int()'s digit limit raised ValueError out of the worker loop."""
    with pytest.raises(InvalidDocument) as caught:
        protocol.parse_desired(text)
    assert_one_line(str(caught.value))
    scene = Scene(tmp_path, settled=False)
    put(scene.desired, text.encode())
    scene.intake()
    assert scene.refused


@pytest.mark.parametrize("text", LONG_KEYS, ids=["unknown", "duplicate", "escaped"])
def test_messages_about_long_keys_are_bounded(text: str) -> None:
    """Was: the refusal repeated the whole key."""
    with pytest.raises(InvalidDocument) as caught:
        protocol.parse_desired(text)
    assert_one_line(str(caught.value))


def test_an_empty_key_is_named_as_such() -> None:
    """Was: an empty key was reported as the field 'document'."""
    with pytest.raises(InvalidDocument) as caught:
        protocol.parse_desired('{"": 0, "schemaVersion": 1, "generation": 0, "desired": "running"}')
    assert str(caught.value) == "unknown field ''"
