"""The hf CLI as a child process: its environment and token file, progress from disk, stall, cancel.

The token rules (the operators' guide): HF_TOKEN, HUGGING_FACE_HUB_TOKEN, HF_TOKEN_PATH, HF_HOME
and every HF_OIDC_* are stripped from the child's environment; HF_HOME is private to the library;
HF_HUB_DISABLE_UPDATE_CHECK=1; a token goes in only as a 0400 file named by HF_TOKEN_PATH, and
without one HF_HUB_DISABLE_IMPLICIT_TOKEN=1. A token is never in the argument list or a message.
Progress is the bytes on disk under the local dir, hf's .incomplete files included.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.redaction import redact

STRIPPED: Final = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HOME"})
STRIPPED_PREFIXES: Final = ("HF_OIDC_",)
KILL_GRACE: Final = 0.3
WAKE: Final = 0.1  # how often a cancel and hf's exit are looked at between polls
_PR_SET_PDEATHSIG: Final = 1


def hf_program() -> str:
    """The hf CLI beside this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("hf")
    return str(beside) if beside.is_file() else (shutil.which("hf") or "hf")


def child_env(base: Mapping[str, str], hf_home: Path, token_file: Path | None) -> dict[str, str]:
    """The child's environment under the token rules (pure)."""
    env = {
        key: value
        for key, value in base.items()
        if key not in STRIPPED and not key.startswith(STRIPPED_PREFIXES)
    }
    env["HF_HOME"] = str(hf_home)
    env["HF_HUB_DISABLE_UPDATE_CHECK"] = "1"
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env.pop("HF_HUB_DISABLE_IMPLICIT_TOKEN", None)
    if token_file is not None:
        env["HF_TOKEN_PATH"] = str(token_file)
    else:
        env["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"  # noqa: S105
    return env


def child_argv(
    program: str, repo: str, commit: str, local_dir: Path, include: list[str]
) -> list[str]:
    """hf download REPO --revision COMMIT --local-dir DIR [--include GLOB]... --quiet (pure)."""
    argv = [program, "download", repo, "--revision", commit, "--local-dir", str(local_dir)]
    for pattern in include:
        argv += ["--include", pattern]
    return [*argv, "--quiet"]


def write_token(directory: Path, name: str, token: str) -> Path:
    """The token as a 0400 file in a 0700 directory; replaced whole, never appended."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / name
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def bytes_on_disk(directory: Path) -> int:
    """The sizes of every regular file under directory (hf's partial files included)."""
    total = 0
    for base, _dirs, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except FileNotFoundError:  # renamed or swept while we walked
                continue
    return total


@dataclass
class Rate:
    """Speed over a sliding window of (time, bytes) samples, and the time a download has left."""

    window: float = 10.0

    def __post_init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, at: float, done: int) -> None:
        self._samples.append((at, done))
        while len(self._samples) > 2 and at - self._samples[0][0] > self.window:
            self._samples.popleft()

    def speed(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return max(b1 - b0, 0) / (t1 - t0) if t1 > t0 else None

    def seconds_left(self, done: int, total: int) -> float | None:
        speed = self.speed()
        return (total - done) / speed if speed and total > done else None


@dataclass(frozen=True)
class Sample:
    done: int
    speed: float | None
    seconds_left: float | None


@dataclass(frozen=True)
class FetchOutcome:
    """How the child ended: ok, or a one-line reason (cancel, stall, hf's own error)."""

    ok: bool
    reason: str = ""
    canceled: bool = False


def _die_with_parent() -> None:
    """In the child: SIGKILL when the library's process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run(
    argv: list[str],
    env: dict[str, str],
    local_dir: Path,
    total: int,
    *,
    stall_after: float,
    poll: float,
    cancel: threading.Event,
    progress: Callable[[Sample, int], None],
    space: Callable[[int], str | None] = lambda done: None,
    tick: Callable[[], None] = lambda: None,
) -> FetchOutcome:
    """Run hf until it exits, is canceled, stalls or the disk cannot hold the rest (space(done)
    says why); progress(sample, pid) about every poll."""
    child = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509
    )
    tail: deque[str] = deque(maxlen=20)
    reader = threading.Thread(target=_read_lines, args=(child, tail), daemon=True)
    reader.start()
    rate = Rate()
    last_bytes, last_change = -1, time.monotonic()
    try:
        while child.poll() is None:
            at = time.monotonic()
            done = bytes_on_disk(local_dir)
            if done != last_bytes:
                last_bytes, last_change = done, at
            rate.add(at, done)
            shown = min(done, total)
            progress(Sample(shown, rate.speed(), rate.seconds_left(shown, total)), child.pid)
            if cancel.is_set():
                _end(child)
                return FetchOutcome(False, "canceled", canceled=True)
            problem = space(done)
            if problem:
                _end(child)
                return FetchOutcome(False, f"the disk filled during the download: {problem}")
            if at - last_change >= stall_after:
                _end(child)
                return FetchOutcome(False, f"stalled: no bytes arrived for {stall_after:g} s")
            tick()
            _wait(child, cancel, at + poll)
    finally:
        _end(child)
        reader.join(timeout=2)
    if child.returncode == 0:
        return FetchOutcome(True)
    last = next((line for line in reversed(tail) if line.strip()), "")
    return FetchOutcome(False, redact(f"hf download exited {child.returncode}: {last}".strip()))


def _wait(child: subprocess.Popen[bytes], cancel: threading.Event, until: float) -> None:
    """Until the next poll, hf's exit, or a cancel, whichever comes first (within WAKE)."""
    while not cancel.is_set() and time.monotonic() < until:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(min(WAKE, max(until - time.monotonic(), 0)))
            return


def _read_lines(child: subprocess.Popen[bytes], tail: deque[str]) -> None:
    assert child.stderr is not None
    for raw in child.stderr:
        tail.append(raw.decode(errors="replace").rstrip()[:300])


def _end(child: subprocess.Popen[bytes]) -> None:
    """Stop the child's whole process group: TERM, then KILL after a short grace."""
    if child.poll() is None:
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(KILL_GRACE)
        except subprocess.TimeoutExpired:
            _signal_group(child.pid, signal.SIGKILL)
            child.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
