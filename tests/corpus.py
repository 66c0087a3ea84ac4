"""desired.json inputs: a corpus of documents the worker must refuse, and documents it must accept.

Shared by the protocol unit tests and the worker tests: every INVALID case, materialised as
<engine dir>/desired.json, must be refused (with a one-line reason naming the problem) and must
never reach the engine. Each case says at which stage it is refused:

- "file": files.read_text refuses the path itself (FileRefused): not a regular file, a symlink,
  too large, not UTF-8;
- "document": the text reads fine and protocol.parse_desired refuses it (InvalidDocument).

`expect` holds substrings that the one-line error message must all contain.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["bytes", "fifo", "directory", "symlink"]
Stage = Literal["file", "document"]

MAX_GENERATION = 2**53 - 1
VALID_TEXT = b'{"schemaVersion": 1, "generation": 3, "desired": "running"}\n'


@dataclass(frozen=True)
class Case:
    name: str
    stage: Stage
    expect: tuple[str, ...]
    content: bytes = b""
    kind: Kind = "bytes"

    def __str__(self) -> str:
        return self.name


def _doc(body: str) -> bytes:
    return body.encode()


def _gen(value: str) -> bytes:
    return _doc(f'{{"schemaVersion": 1, "generation": {value}, "desired": "running"}}')


def _want(value: str) -> bytes:
    return _doc(f'{{"schemaVersion": 1, "generation": 3, "desired": {value}}}')


def _version(value: str) -> bytes:
    return _doc(f'{{"schemaVersion": {value}, "generation": 3, "desired": "running"}}')


def _by(value: str) -> bytes:
    return _doc(
        f'{{"schemaVersion": 1, "generation": 3, "desired": "stopped", "requestedBy": {value}}}'
    )


def _at(value: str) -> bytes:
    return _doc(
        f'{{"schemaVersion": 1, "generation": 3, "desired": "stopped", '
        f'"requestedBy": "operator", "requestedAt": {value}}}'
    )


def _document(name: str, content: bytes, *expect: str) -> Case:
    return Case(name, "document", expect, content)


def _file(name: str, *expect: str, content: bytes = b"", kind: Kind = "bytes") -> Case:
    return Case(name, "file", expect, content, kind)


INVALID: list[Case] = [
    # not JSON at all, or not quite JSON
    _document("empty", b"", "empty"),
    _document("whitespace-only", b" \n\t \r\n  ", "empty"),
    _document("truncated", b'{"schemaVersion": 1, "generation": 3, "desi', "not valid JSON"),
    _document("trailing-garbage", VALID_TEXT + b"x", "not valid JSON"),
    _document("two-documents", VALID_TEXT + VALID_TEXT, "not valid JSON"),
    _document("trailing-nul", VALID_TEXT + b"\x00", "not valid JSON"),
    _document(
        "trailing-comma",
        _doc('{"schemaVersion": 1, "generation": 3, "desired": "running",}'),
        "not valid JSON",
    ),
    _document(
        "single-quotes",
        _doc("{'schemaVersion': 1, 'generation': 3, 'desired': 'running'}"),
        "not valid JSON",
    ),
    _document("comment", b"// host\n" + VALID_TEXT, "not valid JSON"),
    _document("bom", b"\xef\xbb\xbf" + VALID_TEXT, "byte-order mark"),
    _document(
        "duplicate-key",
        _doc('{"schemaVersion": 1, "generation": 3, "desired": "stopped", "desired": "running"}'),
        "duplicate key",
        "desired",
    ),
    _document(
        "duplicate-key-escaped",
        _doc(
            '{"schemaVersion": 1, "generation": 3, '
            '"desired": "stopped", "desir\\u0065d": "running"}'
        ),
        "duplicate key",
        "desired",
    ),
    _document(
        "duplicate-key-nested",
        _doc('{"schemaVersion": 1, "generation": 3, "desired": {"a": 1, "a": 2}}'),
        "duplicate key",
    ),
    _document("generation-nan", _gen("NaN"), "NaN", "not valid JSON"),
    _document("generation-infinity", _gen("Infinity"), "Infinity", "not valid JSON"),
    _document("generation-minus-infinity", _gen("-Infinity"), "Infinity", "not valid JSON"),
    # JSON, but not an object
    _document("list", b"[]", "document", "object"),
    _document("list-of-document", b"[" + VALID_TEXT + b"]", "document", "object"),
    _document("string", b'"running"', "document", "object"),
    _document("number", b"3", "document", "object"),
    _document("null", b"null", "document", "object"),
    _document("true", b"true", "document", "object"),
    # an object, but not the contract
    _document("missing-all", b"{}", "missing field"),
    _document(
        "missing-schema-version",
        _doc('{"generation": 3, "desired": "running"}'),
        "missing field",
        "schemaVersion",
    ),
    _document(
        "missing-generation",
        _doc('{"schemaVersion": 1, "desired": "running"}'),
        "missing field",
        "generation",
    ),
    _document(
        "missing-desired", _doc('{"schemaVersion": 1, "generation": 3}'), "missing field", "desired"
    ),
    _document(
        "unknown-field",
        _doc('{"schemaVersion": 1, "generation": 3, "desired": "running", "image": "evil:latest"}'),
        "unknown field",
        "image",
    ),
    _document(
        "snake-case-field",
        _doc('{"schema_version": 1, "generation": 3, "desired": "running"}'),
        "schemaVersion",
    ),
    _document(
        "snake-case-extra",
        _doc('{"schemaVersion": 1, "schema_version": 1, "generation": 3, "desired": "running"}'),
        "unknown field",
        "schema_version",
    ),
    _document("generation-string", _gen('"3"'), "generation", '"3"'),
    _document("generation-negative", _gen("-1"), "generation", "-1"),
    _document("generation-float", _gen("3.0"), "generation", "3.0"),
    _document("generation-exponent", _gen("1e2"), "generation"),
    _document("generation-bool", _gen("true"), "generation", "true"),
    _document("generation-null", _gen("null"), "generation"),
    _document("generation-2**53", _gen(str(2**53)), "generation", str(2**53)),
    _document("generation-huge", _gen("1" + "0" * 30), "generation"),
    _document("generation-1e400", _gen("1e400"), "generation"),
    _document("generation-object", _gen('{"value": 3}'), "generation"),
    _document("desired-number", _want("1"), "desired", "1"),
    _document("desired-paused", _want('"paused"'), "desired", "paused"),
    _document("desired-capitalised", _want('"Running"'), "desired", "Running"),
    _document("desired-padded", _want('" running"'), "desired"),
    _document("desired-null", _want("null"), "desired"),
    _document("desired-list", _want('["running"]'), "desired"),
    _document("schema-version-2", _version("2"), "schemaVersion", "2"),
    _document("schema-version-0", _version("0"), "schemaVersion", "0"),
    _document("schema-version-string", _version('"1"'), "schemaVersion", '"1"'),
    _document("schema-version-bool", _version("true"), "schemaVersion", "true"),
    _document("schema-version-float", _version("1.0"), "schemaVersion", "1.0"),
    _document("requested-by-root", _by('"root"'), "requestedBy", "root"),
    _document("requested-by-capitalised", _by('"Operator"'), "requestedBy", "Operator"),
    _document("requested-by-number", _by("1"), "requestedBy", "1"),
    _document("requested-by-list", _by('["operator"]'), "requestedBy"),
    _document("requested-at-timestamp", _at('"1700000000"'), "requestedAt", "1700000000"),
    _document("requested-at-number", _at("1700000000"), "requestedAt", "1700000000"),
    _document("requested-at-date-only", _at('"2026-11-30"'), "requestedAt", "2026-11-30"),
    _document("requested-at-no-zone", _at('"2026-11-30T17:14:35"'), "requestedAt"),
    _document("requested-at-space", _at('"2026-11-30 17:14:35Z"'), "requestedAt"),
    _document("requested-at-february-30", _at('"2026-02-30T17:14:35Z"'), "requestedAt"),
    # the file itself is wrong
    _file(
        "one-mebibyte",
        "bytes; the limit",
        content=VALID_TEXT.rstrip(b"\n") + b" " * (2**20 - len(VALID_TEXT)) + b"\n",
    ),
    _file(
        "just-over-limit",
        "bytes; the limit",
        content=VALID_TEXT.rstrip(b"\n") + b" " * (64 * 1024 + 1 - len(VALID_TEXT)) + b"\n",
    ),
    _file("invalid-utf8", "UTF-8", content=_want('"runn?ing"').replace(b"?", b"\xff")),
    _file("utf16", "UTF-8", content=b"\xff\xfe" + VALID_TEXT.decode().encode("utf-16-le")),
    _file("fifo", "FIFO", kind="fifo"),
    _file("directory", "directory", kind="directory"),
    _file("symlink", "symlink", kind="symlink"),
]

# (name, content, expected generation, expected desired)
VALID: list[tuple[str, bytes, int, str]] = [
    (
        "generation-0",
        _doc('{"schemaVersion": 1, "generation": 0, "desired": "stopped"}'),
        0,
        "stopped",
    ),
    (
        "generation-1",
        _doc('{"schemaVersion": 1, "generation": 1, "desired": "running"}'),
        1,
        "running",
    ),
    (
        "generation-max",
        _doc(f'{{"schemaVersion": 1, "generation": {MAX_GENERATION}, "desired": "running"}}'),
        MAX_GENERATION,
        "running",
    ),
    ("stopped", _doc('{"schemaVersion": 1, "generation": 7, "desired": "stopped"}'), 7, "stopped"),
    ("compact", _doc('{"schemaVersion":1,"generation":3,"desired":"running"}'), 3, "running"),
    (
        "indented",
        _doc('{\n  "schemaVersion": 1,\n  "generation": 3,\n  "desired": "running"\n}\n'),
        3,
        "running",
    ),
    (
        "tabs-and-crlf",
        _doc(
            '{\r\n\t"schemaVersion" : 1 ,\r\n\t"generation" : 3 ,\r\n'
            '\t"desired" : "stopped"\r\n}\r\n'
        ),
        3,
        "stopped",
    ),
    (
        "surrounding-whitespace",
        _doc('\n\n   {"schemaVersion": 1, "generation": 42, "desired": "running"}   \n\n'),
        42,
        "running",
    ),
    (
        "other-key-order",
        _doc('{"desired": "stopped", "generation": 9, "schemaVersion": 1}'),
        9,
        "stopped",
    ),
    (
        "escaped-value",
        _doc('{"schemaVersion": 1, "generation": 5, "desired": "\\u0072unning"}'),
        5,
        "running",
    ),
    ("requested-by-operator", _at('"2026-11-30T17:14:35.239Z"'), 3, "stopped"),
    (
        "requested-by-gateway",
        _doc(
            '{"schemaVersion": 1, "generation": 4, "desired": "running", '
            '"requestedBy": "gateway", '
            '"requestedAt": "2026-11-30T18:14:35+01:00"}'
        ),
        4,
        "running",
    ),
    (
        "requested-null",
        _doc(
            '{"schemaVersion": 1, "generation": 5, "desired": "stopped", '
            '"requestedBy": null, "requestedAt": null}'
        ),
        5,
        "stopped",
    ),
]


def materialise(case: Case, path: Path, elsewhere: Path | None = None) -> Path:
    """Make path be this case, replacing whatever is there; returns path.

    Byte content is written with a rename, so a watcher never sees a half-written file. A symlink
    case points at a valid desired.json in `elsewhere` (default: a hidden file beside path).
    """
    tmp = path.with_name(f".{path.name}.corpus")
    _remove(tmp)
    if case.kind == "bytes":
        tmp.write_bytes(case.content)
    elif case.kind == "fifo":
        os.mkfifo(tmp, 0o640)
    elif case.kind == "directory":
        tmp.mkdir()
        (tmp / "desired.json").write_bytes(VALID_TEXT)
    elif case.kind == "symlink":
        target_dir = elsewhere if elsewhere is not None else path.parent
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / f".{path.name}.symlink-target"
        target.write_bytes(VALID_TEXT)
        tmp.symlink_to(target)
    else:  # pragma: no cover - a typo in a new case
        raise ValueError(f"unknown corpus kind {case.kind!r}")
    if (tmp.is_dir() and not tmp.is_symlink()) or (path.is_dir() and not path.is_symlink()):
        _remove(path)
    os.replace(tmp, path)
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
