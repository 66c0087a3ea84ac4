"""The build and pull child process, both sides, as real processes against an absent daemon.

The builds and pulls that reach the real dockerd are proven by the integration tests (the
tensorfold builds, the router's image pull); these cover what needs no daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from supervisor.docker import child
from supervisor.docker.child import PullRequest
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import BuildRequest
from supervisor.errors import Cancelled, Transient


@pytest.fixture
def nowhere(tmp_path: Path) -> str:
    """A docker socket address where nothing listens."""
    return f"unix://{tmp_path / 'docker.sock'}"


def test_the_child_entry_answers_in_json_lines(nowhere: str) -> None:
    job = {"base_url": nowhere, "kind": "pull", "job": {"ref": "busybox:1"}}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.docker.child"],
        input=json.dumps(job).encode(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    answers = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(answers) == 1
    kind, text = answers[0]
    assert kind == "error"
    assert "Error while fetching server API version" in text


def test_the_parent_relays_how_the_child_ended(nowhere: str) -> None:
    lines: list[str] = []
    progress: list[str] = []
    request = BuildRequest(tag="lucia-test-child:1", labels={}, dockerfile_text="FROM scratch\n")
    kind, text = child.run(
        nowhere,
        request,
        lines=lines,
        progress=progress.append,
        cancel=threading.Event(),
        what="build of lucia-test-child:1",
    )
    assert (kind, lines, progress) == ("error", [], [])
    assert text.startswith("DockerException: ")


def test_a_cancel_ends_the_child_with_cancelled(nowhere: str) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled, match="pull of busybox:1 cancelled"):
        child.run(
            nowhere,
            PullRequest("busybox:1"),
            lines=[],
            progress=lambda _line: None,
            cancel=cancel,
            what="pull of busybox:1",
        )


def test_the_runtime_turns_an_absent_daemon_into_transient(nowhere: str) -> None:
    with pytest.raises(Transient, match="docker is unavailable"):
        Runtime(nowhere).pull("busybox:1", lambda _line: None, threading.Event())
