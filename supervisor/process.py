"""Child processes whose output becomes progress and which a cancel ends within a second."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from .errors import Cancelled

_GRACE: Final = 5.0
_TAIL: Final = 20


@dataclass
class Outcome:
    code: int
    tail: list[str] = field(default_factory=list)


def _pump(stream: IO[bytes], progress: Callable[[str], None], tail: list[str]) -> None:
    """Split on both newlines and carriage returns: progress bars redraw with \\r."""
    pending = b""
    for chunk in iter(lambda: stream.read1(8192), b""):  # type: ignore[attr-defined]
        pending += chunk
        *lines, pending = pending.replace(b"\r", b"\n").split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line.strip():
                tail.append(line)
                del tail[:-_TAIL]
                progress(line)
    if pending.strip():
        tail.append(pending.decode("utf-8", errors="replace").rstrip())


def terminate(proc: subprocess.Popen[bytes], grace: float = _GRACE) -> None:
    """SIGTERM the whole process group, then SIGKILL after the grace."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run(
    command: Sequence[str],
    *,
    cwd: Path | None,
    env: dict[str, str],
    progress: Callable[[str], None],
    cancel: threading.Event,
) -> Outcome:
    """Run command in its own session; stream its output; a cancel ends it and its children."""
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc.stdout, progress, tail), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            if cancel.wait(0.1):
                terminate(proc)
                raise Cancelled(f"{command[0]} cancelled")
    finally:
        if proc.poll() is None:
            terminate(proc)
        reader.join(2)
        proc.stdout.close()
    return Outcome(proc.returncode, tail)
