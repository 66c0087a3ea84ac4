"""Fuzzing recipe files: recipe.parse and recipe.load return a recipe or raise RecipeError, never
anything else, and the message is one line naming the file (issue 7, "Fuzzing").

Properties, with the "lucia-fuzz" profile (tests/fuzz/conftest.py; derandomized):

- test_recipe_text_is_parsed_or_refused (3,000 examples): arbitrary text, and character-level
  edits of the shipped and minimal recipes (lines deleted, repeated, swapped; characters inserted,
  replaced), through recipe.parse(text, "x.toml").
- test_mutated_recipes_are_parsed_or_refused (2,000 examples): the minimal tensorfold recipe, the
  minimal llama-router recipe and recipes/spark-model.toml as dicts, mutated (values replaced by
  arbitrary or edge TOML values, keys removed, added, re-cased; the engine swapped), serialised by
  the small TOML emitter below (tomli_w is not a dependency). Besides the property above: a
  returned recipe keeps the recipe invariants (ports, paths, image tags, commit, module and
  environment names, a command that expands); one unknown key added to a closed section is
  refused naming it; one required key removed is refused naming it.
- test_recipe_bytes_load_or_refuse (1,000 examples): random bytes, invalid UTF-8, UTF-16, a BOM,
  files around the 64 KiB read limit, through recipe.load(path): only RecipeError, its message
  starting with the path.
- test_the_emitter_round_trips (200 examples): tomllib.loads(emit(d)) == d, so the mutations
  reach validation instead of failing as TOML.

A RecipeError is "x.toml: " and then one printable, non-empty line. Reported findings not fixed
yet are pinned by strict xfail reproducers at the end; each UNFIXED_* flag keeps the fuzz short of
(or tolerant of) exactly that finding. When a fix lands its reproducer XPASSes (a failure, since
strict): set the flag to False, which makes the fuzz strict about it too.
"""

from __future__ import annotations

import copy
import math
import os
import re
import string
import tomllib
import unicodedata
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.loader import load, parse
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.protocol import files
from supervisor.recipe.schema import RecipeError
from tests.support import MINIMAL_RECIPE

FUZZ = settings.get_profile("lucia-fuzz")
TEXT_FUZZ = settings(FUZZ, max_examples=max(50, FUZZ.max_examples * 3 // 10))
MUTATION_FUZZ = settings(FUZZ, max_examples=max(50, FUZZ.max_examples // 5))
LOAD_FUZZ = settings(FUZZ, max_examples=max(50, FUZZ.max_examples // 10))
EMITTER_FUZZ = settings(FUZZ, max_examples=max(50, FUZZ.max_examples // 50))

# Findings reported and not fixed yet (see the reproducers at the end of this file).
UNFIXED_DEEP_NESTING = False  # tomllib's RecursionError escapes recipe.parse
UNFIXED_LONG_INTEGERS = False  # tomllib's ValueError (int_max_str_digits) escapes recipe.parse
UNFIXED_RAW_TEXT_IN_MESSAGES = False  # keys and the engine tag reach the message unescaped
UNFIXED_UNBOUNDED_NUMBERS = False  # stop_grace = inf, ulimits beyond int64 are accepted

MAX_DEPTH = 100 if UNFIXED_DEEP_NESTING else 2_000
MAX_DIGITS = 2_000 if UNFIXED_LONG_INTEGERS else 10_000
ORIGIN = "x.toml"

ROOT = Path(__file__).resolve().parents[2]
SPARK = (ROOT / "recipes" / "spark-model.toml").read_text()
MINIMAL = MINIMAL_RECIPE
ROUTER = """
name = "r"
engine = "llama-router"
[library]
models_dir = "/srv/models"
cache_dir = "/var/cache/gguf"
[router]
image = "ghcr.io/ggml-org/llama.cpp:server"
models_max = 2
load_on_startup = ["a"]
defaults = { ctx-size = 8192, flash-attn = true }
[run]
port = 8080
command = ["--port", "${P}"]
[settings]
P = 8080
"""
BASES = {"minimal": MINIMAL, "router": ROUTER, "spark": SPARK}
BASE_DATA = {name: tomllib.loads(text) for name, text in BASES.items()}

# Sections that are closed models (unknown keys refused) versus open maps, by engine.
OPEN_MAPS = {("settings",), ("image", "build_args"), ("run", "ulimits"), ("router", "defaults")}
REQUIRED = {
    "tensorfold": {
        ("name",),
        ("model",),
        ("run",),
        ("source",),
        ("image",),
        ("grammar",),
        ("source", "repository"),
        ("source", "commit"),
        ("image", "tag"),
        ("grammar", "requirement"),
        ("grammar", "modules"),
        ("run", "port"),
    },
    "llama-router": {
        ("name",),
        ("run",),
        ("library",),
        ("router",),
        ("library", "models_dir"),
        ("library", "cache_dir"),
        ("router", "image"),
        ("run", "port"),
    },
}


# --- a small TOML emitter (strings, ints, floats, bools, dates, lists, tables) -----------------

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if _BARE.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + pairs + "}"
    raise TypeError(f"no TOML for {type(value).__name__}")


def emit(document: dict[str, Any], inline: bool = False) -> str:
    """TOML for a dict: sub-tables as [headers] (or all inline), everything else as values."""
    lines: list[str] = []

    def table(data: dict[str, Any], path: list[str]) -> None:
        if path:
            lines.append("[" + ".".join(toml_key(part) for part in path) + "]")
        subtables = []
        for key, value in data.items():
            if isinstance(value, dict) and not inline:
                subtables.append((key, value))
            else:
                lines.append(f"{toml_key(key)} = {toml_value(value)}")
        for key, value in subtables:
            table(value, [*path, key])

    table(document, [])
    return "\n".join(lines) + "\n"


# --- the property ---------------------------------------------------------------------------


def _breaks_lines(text: str) -> bool:
    return any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in text)


def _has_raw_text_finding(text: str) -> bool:
    """Known finding (UNFIXED_RAW_TEXT_IN_MESSAGES): a key anywhere, or the engine tag, holding a
    control or line-break character reaches the message unescaped."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return False

    def keys(value: Any) -> bool:
        if isinstance(value, dict):
            return any(_breaks_lines(k) or keys(v) for k, v in value.items())
        return isinstance(value, list) and any(keys(item) for item in value)

    engine = data.get("engine")
    return keys(data) or (isinstance(engine, str) and _breaks_lines(engine))


def assert_one_line(message: str, source: str) -> None:
    if UNFIXED_RAW_TEXT_IN_MESSAGES and _has_raw_text_finding(source):
        return
    assert len(message.splitlines()) == 1 and "\n" not in message and "\r" not in message, message
    controls = [ch for ch in message if unicodedata.category(ch) == "Cc"]
    assert not controls, f"control characters {controls!r} in {message!r}"


def check_text(text: str) -> TensorFoldRecipe | LlamaRouterRecipe | None:
    """recipe.parse returns a recipe that keeps the invariants, or raises a clean RecipeError."""
    try:
        result = parse(text, ORIGIN)
    except RecipeError as exc:
        message = str(exc)
        assert message.startswith(f"{ORIGIN}: "), message
        assert message[len(ORIGIN) + 2 :].strip(), f"nothing named: {message!r}"
        assert_one_line(message, text)
        _event("refused: not TOML" if "not valid TOML" in message else "refused: invalid recipe")
        return None
    check_invariants(result)
    _event(f"accepted: {result.engine}")
    return result


def _event(name: str) -> None:
    if currently_in_test_context():  # outcome statistics: pytest --hypothesis-show-statistics
        event(name)


_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# Docker's reference grammar, written out here once more: [host[:port]/]path[:tag][@digest]
_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:(?:{_LABEL}\.)*{_LABEL}|\[[0-9A-Fa-f:]+\])(?::\d+)?"
_TAG = re.compile(rf"(?:{_HOST}/)?{_PART}(?:/{_PART})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?")
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}"
_PULLED = re.compile(rf"{_TAG.pattern}(?:@{_DIGEST})?")


def check_invariants(result: Any) -> None:
    assert isinstance(result, TensorFoldRecipe | LlamaRouterRecipe)
    run = result.run
    assert 1 <= run.port <= 65535 and 1 <= run.inner_port <= 65535
    assert run.ready_path.startswith("/") and run.metrics_path.startswith("/")
    assert run.ready_timeout > 0 and run.stop_grace >= 0
    if not UNFIXED_UNBOUNDED_NUMBERS:
        assert_usable_numbers(result)
    assert all(volume.target.startswith("/") for volume in run.volumes)
    assert all(_ENV.fullmatch(key) for key in result.settings)
    assert all(isinstance(v, str) for v in result.environment.values())
    command = result.command  # every ${SETTING} expands
    assert len(command) == len(run.command) and all(isinstance(arg, str) for arg in command)
    if isinstance(result, TensorFoldRecipe):
        assert result.engine == "tensorfold" and result.model
        assert re.fullmatch(r"[0-9a-f]{40}", result.source.commit) and result.source.repository
        assert _TAG.fullmatch(result.image.tag)
        assert result.grammar_tag == f"{result.image.tag}-grammar"
        for relative in (result.image.context, result.image.dockerfile):
            assert not Path(relative).is_absolute() and ".." not in Path(relative).parts
        assert result.grammar.modules and all(_MODULE.fullmatch(m) for m in result.grammar.modules)
        assert all(command for command in result.prepare.commands)
    else:
        assert result.engine == "llama-router"
        assert _PULLED.fullmatch(result.router.image)
        assert len(result.router.load_on_startup) <= result.router.models_max
        assert result.library.container_dir.startswith("/")


def assert_usable_numbers(result: Any) -> None:
    """Timeouts that round() and Thread.join() accept; ulimits that fit Docker's int64."""
    run = result.run
    for seconds in (run.stop_grace, run.ready_timeout):
        assert math.isfinite(seconds) and seconds < 2**31, f"unusable timeout {seconds}"
    for name, value in run.ulimits.items():
        assert -(2**63) <= value < 2**63, f"ulimit {name} = {value} does not fit int64"


# --- strategies -------------------------------------------------------------------------------

KEY_TEXT = st.text(max_size=20) | st.sampled_from(["", "engine", "PORT", "a-b", "a.b", " "])
TEXT = st.text(max_size=40)


def toml_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.booleans(),
        st.integers(),
        st.integers(-(2**63) - 1, 2**63),
        st.floats(allow_nan=True, allow_infinity=True),
        TEXT,
        st.dates(),
        st.times(),
        st.datetimes(timezones=st.none() | st.just(UTC)),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEY_TEXT, inner, max_size=4),
        max_leaves=max_leaves,
    )


TOML_VALUES = toml_values()
EDGE_VALUES = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        4,
        1023,
        1024,
        65535,
        65536,
        70000,
        2**31 - 1,
        2**31,
        2**63 - 1,
        2**63,
        -(2**63),
        10**30,
        0.0,
        -0.0,
        0.5,
        1e-300,
        1e300,
        math.inf,
        -math.inf,
        math.nan,
        True,
        False,
        "",
        " ",
        ".",
        "..",
        "../x",
        "a/../b",
        "/abs",
        "~",
        "~/x",
        "rel",
        "/",
        "\x00",
        "a\x00b",
        "img:1",
        "IMG:1",
        "img:",
        ":1",
        "a:b:c",
        "img:" + "x" * 129,
        "img@sha256:00",
        "x" * 300,
        "0123456789abcdef0123456789abcdef01234567",
        "0123456789ABCDEF0123456789ABCDEF01234567",
        "0123456789abcdef",
        "all",
        "none",
        "host",
        "private",
        "shareable",
        "tensorfold",
        "llama-router",
        "${PORT}",
        "${NOPE}",
        "$",
        "$$",
        "${",
        "$1",
        "${A-B}",
        "üñí",
        "🙂",
        "xgrammar>=0.2.8,<0.3",
        "os; rm -rf /",
        "a\nb",
        "\x1b[31mred",
        [],
        [[]],
        [[""]],
        [["bash", "x.sh"]],
        ["xgrammar"],
        ["os.path"],
        ["1abc"],
        ["a", "b", "c"],
        {},
        {"A": 1},
        {"a-b": "x"},
        {"A": True},
        {"A": 1.5},
        {"memlock": -1},
        {"x": 2**70},
        [{"source": "/a", "target": "/b"}],
        [{"source": "/a", "target": "rel"}],
        [{"source": "/a", "target": "/b", "read_only": "yes"}],
    ]
)
FIELD_VALUES = EDGE_VALUES | TOML_VALUES
ENGINES = st.sampled_from(["tensorfold", "llama-router", "vllm", "", "TensorFold", "llama_router"])
INDEX = st.integers(0, 1 << 12)  # taken modulo the length it indexes


SHORT_TEXT = st.text(string.ascii_letters + string.digits + "._-/:${}~ ", max_size=8) | TEXT
SIMILAR_INTS = st.integers(-2, 70_000) | st.integers()
STRING_EDITS = [
    lambda old, new: old + new,
    lambda old, new: new + old,
    lambda old, new: old.upper(),
    lambda old, new: old[: len(old) // 2],
    lambda old, new: old.replace("/", new),
    lambda old, new: new,
    lambda old, new: f"{old}/{new}",
    lambda old, new: old.replace(".", ""),
]


def similar(draw: st.DrawFn, old: Any) -> Any:
    """A value of the same shape as old, often close to it: most mutations stay parseable."""
    if isinstance(old, bool):
        return draw(st.booleans())
    if isinstance(old, int):
        return draw(SIMILAR_INTS)
    if isinstance(old, float):
        return draw(st.floats(allow_nan=True, allow_infinity=True))
    if isinstance(old, str):
        return STRING_EDITS[draw(INDEX) % len(STRING_EDITS)](old, draw(SHORT_TEXT))
    if isinstance(old, list):
        items = [similar(draw, item) if draw(st.booleans()) else item for item in old]
        return items[: draw(INDEX) % (len(items) + 1)] if draw(st.booleans()) else items
    if isinstance(old, dict):
        return {key: similar(draw, value) for key, value in old.items()}
    return draw(FIELD_VALUES)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for key, child in value.items():
            found.append((*prefix, key))
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.append((*prefix, index))
            found += _paths(child, (*prefix, index))
    return found


def _tables(value: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for key, child in value.items():
        if isinstance(child, dict):
            found += _tables(child, (*prefix, key))
    return found


def _parent(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


def _recase(key: str, how: int) -> str:
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
    camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
    return [
        key.upper(),
        key.lower(),
        key.title(),
        snake,
        camel,
        key.replace("_", "-"),
        f"{key} ",
        f"{key}_",
        key[:-1],
    ][how % 9]


@st.composite
def mutated_recipes(draw: st.DrawFn) -> tuple[str, tuple[str, tuple[Any, ...]] | None]:
    """(TOML text, note); note is ("extra", path) or ("missing", path) when that one mutation is
    all that was done to a valid recipe, so its refusal must name it."""
    base = draw(st.sampled_from(sorted(BASE_DATA)))
    data = copy.deepcopy(BASE_DATA[base])
    ops = draw(
        st.lists(
            st.sampled_from(["set", "set", "set", "delete", "add", "rename", "engine"]),
            min_size=1,
            max_size=4,
        )
    )
    note: tuple[str, tuple[Any, ...]] | None = None
    for op in ops:
        paths = _paths(data)
        if op == "engine" or not paths:
            data["engine"] = draw(ENGINES | TEXT)
            continue
        path = paths[draw(INDEX) % len(paths)]
        parent = _parent(data, path)
        if op == "set":
            old = parent[path[-1]]
            new = similar(draw, old) if draw(st.booleans()) else draw(FIELD_VALUES)
            parent[path[-1]] = copy.deepcopy(new)  # EDGE_VALUES' lists are shared objects
        elif op == "delete":
            del parent[path[-1]]
            note = ("missing", path)
        elif op == "add":
            tables = _tables(data)
            where = tables[draw(INDEX) % len(tables)]
            target = _parent(data, (*where, None))
            known = draw(st.booleans())
            key = (
                f"zz_{draw(st.text(string.ascii_lowercase, max_size=6))}"
                if known
                else draw(KEY_TEXT)
            )
            target[key] = copy.deepcopy(draw(FIELD_VALUES))
            note = ("extra", (*where, key)) if known else None
        elif isinstance(path[-1], str):
            parent[_recase(path[-1], draw(INDEX))] = parent.pop(path[-1])
    if len(ops) != 1:
        note = None
    return emit(data, inline=draw(st.booleans())), note


LINE_EDITS = st.sampled_from(["drop", "repeat", "swap", "insert", "replace", "truncate"])
CHARS = st.sampled_from([*"[]{}=\"'.,#\\\n \t$0-_", "\x00", "\ufeff", '"""', "'''"]) | TEXT


@st.composite
def edited_text(draw: st.DrawFn) -> str:
    """A shipped or minimal recipe with a few line- or character-level edits."""
    text = BASES[draw(st.sampled_from(sorted(BASES)))]
    for _ in range(draw(st.integers(1, 3))):
        lines = text.splitlines(keepends=True)
        op = draw(LINE_EDITS)
        at = draw(INDEX) % (len(text) + 1)
        line = draw(INDEX) % max(len(lines), 1)
        if op == "drop" and lines:
            del lines[line]
            text = "".join(lines)
        elif op == "repeat" and lines:
            lines.insert(line, lines[line])
            text = "".join(lines)
        elif op == "swap" and len(lines) > 1:
            other = draw(INDEX) % len(lines)
            lines[line], lines[other] = lines[other], lines[line]
            text = "".join(lines)
        elif op == "insert":
            text = text[:at] + draw(CHARS) + text[at:]
        elif op == "replace" and at < len(text):
            text = text[:at] + draw(CHARS) + text[at + 1 :]
        elif op == "truncate":
            text = text[:at]
    return text


@st.composite
def nested_text(draw: st.DrawFn) -> str:
    depth = draw(st.integers(1, MAX_DEPTH))
    opener, closer = draw(st.sampled_from([("[", "]"), ("{a = ", "}"), ("[{b = ", "}]")]))
    return MINIMAL + f"\nulimits = {{x = {opener * depth}1{closer * depth}}}\n"


@st.composite
def long_integers(draw: st.DrawFn) -> str:
    digits = "9" * draw(st.integers(1, MAX_DIGITS))
    return MINIMAL + draw(st.sampled_from([f"port2 = {digits}\n", f"ulimits = {{x = {digits}}}\n"]))


def recipe_texts() -> st.SearchStrategy[str]:
    return st.one_of(
        edited_text(),
        st.text(max_size=200),
        st.text(alphabet="[]{}=\"'.,#\\\n \tabcdefn0123456789-_+:", max_size=120),
        nested_text(),
        long_integers(),
    )


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BASES))
def test_the_bases_are_valid(name: str) -> None:
    assert check_text(BASES[name]) is not None
    assert check_text(emit(BASE_DATA[name])) is not None
    assert check_text(emit(BASE_DATA[name], inline=True)) is not None


@TEXT_FUZZ
@given(recipe_texts())
def test_recipe_text_is_parsed_or_refused(text: str) -> None:
    check_text(text)


@MUTATION_FUZZ
@given(mutated_recipes())
def test_mutated_recipes_are_parsed_or_refused(
    case: tuple[str, tuple[str, tuple[Any, ...]] | None],
) -> None:
    text, note = case
    result = check_text(text)
    if note is None:
        return
    kind, path = note
    engine = tomllib.loads(text).get("engine")
    if kind == "extra" and path[:-1] not in OPEN_MAPS:
        assert result is None, f"unknown key {path} accepted"
        with pytest.raises(RecipeError) as caught:
            parse(text, ORIGIN)
        assert f"{path[-1]}: unknown key" in str(caught.value), str(caught.value)
    if kind == "missing" and path in REQUIRED.get(str(engine), set()):
        assert result is None, f"required {path} missing but accepted"
        with pytest.raises(RecipeError) as caught:
            parse(text, ORIGIN)
        assert f"{path[-1]}: Field required" in str(caught.value), str(caught.value)


def test_recipe_bytes_load_or_refuse(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"

    @LOAD_FUZZ
    @given(recipe_bytes())
    def check(data: bytes) -> None:
        path.unlink(missing_ok=True)
        path.write_bytes(data)
        try:
            result = load(path)
        except RecipeError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: "), message
            assert message[len(str(path)) + 2 :].strip()
            try:
                source = data.decode("utf-8")
            except UnicodeDecodeError:
                assert len(data) > files.MAX_READ or "UTF-8" in message, message
                source = ""
            if len(data) > files.MAX_READ:
                assert "the limit is" in message, message
            assert_one_line(message, source)
            return
        assert len(data) <= files.MAX_READ
        check_invariants(result)

    check()


@st.composite
def near_the_limit(draw: st.DrawFn) -> bytes:
    """The minimal recipe padded with comment lines to within two bytes of the read limit."""
    size = draw(st.integers(files.MAX_READ - 2, files.MAX_READ + 2))
    core = MINIMAL.encode()
    pad = size - len(core)
    line = b"#" * 79 + b"\n"
    padding = (line * (pad // len(line) + 1))[:pad]
    return padding[:-1] + b"\n" + core if draw(st.booleans()) else core + padding


BYTE_INSERTS = st.sampled_from(
    [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf", b"\xe2\x80\xa8"]
) | st.binary(min_size=1, max_size=3)


@st.composite
def corrupted_bytes(draw: st.DrawFn) -> bytes:
    data = bytearray(BASES[draw(st.sampled_from(sorted(BASES)))].encode())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(INDEX) % (len(data) + 1)
        data[at:at] = draw(BYTE_INSERTS)
    return bytes(data)


def recipe_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        corrupted_bytes(),
        st.sampled_from(sorted(BASES)).map(lambda n: BASES[n].encode("utf-16")),
        st.sampled_from(sorted(BASES)).map(lambda n: b"\xef\xbb\xbf" + BASES[n].encode()),
        near_the_limit(),
        edited_text().map(lambda t: t.encode("utf-8", "surrogatepass")),
    )


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "symlink"])
def test_a_recipe_that_is_not_a_file_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "real.toml").write_text(MINIMAL)
        path.symlink_to(tmp_path / "real.toml")
    with pytest.raises(RecipeError) as caught:
        load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and len(message.splitlines()) == 1, message


@EMITTER_FUZZ
@given(st.dictionaries(KEY_TEXT, TOML_VALUES, max_size=6), st.booleans())
def test_the_emitter_round_trips(document: dict[str, Any], inline: bool) -> None:
    text = emit(document, inline=inline)
    assert _same(tomllib.loads(text), document), text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# --- reproducers of reported findings (strict xfail: an XPASS means fixed; clear the flag) -----


@pytest.mark.xfail(
    UNFIXED_DEEP_NESTING,
    strict=True,
    raises=RecursionError,
    reason="finding: tomllib's RecursionError escapes recipe.parse",
)
@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5_000 + "]" * 5_000,
        "a = " + "{b = " * 1_000 + "1" + "}" * 1_000,
        MINIMAL + "command = [" + "[" * 2_000 + "]" * 2_000 + "]\n",
    ],
    ids=["array", "inline-table", "in-run"],
)
def test_finding_deeply_nested_toml_is_refused(text: str) -> None:
    with pytest.raises(RecipeError, match=f"^{ORIGIN}: "):
        parse(text, ORIGIN)


@pytest.mark.xfail(
    UNFIXED_LONG_INTEGERS,
    strict=True,
    raises=ValueError,
    reason="finding: a ValueError (int digits) escapes recipe.parse",
)
@pytest.mark.parametrize(
    "text",
    ["a = " + "1" * 4_301, MINIMAL + "ulimits = {x = " + "9" * 5_000 + "}\n"],
    ids=["bare", "ulimit"],
)
def test_finding_integers_beyond_4300_digits_are_refused(text: str) -> None:
    with pytest.raises(RecipeError, match=f"^{ORIGIN}: "):
        parse(text, ORIGIN)


@pytest.mark.xfail(
    UNFIXED_RAW_TEXT_IN_MESSAGES,
    strict=True,
    raises=AssertionError,
    reason="finding: keys, engine tag unescaped in RecipeError",
)
@pytest.mark.parametrize(
    "text",
    [
        MINIMAL + '"a\\nb" = 1\n',
        MINIMAL.replace('engine = "tensorfold"', 'engine = "a\\nb"'),
        MINIMAL.replace('engine = "tensorfold"', 'engine = "\\u001b[2J\\u001b[31mred"'),
        MINIMAL.replace('tag = "img:1"', 'tag = "img:1"\nbuild_args = {"x\\ny" = 1}'),
    ],
    ids=["key-newline", "engine-newline", "engine-escape", "build-arg-key"],
)
def test_finding_recipe_messages_are_one_printable_line(text: str) -> None:
    with pytest.raises(RecipeError) as caught:
        parse(text, ORIGIN)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert not [ch for ch in message if unicodedata.category(ch) == "Cc"], message


@pytest.mark.xfail(
    UNFIXED_UNBOUNDED_NUMBERS,
    strict=True,
    raises=AssertionError,
    reason="finding: unusable timeouts and ulimits are accepted",
)
@pytest.mark.parametrize(
    "line",
    [
        "stop_grace = inf",
        "stop_grace = 1e300",
        "ready_timeout = inf",
        "ulimits = {nofile = 9223372036854775808}",
    ],
)
def test_finding_unusable_numbers_are_refused(line: str) -> None:
    """Accepted today: round(inf) in Runtime.stop and Thread.join(inf) in
    Worker._abandon_task raise OverflowError, so such an engine can never be stopped."""
    try:
        result = parse(f"{MINIMAL}{line}\n", ORIGIN)
    except RecipeError:
        return
    assert_usable_numbers(result)
