"""The catalog's lease: `.lucia-model-catalog.lease`, flocked by the process running the queue.

The kernel drops the lock when its holder dies, however it dies, so a stale lease cannot outlive
it. The holder's pid is written into the file for the message a second process gets.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Final, Self

LEASE_NAME: Final = ".lucia-model-catalog.lease"


class CatalogHeld(RuntimeError):
    """Another process runs this library's queue."""

    def __init__(self, root: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"the model library {root} is already run by {holder} (it holds {LEASE_NAME}); "
            "a second library process would corrupt its catalog: stop that one first"
        )
        self.pid = pid


class CatalogLease:
    """An exclusive, non-blocking flock on <root>/.lucia-model-catalog.lease."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None

    def acquire(self, wait: float = 0.0) -> Self:
        """Take the lease, trying for up to wait seconds (a CLI holds it for a moment when no
        service runs), or raise CatalogHeld naming the holder."""
        self.root.mkdir(mode=0o750, parents=True, exist_ok=True)
        path = self.root / LEASE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise CatalogHeld(self.root, int(text) if text.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; False when a running queue holds it."""
        try:
            self.acquire()
        except CatalogHeld:
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def holder(self) -> int | None:
        """The pid of the process that holds the lease now, as far as it can be told without
        taking it (its pid file, and that process alive); None when nobody seems to."""
        try:
            text = (self.root / LEASE_NAME).read_text().strip()
        except OSError:
            return None
        if not text.isdigit() or not os.path.exists(f"/proc/{text}"):
            return None
        return int(text)

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
