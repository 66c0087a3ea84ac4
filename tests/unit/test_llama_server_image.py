"""scripts/llama-server-image.sh's reading of a root file system's dpkg status
(`--rootfs-version TAR`, the code path every first build takes), without root or Docker."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = ROOT / "scripts" / "llama-server-image.sh"
VERSION = "7.0.0+dfsg-1"


def stanza(package: str, version: str) -> str:
    return (
        f"Package: {package}\nStatus: install ok installed\nPriority: optional\n"
        f"Architecture: amd64\nVersion: {version}\nDescription: {package}, for the test\n"
        " a line of its long description, as dpkg keeps it\n\n"
    )


def rootfs(path: Path, status: str | None) -> Path:
    """A root file system tar laid out as mmdebstrap writes it (members named ./...)."""
    with tarfile.open(path, "w") as tar:
        members = {"./etc/debian_version": "forky/sid\n"}
        if status is not None:
            members["./var/lib/dpkg/status"] = status
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_version_is_read_from_a_status_file_far_larger_than_a_pipe(tmp_path: Path) -> None:
    # the package comes first and thousands follow: a reader that exits at its match leaves
    # tar writing into a closed pipe (SIGPIPE, exit 141, under the script's pipefail)
    others = "".join(stanza(f"lib-filler-{i}", f"1.{i}-1") for i in range(20000))
    status = stanza("llama.cpp-tools", VERSION) + others
    assert len(status) > 60 * 65536  # a pipe holds 64 KiB
    done = run("--rootfs-version", str(rootfs(tmp_path / "rootfs.tar", status)))
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{VERSION}\n", "")


def test_only_the_package_s_own_stanza_counts(tmp_path: Path) -> None:
    status = (
        stanza("llama.cpp-tools-extra", "9.9-9")
        + stanza("libllama0", "8.8-8")
        + stanza("llama.cpp-tools", VERSION)
        + stanza("zlib1g", "1:1.3-1")
    )
    done = run("--rootfs-version", str(rootfs(tmp_path / "rootfs.tar", status)))
    assert (done.returncode, done.stdout) == (0, f"{VERSION}\n")


def test_a_status_without_the_package_is_an_error_that_says_so(tmp_path: Path) -> None:
    tar = rootfs(tmp_path / "rootfs.tar", stanza("zlib1g", "1:1.3-1"))
    done = run("--rootfs-version", str(tar))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"llama-server-image.sh: the dpkg status in {tar} lists no llama.cpp-tools\n"
    )


def test_a_tar_without_a_dpkg_status_is_an_error_that_says_so(tmp_path: Path) -> None:
    tar = rootfs(tmp_path / "rootfs.tar", None)
    done = run("--rootfs-version", str(tar))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"llama-server-image.sh: {tar} has no ./var/lib/dpkg/status: ")
    assert "Not found in archive" in done.stderr


def test_an_unchecked_failure_names_the_line_the_command_and_its_exit(tmp_path: Path) -> None:
    # set -e would end the script without a word; the ERR trap says what failed
    tar = rootfs(tmp_path / "rootfs.tar", stanza("llama.cpp-tools", VERSION))
    done = run("--rootfs-version", str(tar), env={"TMPDIR": str(tmp_path / "missing")})
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("llama-server-image.sh: line "), done.stderr
    assert last.endswith(": `work=$(mktemp -d)` failed (exit 1)"), done.stderr


def test_a_wrong_use_is_refused_with_its_usage() -> None:
    done = run("--rootfs-version")
    assert done.returncode == 1
    assert done.stderr.startswith("llama-server-image.sh: usage: ")
