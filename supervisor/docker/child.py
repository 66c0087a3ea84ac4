"""The build and pull child process, both sides: start, relay, kill; and stream docker's output.

A plain child process (not multiprocessing, whose resource tracker would outlive the build by
the worker's whole life, 13 MB of it): the job in on stdin, JSON lines out. Killing the child
closes its connection; dockerd then cancels the build.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any, Final

import docker
import docker.errors
import requests.exceptions
from docker.utils import parse_repository_tag

from supervisor.docker.client import api_client
from supervisor.docker.spec import BuildRequest
from supervisor.errors import Cancelled

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PullRequest:
    ref: str


# --- the parent's side ----------------------------------------------------------------------


def run(
    base_url: str | None,
    job: BuildRequest | PullRequest,
    *,
    lines: list[str],
    progress: Progress,
    cancel: threading.Event,
    what: str,
) -> tuple[str, str]:
    """Run the job in a child process and relay its lines (the last 50 kept in lines): how it
    ended, ("done" | "error" | "unavailable", text). A cancel kills the child: Cancelled."""
    child = subprocess.Popen(
        [sys.executable, "-m", "supervisor.docker.child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(_encode_job(base_url, job))
        child.stdin.close()
        return _receive(child.stdout, lines=lines, progress=progress, cancel=cancel, what=what)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)
        child.stdout.close()


def _receive(
    stream: IO[bytes],
    *,
    lines: list[str],
    progress: Progress,
    cancel: threading.Event,
    what: str,
) -> tuple[str, str]:
    """Relay the child's lines until it says how the build ended; cancel is checked 5x/s."""
    fd, pending = stream.fileno(), b""
    while not cancel.is_set():
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return "unavailable", "the build ended without an answer from docker"
        *complete, pending = (pending + chunk).split(b"\n")
        for raw in complete:
            kind, text = json.loads(raw)
            if kind != "line":
                return str(kind), str(text)
            lines.append(text)
            del lines[:-50]
            progress(text)
    raise Cancelled(f"{what} cancelled")


def _encode_job(base_url: str | None, job: BuildRequest | PullRequest) -> bytes:
    kind = "pull" if isinstance(job, PullRequest) else "build"
    return json.dumps({"base_url": base_url, "kind": kind, "job": asdict(job)}).encode()


def _decode_job(data: bytes) -> tuple[str | None, BuildRequest | PullRequest]:
    message = json.loads(data)
    job_type = PullRequest if message["kind"] == "pull" else BuildRequest
    return message["base_url"], job_type(**message["job"])


# --- the child's side -----------------------------------------------------------------------


# dockerd's words for a registry that did not answer (Go's net errors; a 5xx of the registry):
# it may answer later, unlike a refusal such as "manifest unknown"
_REGISTRY_DOWN: Final = re.compile(
    r"connection refused|i/o timeout|no route to host|network is unreachable"
    r"|connection reset|TLS handshake timeout|Client\.Timeout|unexpected EOF"
    r"|HTTP status: 5\d\d|toomanyrequests",
    re.IGNORECASE,
)


def _send(kind: str, text: str) -> None:
    sys.stdout.write(json.dumps([kind, text]) + "\n")
    sys.stdout.flush()


def _failed(job: BuildRequest | PullRequest, text: str) -> None:
    """A pull from a registry that did not answer may work later; any other failure will not."""
    unreachable = isinstance(job, PullRequest) and _REGISTRY_DOWN.search(text) is not None
    _send("unreachable" if unreachable else "error", text)


def _child(base_url: str | None, job: BuildRequest | PullRequest) -> None:
    """Runs in the child process: stream a build's or a pull's output lines to the parent."""
    try:
        api = api_client(base_url, None)
        for chunk in _stream(api, job):
            if "error" in chunk:
                _failed(job, str(chunk.get("error", "")).strip())
                return
            text = chunk.get("stream") or _pull_line(chunk)
            for line in str(text).splitlines():
                if line.strip():
                    _send("line", line.rstrip())
        _send("done", "")
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        _send("unavailable", type(exc).__name__)
    except docker.errors.APIError as exc:
        _failed(job, str(exc.explanation or exc))
    except (docker.errors.DockerException, OSError, TypeError) as exc:
        _send("error", f"{type(exc).__name__}: {exc}")


def _stream(api: docker.APIClient, job: BuildRequest | PullRequest) -> Iterator[dict[str, Any]]:
    if isinstance(job, PullRequest):
        repository, tag = parse_repository_tag(job.ref)
        return iter(api.pull(repository, tag=tag or "latest", stream=True, decode=True))
    common: dict[str, Any] = {
        "tag": job.tag,
        "labels": dict(job.labels),
        "buildargs": dict(job.build_args),
        "nocache": job.nocache,
        "rm": True,
        "forcerm": True,
        "decode": True,
    }
    if job.dockerfile_text is not None:
        return iter(
            api.build(fileobj=_context_tar(job.dockerfile_text), custom_context=True, **common)
        )
    return iter(api.build(path=job.context, dockerfile=job.dockerfile, **common))


def _pull_line(chunk: dict[str, Any]) -> str:
    """A pull's progress as one line: "<layer>: Downloading 12.3MB/40.1MB"."""
    status = str(chunk.get("status") or "")
    layer = str(chunk.get("id") or "")
    detail = chunk.get("progressDetail") or {}
    if detail.get("total"):
        status += f" {detail.get('current', 0) / 1e6:.1f}MB/{detail['total'] / 1e6:.1f}MB"
    return f"{layer}: {status}" if layer else status


def _context_tar(dockerfile_text: str) -> io.BytesIO:
    buffer = io.BytesIO()
    data = dockerfile_text.encode()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


if __name__ == "__main__":  # the build and pull child: python -m supervisor.docker.child
    _child(*_decode_job(sys.stdin.buffer.read()))
