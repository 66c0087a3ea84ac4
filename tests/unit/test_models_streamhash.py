"""The streamed SHA-256: a file proven only when its bytes, inode and size are the LFS id's."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from supervisor.host.models.manifest import HubFile
from supervisor.host.models.streamhash import PARTIALS, StreamHasher

DATA = os.urandom(3 * 1024 * 1024 + 17)
SHA = hashlib.sha256(DATA).hexdigest()


def _download(local: Path, how: str) -> StreamHasher:
    """Write DATA as hf does (a partial file named by its etag, then a rename), polling between."""
    file = HubFile(path="m.gguf", size=len(DATA), sha256=SHA, gitOid="g")
    hasher = StreamHasher(local, [file])
    partials = local / PARTIALS
    partials.mkdir(parents=True)
    partial = partials / f"aGFzaA=.{SHA}.1a2b3c4d.incomplete"
    hasher.poll()  # nothing there yet
    with partial.open("wb") as f:
        if how == "out of order":  # the end first, then the start: the stream reads a hole
            f.seek(len(DATA) // 2)
            f.write(DATA[len(DATA) // 2 :])
            f.flush()
            hasher.poll()
            f.seek(0)
            f.write(DATA[: len(DATA) // 2])
        else:
            for start in range(0, len(DATA), 1024 * 1024):
                f.write(DATA[start : start + 1024 * 1024])
                f.flush()
                hasher.poll()
    if how == "copied":  # a new inode at the final path: not the bytes that were hashed
        shutil.copyfile(partial, local / "m.gguf")
        partial.unlink()
    else:
        partial.rename(local / "m.gguf")
    if how == "changed after":
        with (local / "m.gguf").open("r+b") as f:
            f.seek(0, 2)
            f.write(b"x")
    return hasher


@pytest.mark.parametrize(
    ("how", "proven"),
    [
        ("in order", {"m.gguf"}),
        ("out of order", set()),
        ("copied", set()),
        ("changed after", set()),
    ],
)
def test_a_file_is_proven_only_when_the_streamed_bytes_are_the_final_files(
    tmp_path: Path, how: str, proven: set[str]
) -> None:
    assert _download(tmp_path, how).finish() == proven


def test_files_without_an_lfs_id_or_already_verified_are_not_followed(tmp_path: Path) -> None:
    files = [
        HubFile(path="README.md", size=1, gitOid="g"),
        HubFile(path="m.gguf", size=1, sha256=SHA, gitOid="g", verified=True),
    ]
    hasher = StreamHasher(tmp_path, files)
    (tmp_path / PARTIALS).mkdir(parents=True)
    (tmp_path / PARTIALS / f"x.{SHA}.incomplete").write_bytes(DATA)
    hasher.poll()
    assert hasher.finish() == set()
