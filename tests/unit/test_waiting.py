"""`request --wait`'s progress: one redrawn line on a real terminal (a pty), a line per change
every few seconds on a pipe; and the pure rendering in tables."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.host.waiting import LINE_EVERY, Progress, elapsed
from tests.unit.test_cli import CLI, URL, write_status

CLEAR = "\r\x1b[K"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (59.9, "59s"),
        (60, "1m00s"),
        (605, "10m05s"),
        (3600, "1h00m00s"),
        (3 * 3600 + 62, "3h01m02s"),
    ],
)
def test_elapsed(seconds: float, shown: str) -> None:
    assert elapsed(seconds) == shown


def test_off_a_terminal_a_line_per_change_at_most_every_few_seconds() -> None:
    progress = Progress("tf", terminal=False, started=100.0)
    assert progress.update(100.0, "downloading 1%") == "tf: [0s] downloading 1%\n"
    assert progress.update(101.0, "downloading 2%") == ""  # too soon
    assert progress.update(102.0, "downloading 3%") == ""
    assert progress.update(100.0 + LINE_EVERY, "downloading 4%") == "tf: [5s] downloading 4%\n"
    assert progress.update(200.0, "downloading 4%") == ""  # no change, no line
    assert progress.update(201.0, "verifying") == "tf: [1m41s] verifying\n"
    assert progress.finish() == ""


def test_on_a_terminal_one_line_redrawn_with_the_elapsed_time() -> None:
    progress = Progress("tf", terminal=True, started=0.0, width=30)
    assert progress.update(0.0, "starting") == CLEAR + "tf: [0s] starting"
    assert progress.update(0.4, "starting") == ""  # the same line is not redrawn
    assert progress.update(1.0, "starting") == CLEAR + "tf: [1s] starting"  # the clock ticks
    long = progress.update(2.0, "downloading " + "x" * 100)
    assert long == CLEAR + ("tf: [2s] downloading " + "x" * 100)[:29]  # never wraps
    assert "\n" not in long
    assert progress.finish() == CLEAR
    assert progress.finish() == ""


# --- the real command, on a pty and on a pipe ---------------------------------------------------


class Collector:
    """Reads a file descriptor to its end in a thread; waits for what a test expects."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the pty's other side is closed
                chunk = b""
            with self._changed:
                if not chunk:
                    self._changed.notify_all()
                    return
                self.text += chunk.decode(errors="replace")
                self._changed.notify_all()

    def wait_for(self, check: Callable[[str], bool], what: str, limit: float = 60) -> None:
        deadline = time.monotonic() + limit  # a bound against a hang, not a speed assertion
        with self._changed:
            while not check(self.text):
                left = deadline - time.monotonic()
                assert left > 0, f"never saw {what}; got {self.text!r}"
                self._changed.wait(left)

    def close(self) -> str:
        self._thread.join(30)
        return self.text


def _start(data: Path, stderr: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(CLI), "request", "tf", "running", "--wait", "--create", "--data-dir", str(data)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LUCIA_DATA_DIR"},
    )


def _request(data: Path, side: int, reader: int, show: Callable[[Collector, int], None]) -> str:
    """`request --wait` with its progress on `side` (closed here), read back through `reader`:
    `show` writes the statuses while it waits, then the engine runs. What was read."""
    proc = _start(data, side)
    os.close(side)
    seen = Collector(reader)
    try:
        assert proc.stdout is not None
        generation = int(proc.stdout.readline())
        show(seen, generation)
        write_status(data, "tf", generation, "running", message="serving")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = seen.close()
    os.close(reader)
    assert proc.returncode == 0
    assert out == f"tf: running at {URL}\n"
    return text


def test_a_terminal_sees_one_updating_line_with_the_elapsed_time(tmp_path: Path) -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))

    def show(screen: Collector, generation: int) -> None:
        write_status(tmp_path, "tf", generation, "starting", message="downloading 10%")
        screen.wait_for(lambda t: "downloading 10%" in t, "the first progress")
        long = "downloading 20% " + "=" * 200
        write_status(tmp_path, "tf", generation, "starting", message=long)
        # the same message redrawn as the clock moves on: two elapsed times for it
        screen.wait_for(
            lambda t: len(set(re.findall(r"tf: \[(\d+s)\] downloading 20%", t))) >= 2,
            "a redraw of the same message with a later elapsed time",
        )

    text = _request(tmp_path, slave, master, show)
    assert "\n" not in text  # every redraw replaced the line; none became a new one
    assert text.startswith(CLEAR) and text.endswith(CLEAR)  # erased at the end for the outcome
    drawn = [line for line in text.split(CLEAR) if line]
    assert all(re.match(r"tf: \[\d+(m\d\d)?s\] ", line) for line in drawn), drawn
    assert max(len(line) for line in drawn) == 59  # the long message is cut to the width
    assert any(line.startswith("tf: [") and "downloading 10%" in line for line in drawn)


def test_a_pipe_sees_a_line_when_the_message_changes(tmp_path: Path) -> None:
    read, write = os.pipe()

    def show(log: Collector, generation: int) -> None:
        write_status(tmp_path, "tf", generation, "starting", message="downloading 10%")
        log.wait_for(lambda t: "downloading 10%\n" in t, "a line for the first message")
        write_status(tmp_path, "tf", generation, "starting", message="downloading 20%")
        log.wait_for(lambda t: "downloading 20%\n" in t, "a line for the changed message")

    text = _request(tmp_path, write, read, show)
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert [line.split("] ", 1)[1] for line in lines if "downloading" in line] == [
        "downloading 10%",
        "downloading 20%",
    ]  # once each, though read on every poll
    assert all(re.fullmatch(r"tf: \[\d+s\] .+", line) for line in lines), lines
