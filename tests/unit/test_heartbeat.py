"""The heartbeat's failure policy, with writes that really fail (status.json's directory is a
file, so every write raises as a full disk's does): the last good file stays, and a failed
write is tried again a second later, never in a busy loop."""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import pytest

from supervisor import redaction
from supervisor.notify import Notifier
from supervisor.protocol.documents import (
    MemoryPlan,
    Reserves,
    TargetGroup,
    json_schemas,
    parse_status,
)
from supervisor.worker.heartbeat import Heartbeat
from supervisor.worker.plan import Answer
from supervisor.worker.telemetry import FileSdWriter, WorkerMetrics

TARGETS = (TargetGroup(targets=["172.21.0.1:8000"], labels={"name": "e"}),)


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    blocker = tmp_path / "engine"
    blocker.write_text("a file where the engine's directory should be\n")
    return blocker / "status.json"


def _heartbeat(status: Path, data: Path) -> Heartbeat:
    return Heartbeat(status, FileSdWriter(data, "e"), 15.0, Notifier(), WorkerMetrics("e"))


def test_a_failed_status_write_is_retried_a_second_later(unwritable: Path, tmp_path: Path) -> None:
    beat = _heartbeat(unwritable, tmp_path / "data")
    beat.show(Answer(1, "starting", "acknowledged: running requested"), None)
    assert 0.9 <= beat.due_in() <= 1.0  # not 0: the loop would spin on a full disk
    beat.tick()  # early: nothing is tried
    assert 0.8 <= beat.due_in() <= 1.0


def test_a_failed_file_sd_write_is_retried_a_second_later(tmp_path: Path) -> None:
    data = tmp_path / "data"
    beat = _heartbeat(tmp_path / "status.json", data)
    beat.show(Answer(1, "starting", "starting"), None)  # both written: the disk has room
    telemetry = beat.file_sd.path.parent
    shutil.rmtree(telemetry)
    telemetry.write_text("a file where the telemetry directory should be\n")
    beat.show(Answer(1, "running", "serving", "http://172.21.0.1:8000"), None, TARGETS)
    assert "Prometheus targets not written" in (tmp_path / "status.json").read_text()
    for _ in range(2):  # each retry, when it falls due, fails and waits a second again
        assert 0.9 <= beat.due_in() <= 1.0  # the targets wait, but not in a busy loop
        time.sleep(beat.due_in() + 0.05)
        beat.tick()


def test_status_json_names_the_worker_version_that_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    beat = _heartbeat(path, tmp_path / "data")
    beat.show(Answer(1, "starting", "acknowledged: running requested"), None)
    written = json.loads(path.read_text())
    assert written["workerVersion"] == metadata.version("lucia-supervisor")
    beat.progress("downloading 10%")  # every later write says it too
    time.sleep(beat.due_in() + 0.05)
    beat.tick()
    written = json.loads(path.read_text())
    assert (written["message"], written["workerVersion"]) == (
        "downloading 10%",
        metadata.version("lucia-supervisor"),
    )
    # readers keep it optional: a file from an older worker still reads, and the schema agrees
    del written["workerVersion"]
    assert parse_status(json.dumps(written)).worker_version is None
    schema = json_schemas()["status.schema.json"]
    assert "workerVersion" in schema["properties"]
    assert "workerVersion" not in schema.get("required", [])


def _plan(fits: bool, minute: int) -> MemoryPlan:
    return MemoryPlan(
        need=6 * 2**30,
        fits=fits,
        message="" if fits else "does not fit",
        limit=16 * 2**30,
        limit_source="host",
        reserves=Reserves(os=1, services=2, voice=3, runtime=4),
        planned_at=datetime(2026, 12, 2, 10, minute, tzinfo=UTC),
    )


def test_a_new_memory_verdict_is_written_at_once_the_same_one_with_the_heartbeat(
    tmp_path: Path,
) -> None:
    path = tmp_path / "status.json"
    beat = _heartbeat(path, tmp_path / "data")
    answer = Answer(1, "stopped", "stopped as requested")
    beat.memory_plan = _plan(True, 0)
    beat.show(answer, None)
    assert json.loads(path.read_text())["memory"]["plannedAt"] == "2026-12-02T10:00:00.000Z"
    beat.memory_plan = _plan(True, 1)  # the same verdict, planned again: it waits for the heartbeat
    beat.show(answer, None)
    assert json.loads(path.read_text())["memory"]["plannedAt"] == "2026-12-02T10:00:00.000Z"
    beat.memory_plan = _plan(False, 2)  # another engine took the memory: said at once
    beat.show(answer, None)
    written = json.loads(path.read_text())["memory"]
    assert (written["fits"], written["message"]) == (False, "does not fit")


def test_a_plan_message_is_masked_like_the_status_message(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    beat = _heartbeat(path, tmp_path / "data")
    redaction.register(["hf_plan_secret_value"])
    beat.memory_plan = _plan(False, 0).model_copy(
        update={"message": "cannot read /models/hf_plan_secret_value/x.gguf"}
    )
    beat.show(Answer(1, "stopped", "stopped as requested"), None)
    text = path.read_text()
    assert "hf_plan_secret_value" not in text
    assert json.loads(text)["memory"]["message"] == "cannot read /models/***/x.gguf"


def test_slots_are_written_at_once_while_running_and_never_otherwise(tmp_path: Path) -> None:
    """A router that published its model's slots once it ran: said in the same write as
    `running` when the observation saw them, at once when they change (a model loaded since),
    and not at all in any other state."""
    path = tmp_path / "status.json"
    beat = _heartbeat(path, tmp_path / "data")
    serving = Answer(1, "running", "serving", "http://172.21.0.1:8000")
    beat.slots = {"tiny": 1}
    beat.show(serving, None, TARGETS)
    assert json.loads(path.read_text())["slots"] == {"tiny": 1}
    beat.slots = {"tiny": 1, "other": 4}  # a model loaded on demand since
    beat.show(serving, None, TARGETS)
    assert json.loads(path.read_text())["slots"] == {"tiny": 1, "other": 4}
    beat.show(Answer(2, "stopping", "stopping the engine container"), None)
    assert json.loads(path.read_text())["slots"] == {}, "only while running"
