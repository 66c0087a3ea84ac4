"""SHA-256 while hf downloads: each LFS file hashed from its .incomplete file as the bytes land.

hf names a partial file `<path digest>.<etag>[.<random>].incomplete` under
`<local-dir>/.cache/huggingface/download/`, and an LFS file's etag is its sha256; so the partial
file is known by its LFS id. Its descriptor is kept open and read up to its current size at each
poll; hf's rename to the final path keeps the inode, so the final file is proven to be the bytes
hashed when its inode and size match and its digest equals the LFS id. A file whose streamed
digest does not match (written out of order, say) is simply hashed again after the download:
streaming can only save the check, never fail a file.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from supervisor.host.models.manifest import HubFile

PARTIALS: Final = Path(".cache") / "huggingface" / "download"
CHUNK: Final = 8 * 1024 * 1024
BUDGET: Final = 0.25  # seconds of hashing per poll, so that a cancel is still heard at once


@dataclass
class _Tracked:
    file: HubFile
    fd: int
    inode: int
    hasher: Any = field(default_factory=hashlib.sha256)
    offset: int = 0


class StreamHasher:
    """Hashes the LFS files of one download while they arrive; closes what it opened."""

    def __init__(self, local_dir: Path, files: list[HubFile]) -> None:
        self.local_dir = local_dir
        self._wanted = {f.sha256: f for f in files if f.sha256 and not f.verified}
        self._tracked: dict[str, _Tracked] = {}

    def poll(self) -> None:
        """Open new partial files, then hash what has landed, for at most BUDGET seconds."""
        self._discover()
        until = time.monotonic() + BUDGET
        for tracked in self._tracked.values():
            if not self._catch_up(tracked, until):
                return

    def _discover(self) -> None:
        try:
            names = os.listdir(self.local_dir / PARTIALS)
        except OSError:
            return
        for name in names:
            if not name.endswith(".incomplete"):
                continue
            sha = next((p for p in name.split(".") if p in self._wanted), None)
            if sha is None or sha in self._tracked:
                continue
            try:
                fd = os.open(
                    self.local_dir / PARTIALS / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
            except OSError:
                continue
            self._tracked[sha] = _Tracked(self._wanted[sha], fd, os.fstat(fd).st_ino)

    @staticmethod
    def _catch_up(tracked: _Tracked, until: float | None) -> bool:
        """Hash up to the file's current end; False when the time budget ran out first."""
        while True:
            chunk = os.pread(tracked.fd, CHUNK, tracked.offset)
            if not chunk:
                return True
            tracked.hasher.update(chunk)
            tracked.offset += len(chunk)
            if until is not None and time.monotonic() > until:
                return False

    def finish(self) -> set[str]:
        """After hf exited 0: the paths proven to be their LFS id's bytes. Closes everything."""
        proven: set[str] = set()
        try:
            for sha, tracked in self._tracked.items():
                self._catch_up(tracked, None)
                try:
                    final = (self.local_dir / tracked.file.path).lstat()
                except OSError:
                    continue
                same = final.st_ino == tracked.inode and final.st_size == tracked.offset
                if (
                    same
                    and tracked.offset == tracked.file.size
                    and tracked.hasher.hexdigest() == sha
                ):
                    proven.add(tracked.file.path)
        finally:
            self.close()
        return proven

    def close(self) -> None:
        for tracked in self._tracked.values():
            os.close(tracked.fd)
        self._tracked.clear()
