"""The contract: desired.json refusals, status.json round trips, messages, and schema drift."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import pytest
from pydantic import ValidationError

from supervisor.protocol import documents as protocol
from supervisor.protocol import files
from supervisor.protocol.documents import (
    MAX_GENERATION,
    MAX_MESSAGE,
    MAX_SLOTS,
    STATES,
    DesiredFile,
    FileSd,
    RunningEngine,
    Status,
    TargetGroup,
    clean_message,
    dump,
    parse_desired,
    parse_status,
)
from supervisor.protocol.files import FileRefused, read_text
from supervisor.protocol.strictjson import InvalidDocument
from supervisor.schemas import checked_in
from tests.corpus import INVALID, VALID, Case, materialise
from tests.support import within

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
CLI = Path(sys.executable).with_name("lucia-supervisor")
T = TypeVar("T")
VALID_IDS = [name for name, *_ in VALID]


# --- desired.json: the bad-input corpus ---------------------------------------------------------


def test_corpus_names_are_unique_and_cover_every_stage_and_kind() -> None:
    names = [case.name for case in INVALID] + [name for name, *_ in VALID]
    assert len(names) == len(set(names))
    assert {case.stage for case in INVALID} == {"file", "document"}
    assert {case.kind for case in INVALID} == {"bytes", "fifo", "directory", "symlink"}


@pytest.mark.parametrize("case", INVALID, ids=str)
def test_invalid_desired_is_refused_with_one_line_naming_the_problem(
    case: Case, tmp_path: Path
) -> None:
    path = materialise(case, tmp_path / "desired.json")

    def read_and_parse() -> DesiredFile:
        return parse_desired(read_text(path))

    expected = FileRefused if case.stage == "file" else InvalidDocument
    with pytest.raises(expected) as caught:
        within(5, read_and_parse)
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) < 300, message
    for needle in case.expect:
        assert needle in message, f"{needle!r} not in {message!r}"
    if case.stage == "file":
        assert str(path) in message


@pytest.mark.parametrize("case", [c for c in INVALID if c.stage == "document"], ids=str)
def test_invalid_desired_text_is_refused_by_parse_desired_alone(case: Case) -> None:
    with pytest.raises(InvalidDocument) as caught:
        parse_desired(case.content.decode("utf-8"))
    for needle in case.expect:
        assert needle in str(caught.value)


@pytest.mark.parametrize(("name", "content", "generation", "desired"), VALID, ids=VALID_IDS)
def test_valid_desired_parses(
    name: str, content: bytes, generation: int, desired: str, tmp_path: Path
) -> None:
    path = tmp_path / "desired.json"
    path.write_bytes(content)
    document = parse_desired(read_text(path))
    assert document.generation == generation
    assert document.desired == desired
    assert document.schema_version == protocol.SCHEMA_VERSION


def test_materialise_replaces_whatever_was_there(tmp_path: Path) -> None:
    path = tmp_path / "desired.json"
    by_name = {case.name: case for case in INVALID}
    for name in ["directory", "fifo", "symlink", "empty", "directory", "bom", "symlink"]:
        materialise(by_name[name], path)
        with pytest.raises((FileRefused, InvalidDocument)):
            within(5, lambda: parse_desired(read_text(path)))
    expected = {"desired.json", ".desired.json.symlink-target"}
    assert {p.name for p in tmp_path.iterdir()} - expected == set()


def test_symlink_case_points_at_a_valid_file_elsewhere(tmp_path: Path) -> None:
    case = next(c for c in INVALID if c.kind == "symlink")
    (tmp_path / "engine").mkdir()
    path = materialise(case, tmp_path / "engine" / "desired.json", elsewhere=tmp_path / "outside")
    assert path.is_symlink()
    assert path.resolve().parent == tmp_path / "outside"
    assert parse_desired(path.read_text()).generation == 3  # following it would have "worked"


def test_dump_of_desired_is_what_parse_desired_reads() -> None:
    document = DesiredFile(schema_version=1, generation=MAX_GENERATION, desired="stopped")
    text = dump(document).decode()
    assert json.loads(text) == {
        "schemaVersion": 1,
        "generation": MAX_GENERATION,
        "desired": "stopped",
    }
    assert parse_desired(text) == document


def test_who_asked_and_when_round_trip_in_utc() -> None:
    at = datetime(2026, 11, 30, 18, 14, 35, 239000, tzinfo=timezone(timedelta(hours=1)))
    document = DesiredFile.model_validate(
        {
            "schemaVersion": 1,
            "generation": 15,
            "desired": "stopped",
            "requestedBy": "operator",
            "requestedAt": at,
        }
    )
    text = dump(document).decode()
    assert json.loads(text) == {
        "schemaVersion": 1,
        "generation": 15,
        "desired": "stopped",
        "requestedBy": "operator",
        "requestedAt": "2026-11-30T17:14:35.239Z",
    }
    assert parse_desired(text) == document


@pytest.mark.parametrize(
    ("extra", "operator_stop"),
    [
        ("", True),  # an older host's stop: the reading that starts nothing
        (', "requestedBy": null', True),
        (', "requestedBy": "operator"', True),
        (', "requestedBy": "gateway"', False),  # an idle stop or a swap: the gateway's own
    ],
)
@pytest.mark.parametrize("desired", ["stopped", "running"])
def test_a_stop_the_gateway_did_not_write_is_an_operators(
    extra: str, operator_stop: bool, desired: str
) -> None:
    document = parse_desired(
        f'{{"schemaVersion": 1, "generation": 15, "desired": "{desired}"{extra}}}'
    )
    assert document.operator_stop is (operator_stop and desired == "stopped")


# --- status.json ----------------------------------------------------------------------------------

T0 = datetime(2024, 5, 1, 10, 0, 0, 123000, tzinfo=UTC)


def status(**changes: Any) -> Status:
    fields: dict[str, Any] = {
        "generation": 3,
        "state": "running",
        "since": T0,
        "message": "serving",
        "url": "http://172.17.0.1:8888",
        "checked_at": T0 + timedelta(seconds=12),
    }
    fields.update(changes)
    return Status(**fields)


@pytest.mark.parametrize(
    "value",
    [
        status(),
        status(state="starting", url=None, message="Adding structured output support"),
        status(state="failed", url=None, message="exit code 137", refused="desired: bad"),
        status(state="stopped", url=None, message="", generation=0),
        status(generation=MAX_GENERATION, message="x" * MAX_MESSAGE),
    ],
    ids=["running", "starting", "failed-refused", "stopped-gen0", "limits"],
)
def test_status_round_trips(value: Status) -> None:
    wire = dump(value)
    assert wire.endswith(b"\n")
    again = parse_status(wire.decode())
    assert again == value
    assert dump(again) == wire


def test_status_times_are_iso_utc_with_z() -> None:
    local = timezone(timedelta(hours=2))
    value = status(since=datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=local))
    wire = json.loads(dump(value))
    assert wire["since"] == "2024-05-01T10:00:00.123Z"
    assert wire["checkedAt"] == "2024-05-01T10:00:12.123Z"
    for key in ("since", "checkedAt"):
        assert wire[key].endswith("Z")
        assert datetime.fromisoformat(wire[key]).utcoffset() == timedelta(0)


def test_status_models_are_optional_and_kept_in_every_state() -> None:
    wire = json.loads(dump(status()))
    del wire["models"]  # a file from an older worker
    assert parse_status(json.dumps(wire)).models == ()
    wire.update(state="stopped", url=None, engine=None, models=["fast-1b", "deep-8b"])
    assert parse_status(json.dumps(wire)).models == ("fast-1b", "deep-8b")


@pytest.mark.parametrize(
    ("slots", "parsed"),
    [
        ({"tiny": 1}, {"tiny": 1}),
        ({"alpha": 4, "zeta": 2}, {"alpha": 4, "zeta": 2}),
        ({}, {}),  # not known yet
    ],
)
def test_status_slots_are_optional_and_name_each_model(
    slots: dict[str, int], parsed: dict[str, int]
) -> None:
    wire = json.loads(dump(status()))
    assert wire["slots"] == {}  # nothing published
    del wire["slots"]  # a file from an older worker
    assert parse_status(json.dumps(wire)).slots == {}
    wire["slots"] = slots
    assert parse_status(json.dumps(wire)).slots == parsed
    assert json.loads(dump(parse_status(json.dumps(wire))))["slots"] == slots


@pytest.mark.parametrize(
    "bad", [{"tiny": 0}, {"tiny": -1}, {"tiny": MAX_SLOTS + 1}, {"tiny": "many"}, ["tiny"], 4]
)
def test_status_slots_are_whole_numbers_of_at_least_one(bad: object) -> None:
    wire = json.loads(dump(status()))
    wire["slots"] = bad
    with pytest.raises(InvalidDocument, match="slots"):
        parse_status(json.dumps(wire))


def test_status_memory_plan_is_optional_and_camel_case() -> None:
    wire = json.loads(dump(status()))
    assert wire["memory"] is None  # before the first plan, and in files from older workers
    del wire["memory"]
    assert parse_status(json.dumps(wire)).memory is None
    wire["memory"] = {
        "need": 5 * 2**30,
        "fits": False,
        "message": "does not fit",
        "limit": 16 * 2**30,
        "limitSource": "host",
        "reserves": {"os": 1, "services": 2, "voice": 3, "runtime": 4},
        "plannedAt": "2026-12-02T10:00:00.000Z",
    }
    plan = parse_status(json.dumps(wire)).memory
    assert plan is not None
    assert (plan.need, plan.fits, plan.limit_source) == (5 * 2**30, False, "host")
    assert json.loads(dump(parse_status(json.dumps(wire))))["memory"] == wire["memory"]
    wire["memory"]["need"] = -1
    with pytest.raises(InvalidDocument, match="need"):
        parse_status(json.dumps(wire))


def test_status_keys_are_camel_case_on_the_wire() -> None:
    wire = json.loads(dump(status()))
    assert set(wire) == {
        "generation",
        "state",
        "since",
        "message",
        "url",
        "checkedAt",
        "refused",
        "engine",
        "retrying",
        "waitingFor",
        "models",
        "slots",
        "capabilities",
        "memory",
        "workerVersion",
    }
    text = dump(status()).decode()
    with pytest.raises(InvalidDocument, match="missing field 'checkedAt'"):
        parse_status(text.replace('"checkedAt"', '"lastSeen"'))


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ({}, {}),
        ({"a": []}, {"a": ()}),  # known to serve none of them
        ({"a": ["embedding"]}, {"a": ("embedding",)}),
        ({"a": ["responses", "chat", "completion"]}, {"a": ("chat", "completion", "responses")}),
        ({"a": ["chat", "chat"]}, {"a": ("chat",)}),
        ({"a": ["rerank", "embedding"]}, {"a": ("embedding",)}),  # a newer worker's name
        ({"a": ["chat", 3]}, {"a": ("chat",)}),
    ],
)
def test_status_capabilities_keep_the_known_names_in_one_order(
    given: dict[str, Any], read: dict[str, tuple[str, ...]]
) -> None:
    text = (
        dump(status())
        .decode()
        .replace('"capabilities": {}', json.dumps({"capabilities": given})[1:-1])
    )
    assert parse_status(text).capabilities == read


@pytest.mark.parametrize("given", ['"chat"', '{"a": "chat"}', '{"a": {"chat": true}}', "[]"])
def test_status_capabilities_of_another_shape_are_refused(given: str) -> None:
    text = dump(status()).decode().replace('"capabilities": {}', f'"capabilities": {given}')
    with pytest.raises(InvalidDocument, match="capabilities"):
        parse_status(text)


def test_status_capabilities_are_absent_from_older_workers_files() -> None:
    wire = json.loads(dump(status()))
    del wire["capabilities"]
    assert parse_status(json.dumps(wire)).capabilities == {}


@pytest.mark.parametrize("state", [s for s in STATES if s != "failed"])
def test_status_retrying_only_while_failed(state: str) -> None:
    with pytest.raises(ValidationError, match="retrying must be false"):
        status(state=state, url=None, engine=None, retrying=True)
    assert status(state="failed", url=None, engine=None, retrying=True).retrying


def test_status_waits_for_memory_only_while_retrying() -> None:
    with pytest.raises(ValidationError, match="waitingFor must be null unless retrying"):
        status(state="failed", url=None, engine=None, waiting_for="memory")
    waiting = status(state="failed", url=None, engine=None, retrying=True, waiting_for="memory")
    assert json.loads(dump(waiting))["waitingFor"] == "memory"
    wire = json.loads(dump(waiting))
    del wire["waitingFor"]  # a file from an older worker
    assert parse_status(json.dumps(wire)).waiting_for is None


@pytest.mark.parametrize("state", [s for s in STATES if s != "running"])
def test_status_url_must_be_null_unless_running(state: str) -> None:
    with pytest.raises(ValidationError, match="url must be null"):
        status(state=state)
    assert status(state=state, url=None).url is None
    wire = dump(status()).decode().replace('"running"', f'"{state}"')
    with pytest.raises(InvalidDocument, match="url must be null") as caught:
        parse_status(wire)
    assert "\n" not in str(caught.value)


def test_status_extra_fields_are_tolerated_on_read() -> None:
    wire = json.loads(dump(status()))
    wire["engineVersion"] = "0.6.6"
    wire["progress"] = {"done": 1, "of": 2}
    parsed = parse_status(json.dumps(wire))
    assert parsed == status()
    assert "engineVersion" not in json.loads(dump(parsed))


def test_status_message_is_at_most_500() -> None:
    assert len(status(message="m" * MAX_MESSAGE).message) == MAX_MESSAGE
    with pytest.raises(ValidationError):
        status(message="m" * (MAX_MESSAGE + 1))
    wire = json.loads(dump(status()))
    wire["message"] = "m" * (MAX_MESSAGE + 1)
    with pytest.raises(InvalidDocument, match="message"):
        parse_status(json.dumps(wire))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"since": "2024-05-01T10:00:00"}, "since"),  # naive: no zone
        ({"state": "paused"}, "state"),
        ({"generation": -1}, "generation"),
        ({"generation": MAX_GENERATION + 1}, "generation"),
    ],
)
def test_status_refuses_broken_fields(change: dict[str, Any], needle: str) -> None:
    wire = json.loads(dump(status(url=None, state="stopped")))
    wire.update(change)
    with pytest.raises(InvalidDocument, match=needle) as caught:
        parse_status(json.dumps(wire))
    assert "\n" not in str(caught.value)


def test_status_refuses_what_lenient_json_accepts() -> None:
    text = dump(status()).decode()
    with pytest.raises(InvalidDocument, match="duplicate key"):
        parse_status(text.replace('"generation": 3', '"generation": 3, "generation": 4'))
    with pytest.raises(InvalidDocument, match="byte-order mark"):
        parse_status("\ufeff" + text)
    with pytest.raises(InvalidDocument, match="not valid JSON"):
        parse_status(text[:-5])


# --- clean_message ------------------------------------------------------------------------------

CLEAN = [
    ("plain", "Downloading model", "Downloading model"),
    ("ansi-colour", "\x1b[1;31merror:\x1b[0m image not found", "error: image not found"),
    ("ansi-256-colour", "\x1b[38;5;208mwarn\x1b[39m", "warn"),
    ("ansi-cursor", "\x1b[2K\x1b[1Gstep 3/9", "step 3/9"),
    ("osc-title-bel", "\x1b]0;docker build\x07Step 1/4", "Step 1/4"),
    (
        "osc-hyperlink-st",
        "see \x1b]8;;https://x.invalid\x1b\\docs\x1b]8;;\x1b\\ now",
        "see docs now",
    ),
    (
        "carriage-return-progress",
        "Downloading  10%\rDownloading  55%\rDownloading 100%",
        "Downloading 100%",
    ),
    (
        "progress-with-erase",
        "\r 10%|#   |\x1b[K\r 55%|##  |\x1b[K\r 99%|### |\x1b[K\r",
        "99%|### |",
    ),
    ("progress-then-newline", "fetch 1%\rfetch 2%\nbuilding", "fetch 2% building"),
    ("crlf", "first\r\nsecond\r\n", "first second"),
    ("control-characters", "a\x00b\x07c\x08d\x7fe\x9bf", "abcdef"),
    ("tab", "\tindented", "indented"),
    (
        "multi-line",
        "Traceback:\n  File x\n\n    raise\nValueError: bad\n",
        "Traceback: File x raise ValueError: bad",
    ),
    ("only-noise", "\n\r\n\x1b[0m\r  \n", ""),
    ("empty", "", ""),
    ("unicode-kept", "Qwen3.8 — ready ✓", "Qwen3.8 — ready ✓"),
]


@pytest.mark.parametrize(("raw", "clean"), [c[1:] for c in CLEAN], ids=[c[0] for c in CLEAN])
def test_clean_message(raw: str, clean: str) -> None:
    assert clean_message(raw) == clean


@pytest.mark.parametrize("length", [MAX_MESSAGE + 1, 600, 100_000])
def test_clean_message_truncates_with_an_ellipsis(length: int) -> None:
    cleaned = clean_message("é" * length)
    assert len(cleaned) == MAX_MESSAGE
    assert cleaned == "é" * (MAX_MESSAGE - 1) + "…"
    status(message=cleaned)  # always fits the status


def test_clean_message_keeps_exactly_500() -> None:
    assert clean_message("x" * MAX_MESSAGE) == "x" * MAX_MESSAGE


def test_clean_message_measures_after_cleaning() -> None:
    raw = "\x1b[32m" + "y" * MAX_MESSAGE + "\x1b[0m"
    assert clean_message(raw) == "y" * MAX_MESSAGE


# --- schemas ------------------------------------------------------------------------------------


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def test_checked_in_schemas_match_the_models() -> None:
    generated = checked_in()
    assert sorted(p.name for p in SCHEMAS.iterdir()) == sorted(generated)
    for name, schema in generated.items():
        text = (SCHEMAS / name).read_text()
        assert json.loads(text) == schema, f"schemas/{name} drifted: run lucia-supervisor schemas"
        assert text == render(schema), f"schemas/{name} is not in the generated form"


def test_schemas_command_writes_the_checked_in_files(tmp_path: Path) -> None:
    out = tmp_path / "out" / "schemas"
    run = subprocess.run(
        [str(CLI), "schemas", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in SCHEMAS.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (SCHEMAS / path.name).read_bytes()
        assert path.stat().st_mode & 0o777 == 0o644
        assert str(path) in run.stdout


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


@pytest.mark.parametrize(("name", "content", "generation", "desired"), VALID, ids=VALID_IDS)
def test_valid_documents_match_the_desired_schema(
    name: str, content: bytes, generation: int, desired: str
) -> None:
    jsonschema.Draft202012Validator(schema("desired.schema.json")).validate(json.loads(content))


SCHEMA_REJECTS = [
    "unknown-field",
    "missing-generation",
    "missing-desired",
    "missing-schema-version",
    "generation-string",
    "generation-negative",
    "generation-bool",
    "generation-2**53",
    "desired-paused",
    "desired-number",
    "schema-version-2",
    "schema-version-string",
    "schema-version-bool",
    "snake-case-field",
    "snake-case-extra",
    "list",
    "null",
    "requested-by-root",
    "requested-by-number",
    "requested-at-timestamp",
    "requested-at-number",
    "requested-at-date-only",
    "requested-at-no-zone",
    "requested-at-space",
]


@pytest.mark.parametrize("name", SCHEMA_REJECTS)
def test_invalid_documents_fail_the_desired_schema(name: str) -> None:
    case = next(c for c in INVALID if c.name == name)
    validator = jsonschema.Draft202012Validator(schema("desired.schema.json"))
    assert not validator.is_valid(json.loads(case.content))


def test_dumped_status_and_file_sd_match_their_schemas() -> None:
    status_schema = jsonschema.Draft202012Validator(schema("status.schema.json"))
    for value in (status(), status(state="failed", url=None, refused="bad request")):
        status_schema.validate(json.loads(dump(value)))
    assert not status_schema.is_valid({**json.loads(dump(status())), "generation": -1})
    file_sd = FileSd([TargetGroup(targets=["172.17.0.1:8888"], labels={"engine": "tf"})])
    sd_schema = jsonschema.Draft202012Validator(schema("file_sd.schema.json"))
    sd_schema.validate(json.loads(dump(file_sd)))
    sd_schema.validate([])
    assert not sd_schema.is_valid([{"targets": ["x"], "extra": 1}])


def test_file_module_limit_is_the_one_the_corpus_assumes() -> None:
    assert files.MAX_READ == 64 * 1024


def test_status_names_what_runs_only_while_running() -> None:
    engine = RunningEngine(
        image="tf:1-grammar",
        image_id="sha256:" + "a" * 64,
        container_id="c" * 64,
        recipe_commit="0" * 40,
        model="qwen",
        model_revision=None,
    )
    wire = json.loads(dump(status(engine=engine)))
    assert wire["engine"] == {
        "image": "tf:1-grammar",
        "imageId": "sha256:" + "a" * 64,
        "containerId": "c" * 64,
        "recipeCommit": "0" * 40,
        "model": "qwen",
        "modelRevision": None,
        "engineVersion": None,
    }
    assert parse_status(json.dumps(wire)).engine == engine
    with pytest.raises(ValueError, match="engine must be null"):
        status(state="stopped", url=None, engine=engine)
