"""scripts/llama-server-image.sh on this machine's dockerd (root): the image it keeps is one it
built, in its own repository, never an image built FROM one, which inherits its version label.

Was: the script took any image with the label, the newest. A test's router image (the
llama-server image under another tag and a label of its own), left by a run that was cut off,
became the machine's llama-server image, and the demo's router was replaced onto it mid-run.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import time
from pathlib import Path

import docker
import pytest

from tests.fixtures import ROOT, RUN_ID, TEST_LABEL

pytestmark = pytest.mark.docker

SCRIPT = ROOT / "scripts" / "llama-server-image.sh"


def test_an_image_built_from_the_scripts_image_is_never_taken_for_it(
    client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.fail("scripts/llama-server-image.sh runs as root; run this test as root")
    label = f"lucia.test.llama-server.version-{RUN_ID}"
    repository = f"lucia-test-llama-server-kept-{RUN_ID}"
    own, derived = f"{repository}:1_0.1_test-1", f"lucia-test-from-llama-{RUN_ID}:1"
    client.images.build(
        fileobj=io.BytesIO(f"FROM {base_image}\n".encode()),
        tag=own,
        rm=True,
        labels={TEST_LABEL: RUN_ID, label: "1:0.1+test-1"},
    )
    time.sleep(1.1)  # an image's CreatedAt counts seconds: the derived one is the newer
    client.images.build(
        fileobj=io.BytesIO(f"FROM {own}\n".encode()),
        tag=derived,
        rm=True,
        labels={TEST_LABEL: RUN_ID, "version": "2"},
    )
    try:
        assert client.images.get(derived).labels[label] == "1:0.1+test-1"  # inherited
        done = subprocess.run(
            ["bash", str(SCRIPT)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
            env={
                **os.environ,
                "LUCIA_LLAMA_LABEL": label,
                "LUCIA_LLAMA_REPOSITORY": repository,
                # nothing listens on the discard port: the image built before is kept
                "LUCIA_LLAMA_MIRROR": "http://127.0.0.1:9/debian",
                "LUCIA_LLAMA_CACHE": str(tmp_path / "apt"),
            },
        )
        assert done.returncode == 0, done.stderr
        assert "keeping the image built before" in done.stderr
        assert done.stdout.splitlines()[-1] == own, done.stdout
        assert client.images.get(derived).tags == [derived]
    finally:
        for tag in (derived, own):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag, force=True)
