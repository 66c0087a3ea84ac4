"""scripts/machine.sh when a step fails, on this machine (root, the running dockerd): the step's
log tail, then one line that says which step failed and why, and nothing after it runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures import ROOT, RUN_ID

pytestmark = pytest.mark.docker

MACHINE = ROOT / "scripts" / "machine.sh"
STEP = "machine.sh: the llama-server image (scripts/llama-server-image.sh) failed (exit 1): "


def machine(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0:
        pytest.fail("scripts/machine.sh runs as root; run these tests as root (as CI does)")
    private = {
        "LUCIA_MACHINE_LOGS": str(tmp_path / "logs"),
        # a label no image carries: nothing built before is found, so the build is attempted
        "LUCIA_LLAMA_LABEL": f"lucia.test.llama-server.version-{RUN_ID}",
        "LUCIA_LLAMA_REPOSITORY": f"lucia-test-llama-server-{RUN_ID}",
        # nothing listens on the discard port: sid's index is out of reach at once
        "LUCIA_LLAMA_MIRROR": "http://127.0.0.1:9/debian",
    }
    return subprocess.run(
        ["bash", str(MACHINE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, **private, **env},
    )


def test_a_failed_step_shows_its_log_and_its_reason(tmp_path: Path) -> None:
    done = machine(tmp_path, LUCIA_LLAMA_CACHE=str(tmp_path / "apt"))
    assert done.returncode == 1
    log = tmp_path / "logs" / "llama-server-image.log"
    reason = (
        "llama-server-image.sh: apt-get update of sid at http://127.0.0.1:9/debian failed, and "
        "no image was built before"
    )
    lines = done.stderr.splitlines()
    assert lines[-1] == STEP + reason, done.stderr
    # the tail of the step's log comes first, its reason the last line of it
    assert f"--- the last lines of {log}:" in lines
    assert lines[-2] == reason
    assert "Could not connect to 127.0.0.1:9" in done.stderr
    assert log.read_text().splitlines()[-1] == reason
    # nothing after the failed step ran
    assert "systemd user manager" not in done.stdout + done.stderr
    assert "machine ready" not in done.stdout


def test_a_silent_set_e_exit_of_a_step_is_named_by_its_trap(tmp_path: Path) -> None:
    # the private apt directory cannot be made: before the ERR trap, set -e ended the image
    # script with only mkdir's own words, and machine.sh said "the llama-server image failed"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = machine(tmp_path, LUCIA_LLAMA_CACHE=str(blocker / "apt"))
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(STEP + "llama-server-image.sh: line "), done.stderr
    assert last.endswith(
        ': `mkdir -p "$cache/lists/partial" "$cache/cache/archives/partial"` failed (exit 1)'
    ), done.stderr
    assert "Not a directory" in done.stderr
