"""The command line: status output, request --wait exit codes, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli
from supervisor.protocol import host
from supervisor.protocol.documents import DesiredFile, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic

CLI = Path(sys.executable).with_name("lucia-supervisor")
URL = "http://172.17.0.1:8888"


def write_desired(data: Path, name: str, generation: int, desired: str = "running") -> None:
    document = DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": generation, "desired": desired}
    )
    write_atomic(ensure_dir(data / name) / host.DESIRED, dump(document))


def write_status(
    data: Path,
    name: str,
    generation: int,
    state: str,
    *,
    message: str = "",
    age: timedelta = timedelta(0),
    **extra: Any,
) -> None:
    now = utc_now()
    status = Status(
        generation=generation,
        state=state,  # type: ignore[arg-type]
        since=now - age - timedelta(minutes=5),
        message=message or f"{state} now",
        url=URL if state == "running" else None,
        checked_at=now - age,
        **extra,
    )
    write_atomic(ensure_dir(data / name) / host.STATUS, dump(status))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=timeout, check=False,
        env={k: v for k, v in os.environ.items() if k != "LUCIA_DATA_DIR"},
    )


# --- status -------------------------------------------------------------------------------------


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    write_desired(data, "current", 2)
    write_status(data, "current", 2, "running", message="serving qwen")
    write_desired(data, "pending", 3, "stopped")
    write_status(data, "pending", 2, "running", message="serving still")
    write_desired(data, "stale", 1)
    write_status(data, "stale", 1, "running", message="was serving", age=timedelta(minutes=5))
    write_desired(data, "unknown", 1)
    write_desired(data, "refused", 4)
    write_status(data, "refused", 4, "stopped", refused="desired: input should be 'running'")
    ensure_dir(data / "telemetry")
    ensure_dir(data / ".hidden")
    return data


def rows_by_name(output: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in json.loads(output)}


def test_status_json(engines: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--json", "--data-dir", str(engines)]) == 0
    rows = rows_by_name(capsys.readouterr().out)
    assert sorted(rows) == ["current", "pending", "refused", "stale", "unknown"]

    current = rows["current"]
    assert current["state"] == "running"
    assert current["answer"] == "current"
    assert (current["requested"], current["applied"]) == (2, 2)
    assert current["url"] == URL
    assert current["message"] == "serving qwen"
    assert 0 <= current["heartbeatAge"] < 30

    pending = rows["pending"]
    assert pending["state"] == "running (pending)"
    assert pending["answer"] == "pending"
    assert (pending["requested"], pending["applied"], pending["desired"]) == (3, 2, "stopped")
    assert pending["url"] is None
    assert "waiting for generation 3" in pending["message"]

    stale = rows["stale"]
    assert stale["state"] == "stale"
    assert stale["answer"] == "unavailable"
    assert stale["url"] is None
    assert 299 <= stale["heartbeatAge"] < 330
    assert "worker unavailable" in stale["message"]
    assert "last said: running: was serving" in stale["message"]

    assert rows["unknown"]["state"] == "unknown"
    assert rows["unknown"]["applied"] is None
    assert rows["refused"]["message"].startswith("request refused: desired:")


def test_status_text(engines: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--data-dir", str(engines)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "REQ", "APPLIED", "AGE", "URL", "MESSAGE"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_name) == ["current", "pending", "refused", "stale", "unknown"]
    assert by_name["current"].split()[1:4] == ["running", "2", "2"]
    assert URL in by_name["current"] and by_name["current"].endswith("serving qwen")
    assert "running (pending)" in by_name["pending"]
    assert "waiting for generation 3" in by_name["pending"]
    assert URL not in by_name["pending"]
    assert by_name["stale"].split()[1] == "stale"
    assert "worker unavailable" in by_name["stale"]
    assert URL not in by_name["stale"]
    assert by_name["unknown"].split()[1:5] == ["unknown", "1", "-", "-"]
    # the columns line up: every row's STATE starts where the header's does
    column = lines[0].index("STATE")
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines)


def test_status_of_named_engines_only(engines: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--json", "--data-dir", str(engines), "stale"]) == 0
    assert list(rows_by_name(capsys.readouterr().out)) == ["stale"]


def test_status_of_an_empty_or_missing_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "--json", "--data-dir", str(tmp_path / "absent")]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_status_through_the_console_script_and_env(engines: Path) -> None:
    run = subprocess.run(
        [str(CLI), "status", "--json"], capture_output=True, text=True, timeout=60,
        check=False, env={**os.environ, "LUCIA_DATA_DIR": str(engines)},
    )
    assert run.returncode == 0, run.stderr
    rows = rows_by_name(run.stdout)
    assert [rows[n]["answer"] for n in ("current", "pending", "stale")] == [
        "current", "pending", "unavailable"
    ]


# --- request --wait -----------------------------------------------------------------------------


def start_request(data: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [str(CLI), "request", "tf", "running", "--wait", "--data-dir", str(data), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "LUCIA_DATA_DIR"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), (line, proc.stderr.read() if proc.stderr else "")
    return proc, int(line)


def still_waiting(proc: subprocess.Popen[str], seconds: float = 0.5) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def test_request_wait_exits_0_when_the_answer_arrives(tmp_path: Path) -> None:
    write_status(tmp_path, "tf", 4, "stopped")  # fresh, but an answer to an older request
    proc, generation = start_request(tmp_path, "--timeout", "60")
    assert generation == 5
    assert still_waiting(proc), "exited on a status for another generation"
    write_status(tmp_path, "tf", generation, "starting", message="Adding structured output")
    assert still_waiting(proc), "exited before the wanted state"
    write_status(tmp_path, "tf", generation, "running", message="serving")
    code, out, err = finish(proc)
    assert code == 0, err
    assert out.strip() == f"tf: running at {URL}"


def test_request_wait_exits_1_when_failed(tmp_path: Path) -> None:
    proc, generation = start_request(tmp_path, "--timeout", "60")
    assert generation == 1
    assert still_waiting(proc)
    write_status(tmp_path, "tf", generation, "failed", message="engine exited with code 137")
    code, _, err = finish(proc)
    assert code == 1
    assert "tf failed: engine exited with code 137" in err


def test_request_wait_exits_3_on_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_cli("request", "tf", "running", "--wait", "--timeout", "1",
                  "--data-dir", str(tmp_path))
    elapsed = time.monotonic() - started
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip() == "1"
    assert "timed out after 1s" in run.stderr
    assert 1 <= elapsed < 15


def test_request_wait_exits_3_at_once_when_the_worker_is_stale(tmp_path: Path) -> None:
    write_status(tmp_path, "tf", 1, "running", age=timedelta(seconds=61))
    started = time.monotonic()
    run = run_cli("request", "tf", "running", "--wait", "--timeout", "15",
                  "--data-dir", str(tmp_path))
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip() == "2"
    assert "worker unavailable" in run.stderr
    assert time.monotonic() - started < 10  # did not sit out the timeout


def test_request_without_wait_returns_at_once(tmp_path: Path) -> None:
    run = run_cli("request", "tf", "stopped", "--data-dir", str(tmp_path))
    assert (run.returncode, run.stdout) == (0, "1\n")


def test_wait_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = str(tmp_path)
    assert cli.main(["wait", "tf", "--state", "running", "--timeout", "5", "--data-dir", data]) == 3
    assert "no valid request" in capsys.readouterr().err
    write_desired(tmp_path, "tf", 7, "stopped")
    write_status(tmp_path, "tf", 7, "stopped")
    assert cli.main(["wait", "tf", "--state", "stopped", "--timeout", "5", "--data-dir", data]) == 0
    assert capsys.readouterr().out.strip() == "tf: stopped"


# --- usage --------------------------------------------------------------------------------------

BAD_USAGE = [
    [],
    ["frobnicate"],
    ["request"],
    ["request", "tf"],
    ["request", "tf", "paused"],
    ["request", "Bad/Name", "running"],
    ["request", "../x", "running"],
    ["request", "tf", "running", "--timeout", "0"],
    ["request", "tf", "running", "--timeout", "-1"],
    ["request", "tf", "running", "--timeout", "soon"],
    ["request", "tf", "running", "--timeout", "nan"],
    ["status", "UPPER"],
    ["wait", "tf"],
    ["wait", "tf", "--state", "paused"],
    ["schemas"],
]


@pytest.mark.parametrize("argv", BAD_USAGE, ids=[" ".join(a) or "nothing" for a in BAD_USAGE])
def test_bad_usage_exits_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main([*argv, "--data-dir", str(tmp_path)] if argv and argv[0] != "schemas" else argv)
    assert caught.value.code == 2
    assert "usage:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_usage_exit_code_of_the_console_script(tmp_path: Path) -> None:
    run = run_cli("request", "Bad/Name", "running", "--data-dir", str(tmp_path))
    assert run.returncode == 2
    assert "invalid engine name" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_status_lists_engines_not_the_shared_directories(tmp_path: Path) -> None:
    """telemetry/ (file_sd) and memory/ (the memory plan's claims) are no engines."""
    for shared in ("telemetry", "memory"):
        (tmp_path / shared).mkdir()
    (tmp_path / "tf").mkdir()
    assert cli._engine_names(tmp_path) == ["tf"]
