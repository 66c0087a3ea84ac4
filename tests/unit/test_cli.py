"""The command line: status output, request --wait exit codes, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli
from supervisor.host import protocol as host
from supervisor.host import waiting
from supervisor.host.commands import engines as engine_commands
from supervisor.protocol import layout, reads
from supervisor.protocol.documents import DesiredFile, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.version import version

CLI = Path(sys.executable).with_name("lucia-supervisor")
URL = "http://172.17.0.1:8888"
ASKED = datetime(2026, 11, 30, 17, 14, 35, 239000, tzinfo=UTC)


def write_desired(
    data: Path, name: str, generation: int, desired: str = "running", **said: Any
) -> None:
    document = DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": generation, "desired": desired, **said}
    )
    write_atomic(ensure_dir(data / name) / layout.DESIRED, dump(document))


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
    write_atomic(ensure_dir(data / name) / layout.STATUS, dump(status))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "LUCIA_DATA_DIR"},
    )


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of the test's own: no units, recipes or data of this machine's user count."""
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "share"))
    monkeypatch.delenv("LUCIA_RECIPES_DIR", raising=False)
    monkeypatch.delenv("LUCIA_DATA_DIR", raising=False)
    return home


def install_unit(home: Path, name: str) -> Path:
    """What install.sh leaves for an engine: its unit file."""
    unit = home / "config" / "systemd" / "user" / f"lucia-{name}.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/bin/true\n")
    return unit


# --- status -------------------------------------------------------------------------------------


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    write_desired(data, "current", 2)
    write_status(data, "current", 2, "running", message="serving qwen")
    write_desired(data, "pending", 3, "stopped", requestedBy="operator", requestedAt=ASKED)
    write_status(data, "pending", 2, "running", message="serving still")
    write_desired(data, "stale", 1, requestedBy="gateway", requestedAt=ASKED)
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
    assert cli.main(["status", "--json", "--data-dir", str(engines)]) == 1  # one was refused
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
    assert (pending["requestedBy"], pending["requestedAt"]) == (
        "operator",
        "2026-11-30T17:14:35.239Z",
    )
    assert rows["stale"]["requestedBy"] == "gateway"
    # an older host's request names no requester: said as such, not guessed
    assert (current["requestedBy"], current["requestedAt"]) == (None, None)
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
    assert rows["unknown"]["message"].endswith("(systemctl --user start lucia-unknown)")
    assert rows["unknown"]["applied"] is None
    assert rows["refused"]["message"].startswith("request refused: desired:")


def test_status_text(engines: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--data-dir", str(engines)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "REQ", "BY", "APPLIED", "AGE", "URL", "MESSAGE"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_name) == ["current", "pending", "refused", "stale", "unknown"]
    assert by_name["current"].split()[1:5] == ["running", "2", "-", "2"]
    assert by_name["pending"].split()[3:6] == ["3", "operator", "2"]
    assert by_name["stale"].split()[2:5] == ["1", "gateway", "1"]
    assert URL in by_name["current"] and by_name["current"].endswith("serving qwen")
    assert "running (pending)" in by_name["pending"]
    assert "waiting for generation 3" in by_name["pending"]
    assert URL not in by_name["pending"]
    assert by_name["stale"].split()[1] == "stale"
    assert "worker unavailable" in by_name["stale"]
    assert URL not in by_name["stale"]
    assert by_name["unknown"].split()[1:6] == ["unknown", "1", "-", "-", "-"]
    # the columns line up: every row's STATE starts where the header's does
    column = lines[0].index("STATE")
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines)


def test_status_of_named_engines_only(engines: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--json", "--data-dir", str(engines), "stale"]) == 3
    assert list(rows_by_name(capsys.readouterr().out)) == ["stale"]


def test_status_of_an_empty_or_missing_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tmp_path / "absent"
    assert cli.main(["status", "--json", "--data-dir", str(absent)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == []  # stdout stays JSON; the note goes to stderr
    assert captured.err == f"no engines in {absent} (it does not exist)\n"
    empty = ensure_dir(tmp_path / "empty")
    ensure_dir(empty / "telemetry")
    assert cli.main(["status", "--data-dir", str(empty)]) == 0
    assert capsys.readouterr().out == f"no engines in {empty}\n"


STATUS_CODES = [
    ({"a": "current"}, 0),
    ({"a": "current", "b": "stopped"}, 0),
    ({"a": "current", "b": "stale"}, 3),
    ({"a": "current", "b": "pending"}, 3),
    ({"a": "current", "b": "no status"}, 3),
    ({"a": "current", "b": "failed"}, 1),
    ({"a": "failed", "b": "stale"}, 1),  # a failure outranks an unanswered engine
    ({"a": "current", "b": "refused"}, 1),
    ({"a": "current", "b": "answered failed long ago"}, 3),
]


def _engine_as(data: Path, name: str, kind: str) -> None:
    if kind == "current":
        write_desired(data, name, 2)
        write_status(data, name, 2, "running")
    elif kind == "stopped":
        write_desired(data, name, 2, "stopped")
        write_status(data, name, 2, "stopped")
    elif kind == "stale":
        write_desired(data, name, 2)
        write_status(data, name, 2, "running", age=timedelta(minutes=2))
    elif kind == "pending":
        write_desired(data, name, 3)
        write_status(data, name, 2, "running")
    elif kind == "no status":
        write_desired(data, name, 1)
    elif kind == "failed":
        write_desired(data, name, 2)
        write_status(data, name, 2, "failed", message="engine exited with code 137")
    elif kind == "refused":
        write_desired(data, name, 2)
        write_status(data, name, 2, "stopped", refused="desired: input should be 'running'")
    else:  # a failure that answered an older request is no answer to this one
        write_desired(data, name, 3)
        write_status(data, name, 2, "failed")


@pytest.mark.parametrize(("kinds", "code"), STATUS_CODES, ids=[str(k) for k, _ in STATUS_CODES])
def test_status_exit_code_is_a_health_check(
    kinds: dict[str, str], code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, kind in kinds.items():
        _engine_as(tmp_path, name, kind)
    assert cli.main(["status", "--data-dir", str(tmp_path)]) == code
    assert cli.main(["status", "--json", "--data-dir", str(tmp_path)]) == code
    assert cli.main(["status", "--json", "--data-dir", str(tmp_path), "a"]) == (
        1 if kinds["a"] == "failed" else 0
    )
    capsys.readouterr()


def test_status_of_a_named_engine_that_does_not_exist_is_unanswered(tmp_path: Path) -> None:
    _engine_as(tmp_path, "a", "current")
    run = run_cli("status", "--data-dir", str(tmp_path), "nam")
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout.splitlines()[1].split()[:2] == ["nam", "unknown"]


def test_status_json_says_which_worker_version_wrote_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_desired(tmp_path, "a", 1)
    write_status(tmp_path, "a", 1, "running", worker_version="0.1.0")
    write_desired(tmp_path, "old", 1)
    write_status(tmp_path, "old", 1, "running")  # a worker from before the field
    assert cli.main(["status", "--json", "--data-dir", str(tmp_path)]) == 0
    rows = rows_by_name(capsys.readouterr().out)
    assert (rows["a"]["workerVersion"], rows["old"]["workerVersion"]) == ("0.1.0", None)


def test_status_through_the_console_script_and_env(engines: Path) -> None:
    run = subprocess.run(
        [str(CLI), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "LUCIA_DATA_DIR": str(engines)},
    )
    assert run.returncode == 1, run.stderr  # "refused" failed
    rows = rows_by_name(run.stdout)
    assert [rows[n]["answer"] for n in ("current", "pending", "stale")] == [
        "current",
        "pending",
        "unavailable",
    ]


# --- request --wait -----------------------------------------------------------------------------


def start_request(data: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [str(CLI), "request", "tf", "running", "--wait", "--data-dir", str(data), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


def test_request_wait_exits_1_when_failed(tmp_path: Path, home: Path) -> None:
    install_unit(home, "tf")
    proc, generation = start_request(tmp_path, "--timeout", "60")
    assert generation == 1
    assert still_waiting(proc)
    write_status(tmp_path, "tf", generation, "failed", message="engine exited with code 137")
    code, _, err = finish(proc)
    assert code == 1
    assert "tf failed: engine exited with code 137" in err


def test_request_wait_waits_through_a_failure_the_worker_retries(
    tmp_path: Path, home: Path
) -> None:
    """A port or memory held for now: failed, retrying; the wait shows it and goes on."""
    install_unit(home, "tf")
    proc, generation = start_request(tmp_path, "--timeout", "60")
    held = "port 8000 is taken by another process; trying again in 5 s"
    write_status(tmp_path, "tf", generation, "failed", message=held, retrying=True)
    # off a terminal a progress line comes at most every LINE_EVERY seconds: wait for one
    assert still_waiting(proc, waiting.LINE_EVERY + 1), "gave up on a retried failure"
    write_status(tmp_path, "tf", generation, "running", message="serving")
    code, out, err = finish(proc)
    assert code == 0, err
    assert out.strip() == f"tf: running at {URL}"
    assert held in err  # shown while it waited


def test_request_wait_exits_3_on_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    run = run_cli(
        "request",
        "tf",
        "running",
        "--wait",
        "--timeout",
        "1",
        "--create",
        "--data-dir",
        str(tmp_path),
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip() == "1"
    assert "timed out after 1s" in run.stderr
    assert 1 <= elapsed < 15
    # the request is not withdrawn; the operator is told how to keep waiting
    assert "the request goes on: keep waiting with: " in run.stderr
    assert f"lucia-supervisor wait tf --state running --data-dir {tmp_path}\n" in run.stderr
    assert reads.read_desired(tmp_path / "tf") is not None


def test_request_wait_exits_3_at_once_when_the_worker_is_stale(tmp_path: Path) -> None:
    write_status(tmp_path, "tf", 1, "running", age=timedelta(seconds=61))
    started = time.monotonic()
    run = run_cli(
        "request", "tf", "running", "--wait", "--timeout", "15", "--data-dir", str(tmp_path)
    )
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip() == "2"
    assert "worker unavailable" in run.stderr
    assert time.monotonic() - started < 10  # did not sit out the timeout


def test_request_without_wait_returns_at_once(tmp_path: Path) -> None:
    recipes = ensure_dir(tmp_path / "recipes")
    (recipes / "tf.toml").write_text("# only its name counts here\n")
    run = run_cli(
        "request",
        "tf",
        "stopped",
        "--data-dir",
        str(tmp_path / "data"),
        "--recipes-dir",
        str(recipes),
    )
    assert (run.returncode, run.stdout) == (0, "1\n")


def test_a_request_from_the_command_line_is_an_operators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    before = utc_now() - timedelta(milliseconds=1)  # desired.json keeps milliseconds
    assert cli.main(["request", "tf", "stopped", "--create", "--data-dir", str(data)]) == 0
    written = reads.read_desired(data / "tf")
    assert written is not None and (written.desired, written.requested_by) == (
        "stopped",
        "operator",
    )
    assert written.requested_at is not None and before <= written.requested_at <= utc_now()
    assert written.operator_stop
    capsys.readouterr()
    cli.main(["status", "--json", "--data-dir", str(data)])
    (row,) = json.loads(capsys.readouterr().out)
    assert row["requestedBy"] == "operator" and row["requestedAt"].endswith("Z")


def test_the_default_timeout_outlasts_a_first_download() -> None:
    """125 GB at 100 Mbit/s takes 10 000 s; a stale worker still ends the wait in 60 s."""
    for argv in (["request", "tf", "running"], ["wait", "tf", "--state", "running"]):
        assert cli.build_parser().parse_args(argv).timeout >= 3 * 3600


# --- a misspelt or unknown engine ---------------------------------------------------------------


def test_a_name_with_no_recipe_unit_or_status_is_refused(tmp_path: Path, home: Path) -> None:
    data, recipes = tmp_path / "data", ensure_dir(tmp_path / "recipes")
    (recipes / "spark.toml").write_text("# a recipe\n")
    install_unit(home, "router")
    write_status(data, "old", 1, "stopped")
    for desired in ("running", "stopped"):
        run = run_cli(
            "request",
            "sprak",
            desired,
            "--wait",
            "--data-dir",
            str(data),
            "--recipes-dir",
            str(recipes),
        )
        assert run.returncode == 2, run.stderr
        assert run.stdout == ""
        [line] = run.stderr.splitlines()  # one line, with what to do
        assert line.startswith("lucia-supervisor: no engine named sprak: no recipe ")
        assert str(recipes / "sprak.toml") in line
        assert str(home / "config/systemd/user/lucia-sprak.service") in line
        assert "(engines here: old, router, spark)" in line
        assert "systemctl --user start lucia-sprak" in line and "--create" in line
    assert sorted(p.name for p in data.iterdir()) == ["old"]  # no stray directory
    shown = run_cli("status", "--data-dir", str(data))
    assert "sprak" not in shown.stdout


@pytest.mark.parametrize("known_by", ["recipe", "unit", "status", "--create"])
def test_a_known_name_or_create_is_requested(known_by: str, tmp_path: Path, home: Path) -> None:
    data, recipes = tmp_path / "data", ensure_dir(tmp_path / "recipes")
    extra = []
    if known_by == "recipe":
        (recipes / "tf.toml").write_text("# a recipe\n")
    elif known_by == "unit":
        install_unit(home, "tf")
    elif known_by == "status":
        write_status(data, "tf", 1, "stopped")
    else:
        extra = ["--create"]
    run = run_cli(
        "request", "tf", "running", "--data-dir", str(data), "--recipes-dir", str(recipes), *extra
    )
    assert run.returncode == 0, run.stderr
    assert reads.read_desired(data / "tf") is not None


def test_installed_recipes_make_a_name_known_without_any_option(tmp_path: Path, home: Path) -> None:
    installed = ensure_dir(home / "share" / "lucia" / "recipes")
    (installed / "mine.toml").write_text("# installed by install.sh\n")
    run = run_cli("request", "mine", "running", "--data-dir", str(tmp_path / "data"))
    assert run.returncode == 0, run.stderr


def test_waiting_for_a_worker_that_never_writes_fails_with_the_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker acknowledges at once; no status at all means no worker (60 s by default)."""
    generation = host.request(tmp_path, "tf", "running")
    code = waiting.await_state(
        tmp_path,
        "tf",
        generation,
        "running",
        3600.0,
        keep_waiting="lucia-supervisor wait tf --state running",
        no_status_after=0.0,
    )
    assert code == 3
    err = capsys.readouterr().err
    assert "tf: no worker has written a status in 0s; start it with: " in err
    assert "systemctl --user start lucia-tf" in err
    assert "then: lucia-supervisor wait tf --state running" in err


def test_a_stale_worker_is_named_with_the_hint(tmp_path: Path) -> None:
    write_status(tmp_path, "tf", 1, "running", age=timedelta(seconds=90))
    run = run_cli("request", "tf", "running", "--wait", "--data-dir", str(tmp_path))
    assert run.returncode == 3
    assert "systemctl --user start lucia-tf" in run.stderr


# --- --version ----------------------------------------------------------------------------------


def test_version_is_the_package_metadata() -> None:
    run = run_cli("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"lucia-supervisor {metadata.version('lucia-supervisor')}\n"
    assert version() == metadata.version("lucia-supervisor") != "unknown"


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


@pytest.mark.parametrize("since", ["999999w", "0001-01-01T00:00:00+05:00"])
def test_usage_since_out_of_range_exits_2_with_one_error_line(
    since: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: an OverflowError's traceback (argparse turns only a ValueError into exit 2)."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["usage", "--since", since, "--data-dir", str(tmp_path)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [
        f"lucia-supervisor usage: error: argument --since: --since {since!r}: out of range, "
        "before the year 1 or after 9999 (UTC)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_usage_since_out_of_range_of_the_console_script(tmp_path: Path) -> None:
    run = run_cli("usage", "--since", "999999w", "--data-dir", str(tmp_path))
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and "out of range" in run.stderr
    assert run.stdout == ""


def test_bad_usage_exit_code_of_the_console_script(tmp_path: Path) -> None:
    run = run_cli("request", "Bad/Name", "running", "--data-dir", str(tmp_path))
    assert run.returncode == 2
    assert "invalid engine name" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_status_lists_engines_not_the_shared_directories(tmp_path: Path) -> None:
    """telemetry/ (file_sd), memory/ (the memory plan's claims), the gateway's record/ and
    the issued keys' inference-keys/ are no engines."""
    for shared in ("telemetry", "memory", "record", "inference-keys"):
        (tmp_path / shared).mkdir()
    (tmp_path / "tf").mkdir()
    assert engine_commands.engine_names(tmp_path) == ["tf"]


def test_the_gateways_unit_names_no_engine(tmp_path: Path, home: Path) -> None:
    data, recipes = tmp_path / "data", ensure_dir(tmp_path / "recipes")
    install_unit(home, "gateway")
    install_unit(home, "router")
    assert engine_commands.known_engines(data, recipes) == {"router"}
    assert engine_commands.unknown_engine("router", data, recipes) is None
    refused = engine_commands.unknown_engine("gateway", data, recipes)
    assert "no engine named gateway" in (refused or "")
