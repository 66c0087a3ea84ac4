"""The host side: classifying a status against a request, and issuing generations."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from supervisor.host.protocol import (
    STALE_AFTER,
    Superseded,
    classify,
    read_status,
    request,
)
from supervisor.protocol import layout, reads
from supervisor.protocol.documents import DesiredFile, Status, dump, parse_desired, utc_now
from supervisor.protocol.files import read_text, write_atomic
from supervisor.protocol.layout import BadName

CLI = Path(sys.executable).with_name("lucia-supervisor")
NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def heartbeat(generation: int, age: timedelta, state: str = "running") -> Status:
    return Status(
        generation=generation,
        state=state,  # type: ignore[arg-type]
        since=NOW - timedelta(hours=1),
        message=f"{state} for generation {generation}",
        url="http://172.17.0.1:8888" if state == "running" else None,
        checked_at=NOW - age,
    )


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


# --- classify -----------------------------------------------------------------------------------

CLASSIFY = [
    ("no-status", None, 3, "unavailable", "no status yet"),
    ("fresh-same", (3, timedelta(0)), 3, "current", "running for generation 3"),
    ("fresh-same-59s", (3, timedelta(seconds=59)), 3, "current", "running for generation 3"),
    ("exactly-60s-not-stale", (3, timedelta(seconds=60)), 3, "current", "running"),
    ("fresh-older", (2, timedelta(seconds=5)), 3, "pending", "waiting for generation 3"),
    ("fresh-newer", (4, timedelta(seconds=5)), 3, "pending", "the worker answers 4"),
    ("exactly-60s-other", (2, timedelta(seconds=60)), 3, "pending", "waiting"),
    ("stale-61s", (3, timedelta(seconds=61)), 3, "unavailable", "last heartbeat 61s ago"),
    (
        "stale-60.001s",
        (3, timedelta(seconds=60, milliseconds=1)),
        3,
        "unavailable",
        "worker unavailable",
    ),
    ("stale-beats-pending", (2, timedelta(minutes=10)), 3, "unavailable", "600s ago"),
    ("future-heartbeat", (3, timedelta(seconds=-5)), 3, "current", "running"),
]


@pytest.mark.parametrize(
    ("given", "generation", "answer", "reason"),
    [c[1:] for c in CLASSIFY],
    ids=[c[0] for c in CLASSIFY],
)
def test_classify(
    given: tuple[int, timedelta] | None, generation: int, answer: str, reason: str
) -> None:
    status = heartbeat(*given) if given else None
    reading = classify(status, generation, NOW)
    assert reading.answer == answer
    assert reason in reading.reason
    assert reading.status == status
    assert "\n" not in reading.reason


def test_stale_after_is_sixty_seconds() -> None:
    assert timedelta(seconds=60) == STALE_AFTER


def test_read_status_reads_the_file_and_takes_time_as_a_parameter(tmp_path: Path) -> None:
    directory = tmp_path / "tf"
    directory.mkdir()
    write_atomic(directory / layout.STATUS, dump(heartbeat(5, timedelta(0))))
    assert read_status(tmp_path, "tf", 5, now=NOW).answer == "current"
    assert read_status(tmp_path, "tf", 6, now=NOW).answer == "pending"
    assert read_status(tmp_path, "tf", 5, now=NOW + timedelta(seconds=61)).answer == "unavailable"
    (directory / layout.STATUS).write_text("{not json")
    assert read_status(tmp_path, "tf", 5, now=NOW).answer == "unavailable"
    assert read_status(tmp_path, "other", 1, now=NOW).answer == "unavailable"


# --- request ------------------------------------------------------------------------------------


def desired_at(data_dir: Path, name: str = "tf") -> tuple[int, str]:
    document = parse_desired(read_text(data_dir / name / layout.DESIRED))
    return document.generation, document.desired


def test_first_request_is_one_and_requests_increment(tmp_path: Path) -> None:
    assert request(tmp_path, "tf", "running") == 1
    assert desired_at(tmp_path) == (1, "running")
    assert request(tmp_path, "tf", "stopped") == 2
    assert desired_at(tmp_path) == (2, "stopped")
    assert request(tmp_path, "tf", "stopped") == 3
    assert request(tmp_path, "other", "running") == 1  # counters are per engine
    assert desired_at(tmp_path) == (3, "stopped")


def test_each_request_says_who_asked_and_when(tmp_path: Path) -> None:
    before = utc_now() - timedelta(milliseconds=1)  # desired.json keeps milliseconds
    request(tmp_path, "tf", "running", "gateway")
    first = reads.read_desired(tmp_path / "tf")
    assert first is not None and first.requested_by == "gateway"
    request(tmp_path, "tf", "stopped")  # an operator's, unless said otherwise
    second = reads.read_desired(tmp_path / "tf")
    assert second is not None and (second.requested_by, second.desired) == ("operator", "stopped")
    assert first.requested_at is not None and second.requested_at is not None
    assert before <= first.requested_at <= second.requested_at <= utc_now()
    assert second.operator_stop


def test_a_conditional_request_never_overwrites_one_made_since(tmp_path: Path) -> None:
    """The gateway writes on what it read: an operator's stop made in between stands."""
    request(tmp_path, "tf", "stopped", "gateway")
    seen = reads.read_desired(tmp_path / "tf")
    request(tmp_path, "tf", "stopped")  # the operator, between the gateway's look and write
    with pytest.raises(Superseded) as refused:
        request(tmp_path, "tf", "running", "gateway", only_if=lambda now: now == seen)
    current = reads.read_desired(tmp_path / "tf")
    assert refused.value.current == current
    assert current is not None and (current.generation, current.desired) == (2, "stopped")
    assert "generation 2 (stopped)" in str(refused.value)
    assert request(tmp_path, "tf", "running", "gateway", only_if=lambda now: now == current) == 3


def test_no_request_on_file_is_a_condition_too(tmp_path: Path) -> None:
    def nothing_yet(current: DesiredFile | None) -> bool:
        return current is None

    assert request(tmp_path, "tf", "running", "gateway", only_if=nothing_yet) == 1
    with pytest.raises(Superseded):
        request(tmp_path, "tf", "running", "gateway", only_if=nothing_yet)
    assert desired_at(tmp_path) == (1, "running")


def test_request_writes_mode_0640_and_no_temp_files(tmp_path: Path) -> None:
    os.umask(0o077)
    request(tmp_path, "tf", "running")
    os.umask(0)
    request(tmp_path, "tf", "running")
    path = tmp_path / "tf" / layout.DESIRED
    assert path.stat().st_mode & 0o7777 == 0o640
    assert not [p for p in (tmp_path / "tf").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("desired", "status_generation", "expected"),
    [
        (None, 7, 8),  # desired.json lost
        (b"{not json", 7, 8),  # desired.json broken
        (b'{"schemaVersion": 1, "generation": 9, "desired": "paused"}', 7, 8),  # invalid
        (b'{"schemaVersion": 1, "generation": 2, "desired": "running"}', 7, 8),  # hand-edited down
        (b'{"schemaVersion": 1, "generation": 10, "desired": "running"}', 4, 11),
        (None, None, 1),
        (b"", None, 1),
    ],
    ids=["missing", "broken", "invalid", "behind-status", "ahead-of-status", "fresh", "empty"],
)
def test_request_goes_above_both_request_and_status(
    tmp_path: Path, desired: bytes | None, status_generation: int | None, expected: int
) -> None:
    directory = tmp_path / "tf"
    directory.mkdir()
    if desired is not None:
        (directory / layout.DESIRED).write_bytes(desired)
    if status_generation is not None:
        write_atomic(directory / layout.STATUS, dump(heartbeat(status_generation, timedelta(0))))
    assert request(tmp_path, "tf", "running") == expected
    assert desired_at(tmp_path) == (expected, "running")
    answer = classify(reads.load_status(directory), expected, NOW).answer
    assert answer in {"pending", "unavailable"}


def test_a_restored_older_request_never_makes_a_generation_reused(tmp_path: Path) -> None:
    """An older desired.json put back by hand (and answered by the worker, which applies what
    the file says) does not make the host issue 39 a second time."""
    for _ in range(41):
        request(tmp_path, "tf", "running")
    directory = tmp_path / "tf"
    (directory / layout.DESIRED).write_bytes(
        b'{"schemaVersion": 1, "generation": 38, "desired": "stopped"}'
    )
    write_atomic(directory / layout.STATUS, dump(heartbeat(38, timedelta(0), "stopped")))
    assert request(tmp_path, "tf", "running") == 42
    (directory / ".generation").write_text("not a number\n")  # damaged: the files still count
    assert request(tmp_path, "tf", "running") == 43


def test_request_replaces_a_symlinked_desired(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text('{"schemaVersion": 1, "generation": 50, "desired": "running"}')
    (tmp_path / "tf").mkdir()
    (tmp_path / "tf" / layout.DESIRED).symlink_to(outside)
    assert request(tmp_path, "tf", "stopped") == 1
    assert not (tmp_path / "tf" / layout.DESIRED).is_symlink()
    assert outside.read_text().startswith('{"schemaVersion": 1, "generation": 50')


BAD_NAMES = [
    "",
    "TF",
    "tf/x",
    "../etc",
    "..",
    ".",
    ".hidden",
    "-flag",
    "_x",
    "a..b",
    "a b",
    "tf\n",
    "é",
    "a" * 64,
    "tf\x00",
    "tf/",
    "/abs",
    "telemetry",
    "memory",
]
GOOD_NAMES = ["a", "0", "tf", "qwen3.8-flash", "llama_router", "a" * 63, "x.y-z_0"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    data = tmp_path / "data"
    with pytest.raises(BadName, match="invalid engine name"):
        request(data, name, "running")
    with pytest.raises(BadName):
        layout.engine_dir(data, name)
    assert not data.exists()


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_are_accepted(tmp_path: Path, name: str) -> None:
    assert request(tmp_path, name, "running") == 1
    assert (tmp_path / name / layout.DESIRED).is_file()


def test_twenty_concurrent_requesters_get_distinct_generations(tmp_path: Path) -> None:
    """The required proof: real processes racing on one desired.json never share a generation."""
    assert CLI.exists(), CLI
    env = {k: v for k, v in os.environ.items() if k != "LUCIA_DATA_DIR"}
    procs = [
        subprocess.Popen(
            [str(CLI), "request", "tf", "running", "--create", "--data-dir", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(20)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    generations = sorted(int(out.strip()) for out, _ in outputs)
    assert generations == list(range(1, 21))
    assert desired_at(tmp_path) == (20, "running")
