"""The KV tier layer built by the supervisor install.sh installed, as its user would run it.

install.sh installs the project into the service user's venv (not editable); the tier image
build then reads the plugin that shipped with that package and builds `<base>-tiers` through
`Runtime.build` against the real dockerd. The base is the vLLM stand-in (tests/vllm-standin),
whose python3 plays the build's import check by looking where the plugin was copied. The
installed supervisor runs isolated (`python -I`, from its home): the checkout is not on its path.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from supervisor.docker.labels import TIERS_BASE, TIERS_DIGEST, TIERS_VERSION
from supervisor.engines.vllm import tier_image
from tests.standin import ROOT, busybox_image
from tests.system.harness import RUN_ID, Installation, as_user

pytestmark = pytest.mark.system

# Run by the installed venv's python as the service user: the full build the worker runs.
BUILD = """
import json, sys, threading
from pathlib import Path
import supervisor
from supervisor.docker.runtime import Runtime
from supervisor.engines.base import StepContext
from supervisor.engines.vllm import tier_image
base_ref, work = sys.argv[1], Path(sys.argv[2])
lines = []
ctx = StepContext(threading.Event(), lines.append)
image = tier_image.build(Runtime(), base_ref, work, ctx)
plugin = tier_image.read_plugin()
print(json.dumps({"supervisor": supervisor.__file__, "source": str(tier_image.SOURCE),
                  "version": plugin.version, "digest": tier_image.digest(plugin),
                  "image": image.id, "lines": lines}))
"""


@pytest.fixture(scope="module")
def standin_base(
    docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    busybox = f"lucia-systest-tiers-busybox-{RUN_ID}:1"
    base = f"lucia-systest-tiers-vllm-{RUN_ID}:v0.32.0"
    busybox_image(docker_client, tmp_path_factory.mktemp("busybox") / "context", busybox)
    docker_client.images.build(
        path=str(ROOT / "tests" / "vllm-standin"), tag=base, rm=True, buildargs={"BASE": busybox}
    )
    yield base
    for ref in (tier_image.tag(base), base, busybox):
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(ref, force=True)


def test_the_installed_supervisor_builds_the_tier_layer_from_the_plugin_it_shipped_with(
    installation: Installation, standin_base: str, docker_client: docker.DockerClient
) -> None:
    venv = installation.share / "venv"
    work = installation.source.parent / "tier-build"
    result = as_user(
        str(venv / "bin" / "python"), "-I", "-c", BUILD, standin_base, str(work), check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    built = json.loads(result.stdout.splitlines()[-1])
    # the installed package, not the checkout: its own supervisor and the plugin beside it
    assert Path(built["supervisor"]).is_relative_to(venv), built["supervisor"]
    assert Path(built["source"]).is_relative_to(venv), built["source"]
    assert not Path(built["source"]).is_relative_to(ROOT)
    # one version and one digest: the installed copy's are the source tree's
    source = tier_image.read_plugin()
    assert (built["version"], built["digest"]) == (source.version, tier_image.digest(source))
    image = docker_client.images.get(tier_image.tag(standin_base))
    assert image.id == built["image"]
    base_id = str(docker_client.images.get(standin_base).id)
    assert image.labels[TIERS_BASE] == base_id
    assert image.labels[TIERS_VERSION] == source.version
    assert image.labels[TIERS_DIGEST] == tier_image.digest(source)
    assert tier_image.current(source, base_id, image.labels)
    checked = f"lucia-kv-tiers {source.version} imports beside vllm 0.32.0"
    assert any(checked in line for line in built["lines"]), built["lines"][-10:]
    assert not work.exists() or not any(work.iterdir()), "the build context is removed"
