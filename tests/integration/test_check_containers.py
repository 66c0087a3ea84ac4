"""The throwaway check container (Runtime.run_once) against the real dockerd: what a worker
killed mid-check or a dockerd restart left behind is removed by the next check of the same
engine, and no other engine's is touched."""

from __future__ import annotations

import docker
import pytest

from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from tests.fixtures import RUN_ID, TEST_LABEL

pytestmark = pytest.mark.docker


def _checks(client: docker.DockerClient, name: str) -> list[str]:
    found = client.containers.list(
        all=True, filters={"label": [f"{labels.NAME}={name}", f"{labels.MANAGED}=check"]}
    )
    return [str(c.id) for c in found]


def test_a_check_removes_the_check_containers_left_behind(client, base_image) -> None:
    name, other = f"t{RUN_ID}-check", f"t{RUN_ID}-check-other"

    def leftover(engine: str, command: list[str]) -> str:
        marks = {labels.NAME: engine, labels.MANAGED: "check", TEST_LABEL: RUN_ID}
        made = client.containers.create(base_image, command, labels=marks)
        made.start()
        return str(made.id)

    exited = leftover(name, ["true"])
    running = leftover(name, ["sleep", "600"])  # its worker was SIGKILLed mid-check
    theirs = leftover(other, ["true"])
    assert set(_checks(client, name)) == {exited, running}
    code, tail = Runtime().run_once(
        base_image, "sh", ["-c", "echo checked; exit 3"], 30, {labels.NAME: name}
    )
    assert (code, tail) == (3, ["checked"])
    assert _checks(client, name) == []  # the leftovers and its own check container are gone
    assert _checks(client, other) == [theirs]
