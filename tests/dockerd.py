"""The real dockerd as a fault: its pid, a restart as a package upgrade would do it, a start.

Shared by tests/faults and the soak; the machine's dockerd is started by scripts/machine.sh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

LOGS = Path("/var/log/lucia-machine")


def pid() -> int:
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def restart(log_name: str = "dockerd-restart.log") -> None:
    """SIGTERM (a stalled dockerd is woken first, so that it can stop), then start it again."""
    old = pid()
    os.kill(old, signal.SIGCONT)
    os.kill(old, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{old}").exists():
        time.sleep(0.2)
    start(log_name)


def start(log_name: str = "dockerd-restart.log") -> None:
    """Start dockerd in a session of its own; return once `docker info` answers."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / log_name, "ab")  # noqa: SIM115 - dockerd keeps it open
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError("dockerd did not come back")


def answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0
