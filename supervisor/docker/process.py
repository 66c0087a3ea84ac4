"""Child processes whose output becomes progress and which a cancel ends within a second."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from supervisor.errors import Cancelled

_GRACE: Final = 5.0
_TAIL: Final = 20


@dataclass
class Outcome:
    code: int
    tail: list[str] = field(default_factory=list)


_ENDS = re.compile(rb"\r\n|\r|\n")
_CSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # cursor moves and colours of progress bars


def segments(data: bytes) -> tuple[list[tuple[str, bool]], bytes]:
    """Pure: the finished segments of output, and the unfinished rest. A segment ends at a
    newline (a line: True) or at a carriage return (a progress bar drawn again in place: False).
    Escape sequences are dropped; blank segments are left out."""
    found: list[tuple[str, bool]] = []
    start = 0
    for end in _ENDS.finditer(data):
        text = _CSI.sub("", data[start : end.start()].decode("utf-8", errors="replace")).rstrip()
        if text.strip():
            found.append((text, end.group() != b"\r"))
        start = end.end()
    return found, data[start:]


class Tail:
    """The last lines of output, a progress bar counted once: each redraw replaces the one
    before it, so a download's hundred redraws leave one line, its latest."""

    def __init__(self, size: int = _TAIL) -> None:
        self.lines: list[str] = []
        self._size = size
        self._redrawn = False

    def add(self, text: str, line: bool) -> None:
        if self._redrawn and self.lines:
            self.lines[-1] = text
        else:
            self.lines.append(text)
            del self.lines[: -self._size]
        self._redrawn = not line


def _read(stream: IO[bytes]) -> bytes:
    try:
        return stream.read1(8192)  # type: ignore[attr-defined,no-any-return]
    except (ValueError, OSError):  # closed under us after a cancel
        return b""


def _pump(stream: IO[bytes], progress: Callable[[str], None], tail: list[str]) -> None:
    relay(iter(lambda: _read(stream), b""), progress, tail)


def relay(chunks: Iterable[bytes], progress: Callable[[str], None], tail: list[str]) -> None:
    """Split output (bytes as they come) on newlines and carriage returns (progress bars redraw
    with \\r): every line becomes progress, of a burst of redraws only the latest; tail holds
    the last lines as they stand."""
    kept = Tail()
    pending = b""
    for chunk in chunks:
        found, pending = segments(pending + chunk)
        for index, (text, line) in enumerate(found):
            kept.add(text, line)
            if line or index == len(found) - 1:
                progress(text)
        tail[:] = kept.lines
    rest, _ = segments(pending + b"\n")
    for text, _line in rest:
        kept.add(text, True)
        progress(text)
    tail[:] = kept.lines


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate(proc: subprocess.Popen[bytes], grace: float = _GRACE) -> None:
    """SIGTERM the whole process group, then SIGKILL what is left of it after the grace. The
    group, not only its leader: a shell that dies at once may leave a `docker run` behind that
    passes the signal on to its container and waits for it, holding the output pipe open."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so that only live members keep the group
        if not _group_alive(proc.pid):
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(
    command: Sequence[str],
    *,
    cwd: Path | None,
    env: dict[str, str],
    progress: Callable[[str], None],
    cancel: threading.Event,
    grace: float = _GRACE,
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
                terminate(proc, grace)
                raise Cancelled(f"{command[0]} cancelled")
    finally:
        if proc.poll() is None:
            terminate(proc)
        reader.join(2)
        proc.stdout.close()
    return Outcome(proc.returncode, tail)
