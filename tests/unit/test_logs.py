"""Log lines: one line per event, a syslog priority under journald, key=value elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

SCRIPT = """
import os, sys
mode = sys.argv[1]
if mode == "journal":
    info = os.fstat(sys.stderr.fileno())
    os.environ["JOURNAL_STREAM"] = f"{info.st_dev}:{info.st_ino}"
elif mode == "other-journal":
    os.environ["JOURNAL_STREAM"] = "1:1"  # journald, but connected to another stream
else:
    os.environ.pop("JOURNAL_STREAM", None)

from supervisor import logs
logs.configure()
log = logs.get("test")
log.debug("not shown", detail=1)
log.info("engine started", engine="tf", generation=3)
log.warning("heartbeat slow", seconds=61.5, note="took a while", quote='say "hi"')
log.error("build failed", output="step 1\\nstep 2\\r\\nerror: no space left", code=137)
log.warning("request refused", error=ValueError("2 errors\\ngeneration: bad\\ndesired: bad"))
try:
    raise ValueError("boom")
except ValueError:
    log.exception("crashed", engine="tf")
"""


def run_logging(tmp_path: Path, mode: str, **env: str) -> list[str]:
    err = tmp_path / "stderr.log"
    with err.open("wb") as stream:
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode],
            stdout=subprocess.PIPE,
            stderr=stream,
            timeout=60,
            check=False,
            env={**{k: v for k, v in os.environ.items() if k != "LUCIA_LOG_LEVEL"}, **env},
        )
    text = err.read_bytes().decode()
    assert run.returncode == 0, text
    assert run.stdout == b""
    assert "\r" not in text
    return text.splitlines()


def test_journald_lines_carry_the_priority(tmp_path: Path) -> None:
    lines = run_logging(tmp_path, "journal")
    assert len(lines) == 5, lines  # one line per event, debug filtered out
    started, slow, failed, refused, crashed = lines
    assert started == "<6>engine started engine=tf generation=3"
    assert slow.startswith("<4>heartbeat slow ")
    assert "seconds=61.5" in slow
    assert 'note="took a while"' in slow
    assert r'quote="say \"hi\""' in slow
    assert failed.startswith("<3>build failed ")
    assert 'output="step 1 | step 2 | error: no space left"' in failed
    assert "code=137" in failed
    assert refused == '<4>request refused error="2 errors | generation: bad | desired: bad"'
    assert crashed.startswith("<3>crashed engine=tf exception=")
    assert "Traceback" in crashed and "ValueError: boom" in crashed
    for line in lines:
        assert re.match(r"<[0-7]>\S", line), line
        assert "level=" not in line and "timestamp=" not in line  # journald records both


def test_journald_shows_debug_when_asked(tmp_path: Path) -> None:
    lines = run_logging(tmp_path, "journal", LUCIA_LOG_LEVEL="debug")
    assert lines[0] == "<7>not shown detail=1"
    assert len(lines) == 6


@pytest.mark.parametrize("mode", ["plain", "other-journal"])
def test_plain_stream_gets_key_value_lines(tmp_path: Path, mode: str) -> None:
    lines = run_logging(tmp_path, mode)
    assert len(lines) == 5, lines
    levels = ["info", "warning", "error", "warning", "error"]
    events = ["engine started", "heartbeat slow", "build failed", "request refused", "crashed"]
    before = datetime.now(UTC)
    for line, level, event in zip(lines, levels, events, strict=True):
        found = re.match(r"timestamp='([^']+)' level='(\w+)' event='([^']+)'", line)
        assert found, line
        stamp = datetime.fromisoformat(found[1].replace("Z", "+00:00"))
        assert found[1].endswith("Z")
        assert abs((before - stamp).total_seconds()) < 120
        assert (found[2], found[3]) == (level, event)
        assert not line.startswith("<")
    assert "engine='tf'" in lines[0] and "generation=3" in lines[0]
    assert "output='step 1 | step 2 | error: no space left'" in lines[2]
    assert "2 errors" in lines[3] and "desired: bad" in lines[3]
    assert "ValueError: boom" in lines[4]
