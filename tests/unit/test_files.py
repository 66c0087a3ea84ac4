"""Atomic writes, bounded safe reads and the directory lease."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from supervisor.protocol import files
from supervisor.protocol.documents import Status, dump, parse_status
from supervisor.protocol.files import FileRefused, Lease, LeaseHeld, read_text, write_atomic
from tests.support import within

T = TypeVar("T")


@contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --- write_atomic -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o644])
@pytest.mark.parametrize("mask", [0o000, 0o077, 0o022])
def test_write_atomic_content_and_exact_mode(tmp_path: Path, mode: int, mask: int) -> None:
    path = tmp_path / "status.json"
    with umask(mask):
        write_atomic(path, b'{"a": 1}\n', mode=mode)
        assert path.read_bytes() == b'{"a": 1}\n'
        assert path.stat().st_mode & 0o7777 == mode
        # replacing a file of another mode gives the requested mode too
        path.chmod(0o666 if mode != 0o666 else 0o600)
        write_atomic(path, b"second", mode=mode)
    assert path.read_bytes() == b"second"
    assert path.stat().st_mode & 0o7777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_write_atomic_default_mode_is_0640(tmp_path: Path) -> None:
    with umask(0):
        write_atomic(tmp_path / "f", b"x")
    assert (tmp_path / "f").stat().st_mode & 0o7777 == 0o640


def test_write_atomic_large_and_empty_content(tmp_path: Path) -> None:
    big = os.urandom(3 * 1024 * 1024 + 7)
    write_atomic(tmp_path / "big", big)
    assert (tmp_path / "big").read_bytes() == big
    write_atomic(tmp_path / "big", b"")
    assert (tmp_path / "big").read_bytes() == b""


def test_write_atomic_replaces_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    link = tmp_path / "desired.json"
    link.symlink_to(outside)
    write_atomic(link, b"new")
    assert not link.is_symlink()
    assert link.read_bytes() == b"new"
    assert outside.read_bytes() == b"precious"


def _fsync_fails(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _write_half_then_fails(real: Callable[[int, Any], int]) -> Callable[[int, Any], int]:
    calls = {"n": 0}

    def write(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


def _interrupted(fd: int) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("target", "make", "error"),
    [
        ("fsync", lambda real: _fsync_fails, OSError),
        ("write", _write_half_then_fails, OSError),
        ("fsync", lambda real: _interrupted, KeyboardInterrupt),
    ],
    ids=["fsync-enospc", "short-write-then-enospc", "interrupted"],
)
def test_failed_write_leaves_the_previous_file_and_no_temp(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    make: Callable[[Any], Any],
    error: type[BaseException],
) -> None:
    path = tmp_path / "status.json"
    write_atomic(path, b"old content\n", mode=0o640)
    monkeypatch.setattr(os, target, make(getattr(os, target)))
    with pytest.raises(error):
        write_atomic(path, b"new content that is longer than the old one\n" * 100)
    monkeypatch.undo()
    assert path.read_bytes() == b"old content\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_failed_rename_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.mkdir()
    (path / "keep").write_bytes(b"x")
    with pytest.raises(OSError):
        write_atomic(path, b"data")
    assert leftovers(tmp_path) == []
    assert (path / "keep").read_bytes() == b"x"


def test_write_atomic_into_a_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "status.json", b"x")
    assert list(tmp_path.iterdir()) == []


def test_readers_never_see_a_partial_status(tmp_path: Path) -> None:
    """The required proof: 10,000 atomic rewrites under a reader that parses in a tight loop."""
    path = tmp_path / "status.json"
    base = datetime(2024, 5, 1, tzinfo=UTC)
    variants = [
        Status(generation=0, state="starting", since=base, message="", checked_at=base),
        Status(
            generation=0,
            state="running",
            since=base,
            message="serving " * 60,
            url="http://172.17.0.1:8888",
            checked_at=base,
        ),
        Status(
            generation=0,
            state="failed",
            since=base,
            message="exit code 137",
            refused="desired: input should be 'running' or 'stopped'",
            checked_at=base,
        ),
        Status(generation=0, state="stopping", since=base, message="é" * 500, checked_at=base),
    ]
    payloads = [
        dump(v.model_copy(update={"generation": i, "checked_at": base + timedelta(seconds=i)}))
        for i, v in enumerate(variants * 2500)
    ]
    assert len({len(p) for p in payloads[:4]}) == 4  # different lengths, so a mix would show
    write_atomic(path, payloads[0])

    done = threading.Event()
    reads = 0
    failures: list[str] = []
    generations: list[int] = []

    def reader() -> None:
        nonlocal reads
        while not done.is_set():
            try:
                generations.append(parse_status(read_text(path)).generation)
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            reads += 1
            # Not a wait: hands the GIL to the writer, which otherwise queues behind the reader's
            # 5 ms time slice after every fsync (10,000 writes would take half a minute).
            time.sleep(0)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for payload in payloads:
            write_atomic(path, payload)
    finally:
        done.set()
        thread.join(30)
    assert not thread.is_alive()
    assert failures == [], failures[:5]
    assert reads > 0
    print(f"{reads} reads during {len(payloads)} writes")
    assert len(set(generations)) > 1, "the reader never saw the file change"
    assert generations == sorted(generations), "a reader saw an older file after a newer one"
    assert parse_status(read_text(path)).generation == len(payloads) - 1
    assert leftovers(tmp_path) == []


# --- read_text ----------------------------------------------------------------------------------


def test_read_text_reads_utf8(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes("Qwen3.8 — ready\n".encode())
    assert read_text(path) == "Qwen3.8 — ready\n"


def test_read_text_limit_is_inclusive(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * files.MAX_READ)
    assert len(read_text(path)) == files.MAX_READ
    path.write_bytes(b"a" * (files.MAX_READ + 1))
    with pytest.raises(FileRefused, match=f"is {files.MAX_READ + 1} bytes; the limit is"):
        read_text(path)


def test_read_text_custom_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert read_text(path, limit=10) == "0123456789"
    with pytest.raises(FileRefused, match="is 10 bytes; the limit is 9") as caught:
        read_text(path, limit=9)
    assert caught.value.path == path


def test_read_text_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "desired.json"
    os.mkfifo(path)
    with pytest.raises(FileRefused, match="is a FIFO, not a regular file"):
        within(5, lambda: read_text(path))


def test_read_text_refuses_a_fifo_with_a_writer_attached(tmp_path: Path) -> None:
    path = tmp_path / "desired.json"
    os.mkfifo(path)
    reader_side = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writer, b'{"schemaVersion": 1}')
        with pytest.raises(FileRefused, match="FIFO"):
            within(5, lambda: read_text(path))
    finally:
        os.close(writer)
        os.close(reader_side)


def test_read_text_refuses_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(FileRefused, match="is a directory, not a regular file"):
        read_text(tmp_path / "d")


def test_read_text_refuses_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        with pytest.raises(FileRefused, match=r"socket|cannot be opened"):
            within(5, lambda: read_text(path))


@pytest.mark.parametrize("target", ["file", "directory", "missing"])
def test_read_text_refuses_symlinks(tmp_path: Path, target: str) -> None:
    real = tmp_path / "real"
    if target == "file":
        real.write_text('{"schemaVersion": 1, "generation": 3, "desired": "running"}')
    elif target == "directory":
        real.mkdir()
    link = tmp_path / "desired.json"
    link.symlink_to(real)
    with pytest.raises(FileRefused, match="is a symlink") as caught:
        read_text(link)
    assert str(link) in str(caught.value)


def test_read_text_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        read_text(tmp_path / "absent.json")
    assert not isinstance(caught.value, FileRefused)


@pytest.mark.parametrize(
    ("content", "byte"),
    [(b"ok\xff", 2), (b"\xc3(", 0), (b"abc\xed\xa0\x80", 3), (b"\x80", 0)],
    ids=["ff", "bad-continuation", "surrogate", "lone-continuation"],
)
def test_read_text_refuses_invalid_utf8(tmp_path: Path, content: bytes, byte: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(content)
    with pytest.raises(FileRefused, match=rf"is not valid UTF-8 \(byte {byte}\)") as caught:
        read_text(path)
    assert str(caught.value) == f"{path}: is not valid UTF-8 (byte {byte})"


# --- the lease ----------------------------------------------------------------------------------

CONTENDER = """
import sys
from pathlib import Path
from supervisor.protocol.files import Lease, LeaseHeld
try:
    Lease(Path(sys.argv[1])).acquire()
except LeaseHeld as exc:
    print(exc, flush=True)
    sys.exit(3)
print("acquired", flush=True)
"""

HOLDER = """
import sys
from pathlib import Path
from supervisor.protocol.files import Lease
lease = Lease(Path(sys.argv[1])).acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_second_lease_in_the_same_process_fails(tmp_path: Path) -> None:
    first = Lease(tmp_path).acquire()
    try:
        with pytest.raises(LeaseHeld) as caught:
            within(5, Lease(tmp_path).acquire)  # fails at once, never waits
        message = str(caught.value)
        assert str(tmp_path) in message
        assert f"pid {os.getpid()}" in message
        assert "\n" not in message
        assert caught.value.pid == os.getpid()
        assert caught.value.directory == tmp_path
    finally:
        first.release()
    with Lease(tmp_path) as again:
        assert again is not None
    assert (tmp_path / files.LEASE_NAME).stat().st_mode & 0o777 == 0o600


def test_lease_release_is_idempotent_and_allows_a_new_holder(tmp_path: Path) -> None:
    lease = Lease(tmp_path).acquire()
    lease.release()
    lease.release()
    with Lease(tmp_path), pytest.raises(LeaseHeld):
        within(5, Lease(tmp_path).acquire)


def _contend(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CONTENDER, str(directory)],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )


def test_a_second_holder_in_another_process_fails_at_once(tmp_path: Path) -> None:
    with Lease(tmp_path):
        started = time.monotonic()
        run = _contend(tmp_path)
        elapsed = time.monotonic() - started
    assert run.returncode == 3, run.stderr
    assert str(tmp_path) in run.stdout
    assert f"pid {os.getpid()}" in run.stdout
    assert "one worker per directory" in run.stdout
    assert elapsed < 10  # a blocking flock would have hung until the timeout
    again = _contend(tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip() == "acquired"


def test_a_killed_holder_releases_the_lease(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld) as caught:
            within(5, Lease(tmp_path).acquire)
        assert caught.value.pid == holder.pid
        assert f"pid {holder.pid}" in str(caught.value)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        if holder.stdin is not None:
            holder.stdin.close()
        if holder.stdout is not None:
            holder.stdout.close()
    assert holder.returncode == -signal.SIGKILL
    with Lease(tmp_path):
        assert (tmp_path / files.LEASE_NAME).read_text().strip() == str(os.getpid())
