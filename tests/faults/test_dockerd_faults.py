"""dockerd itself as the fault: restarted while an engine runs and while one builds, and stalled
(SIGSTOP) while a request is observed and while an engine serves. The worker survives, its
heartbeat keeps its interval, and its status tells the truth.

These faults stop or freeze a dockerd, and the machine's serves the operator too (a dockerd
without live-restore stops every container when it stops): so they run their engines on a
dockerd of the tests' own (tests/dockerd.py's `Private`), and the machine's is never signalled.
The cases still run alone: the heartbeat's timing is what they measure.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests import dockerd
from tests.fixtures import RUN_ID, TEST_LABEL, Engine, EngineFactory, RecipeRepo, age
from tests.gguf_fixtures import add_model, write_llama
from tests.standin import busybox_image, free_port

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def private_dockerd() -> Iterator[dockerd.Private]:
    with dockerd.private(RUN_ID) as daemon:
        yield daemon


@pytest.fixture(autouse=True)
def _on_the_private_dockerd(
    private_dockerd: dockerd.Private, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every docker client of the case, and every worker it starts, use the private dockerd."""
    for name, value in private_dockerd.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def private_client(private_dockerd: dockerd.Private) -> Iterator[docker.DockerClient]:
    with contextlib.closing(private_dockerd.client()) as cli:
        yield cli


@pytest.fixture(scope="module")
def private_base(
    private_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> str:
    return busybox_image(
        private_client,
        tmp_path_factory.mktemp("private-base"),
        f"lucia-test-busybox-{RUN_ID}:1",
        {TEST_LABEL: RUN_ID},
    )


@pytest.fixture(scope="module")
def private_router_image(
    private_dockerd: dockerd.Private, client: docker.DockerClient, llama_server_image: str
) -> str:
    """The real llama-server image, copied from the machine's dockerd."""
    private_dockerd.load(client, llama_server_image)
    return llama_server_image


@pytest.fixture
def make_engine(
    private_dockerd: dockerd.Private,
    private_client: docker.DockerClient,
    private_base: str,
    recipe_repo: RecipeRepo,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Engine]]:
    """tests/fixtures.py's make_engine, on the private dockerd."""
    factory = EngineFactory(private_client, private_base, tmp_path, lambda: recipe_repo, request)

    def make(**overrides: Any) -> Engine:
        if overrides.get("kind") == "llama-router" and not overrides.get("router_image"):
            overrides["router_image"] = request.getfixturevalue("private_router_image")
        env = {**private_dockerd.env(), **(overrides.pop("env", None) or {})}
        return factory(env=env, **overrides)

    yield make
    factory.close()


def _machine_bridge(client: docker.DockerClient) -> Path:
    """The machine's dockerd's default bridge interface (docker0)."""
    options = client.networks.get("bridge").attrs["Options"]
    return Path("/sys/class/net") / options.get("com.docker.network.bridge.name", "docker0")


def _ours(client: docker.DockerClient, engine: Engine) -> list:
    return client.containers.list(all=True, filters={"label": f"lucia.name={engine.name}"})


def test_the_machines_dockerd_is_not_the_one_the_faults_hit(
    private_dockerd: dockerd.Private,
    private_client: docker.DockerClient,
    client: docker.DockerClient,
) -> None:
    """The private dockerd is another daemon: its own root, containers, and default bridge in a
    network namespace of its own, no live-restore; the machine's default bridge is still there
    (a second dockerd in the machine's namespace deletes it, and the machine's builds fail)."""
    assert private_client.info()["DockerRootDir"] != client.info()["DockerRootDir"]
    assert _machine_bridge(client).exists()
    assert (
        private_client.networks.get("bridge").attrs["Options"].get("com.docker.network.bridge.name")
        == private_dockerd.bridge
    )
    assert not Path(f"/sys/class/net/{private_dockerd.bridge}").exists()  # not in the host's
    assert not private_client.info().get("LiveRestoreEnabled")
    machine = {c.id for c in client.containers.list(all=True)}
    assert machine.isdisjoint(c.id for c in private_client.containers.list(all=True))
    assert os.environ["DOCKER_HOST"] == private_dockerd.host


@pytest.mark.alone  # the heartbeat's timing is measured
def test_dockerd_restart_while_running_and_while_building(
    make_engine, private_dockerd, private_client, client
) -> None:
    machine_bridge = _machine_bridge(client)
    client = private_client
    engine: Engine = make_engine()
    proc, status = engine.up()
    assert not client.info().get("LiveRestoreEnabled"), "these tests need live-restore off"
    private_dockerd.restart()
    assert machine_bridge.exists(), "the restart took the machine's default bridge"
    # without live-restore, dockerd stops its containers: the truth is that the engine died
    after = engine.wait_status(
        lambda s: s["state"] == "failed" and s["checkedAt"] > status["checkedAt"], timeout=60
    )
    assert "exited with code" in after["message"]
    assert client.containers.get(engine.container).status == "exited"
    assert engine.file_sd() == []
    assert proc.poll() is None, "the worker must survive a dockerd restart"

    slow: Engine = make_engine(build_args={"SLOW": "15"})  # dockerd's restart takes seconds
    slow_proc = slow.start_worker()
    generation = slow.request("running")
    slow.wait_status(lambda s: "compiling kernels" in s["message"], timeout=60)
    private_dockerd.restart()
    final = slow.wait_state(generation, "running", timeout=180)
    assert final["url"]
    assert slow_proc.poll() is None
    assert len(_ours(client, slow)) == 1


@pytest.mark.alone  # the heartbeat's timing is measured
def test_a_stalled_dockerd_never_stalls_the_heartbeat(
    make_engine, private_dockerd, private_client
) -> None:
    """dockerd stopped with SIGSTOP for 25 s while a new request is observed: the loop stays
    alive, the heartbeat keeps its interval, the status says docker did not answer, and the
    request is answered once dockerd resumes. The engine, never touched, keeps serving."""
    engine: Engine = make_engine()
    proc, status = engine.up()
    container = private_client.containers.get(engine.container).id
    with private_dockerd.stalled():
        generation = engine.request("running")  # observed while dockerd cannot answer
        ages, messages = [], set()
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            current = engine.status()
            if current is not None:
                ages.append(age(current))
                messages.add(current["message"])
            assert proc.poll() is None, "the worker died while dockerd was stalled"
            time.sleep(0.2)
        with urllib.request.urlopen(f"{status['url']}/v1/models", timeout=5) as response:
            assert response.status == 200, "the engine stopped serving"
    assert max(ages) < 4.0, f"heartbeat age reached {max(ages):.1f} s (interval 2 s)"
    assert any("docker did not answer within" in m for m in messages), messages
    final = engine.wait_state(generation, "running", timeout=90)
    assert final["engine"]["containerId"] == container
    assert proc.poll() is None


# -- issue 19: a stall never turns a serving engine into starting --

_CLIENT_TIMEOUT = 30.0  # supervisor/docker/runtime.py's _API_TIMEOUT
_POLL = 30.0  # tensorfold's observation interval (ContainerEngine.poll_interval)


def _serving(make_engine, kind: str) -> Engine:
    if kind == "llama-router":  # the real llama-server, observed every second (poll_seconds)
        engine: Engine = make_engine(kind="llama-router", load_on_startup=("tiny",))
        write_llama(add_model(engine.models_dir, "Ready") / "tiny.gguf")
        return engine
    return make_engine(layout="real")  # the shipped recipe, observed every 30 s


def _reconciles(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("lucia_worker_reconciles_total "):
                return float(line.split()[1])
    raise AssertionError("the worker has no lucia_worker_reconciles_total")


@pytest.mark.alone  # the heartbeat's timing is measured
@pytest.mark.parametrize("kind", ["tensorfold", "llama-router"])
def test_a_docker_stall_never_turns_a_serving_engine_into_starting(
    make_engine, private_dockerd, kind: str
) -> None:
    """dockerd stopped with SIGSTOP until an observation has both been overdue (10 s) and run
    into the docker client's timeout (30 s), and its retry: every status sample meanwhile says
    `running` for the served generation, with its url, engine and file_sd target, and a message
    saying docker does not answer. Was (issue 19): `starting`, from the client's timeout on."""
    engine = _serving(make_engine, kind)
    metrics = free_port()
    engine.start_worker("--metrics-port", str(metrics))
    generation = engine.request("running")
    served = engine.wait_state(generation, "running", timeout=180)
    targets = engine.file_sd()
    assert targets
    if kind == "tensorfold":  # stall just before the next observation is due
        # the observation that saw it running was the last one, but for any made just after:
        # the next is due _POLL after it (a stall begun earlier only lasts longer)
        count, observed = _reconciles(metrics), time.monotonic()
        settle = observed + 3
        while time.monotonic() < settle:
            if (now := _reconciles(metrics)) != count:
                count, observed = now, time.monotonic()
            time.sleep(0.2)
        time.sleep(max(0.0, observed + _POLL - 3 - time.monotonic()))
    samples: list[dict] = []
    with private_dockerd.stalled():
        deadline = time.monotonic() + _POLL + _CLIENT_TIMEOUT + 15
        while time.monotonic() < deadline:
            current = engine.status()
            if current is not None:
                samples.append(current)
                if "retrying in" in current["message"]:
                    break  # the client's timeout arrived, and was answered
            time.sleep(0.2)
        after = time.monotonic() + 3  # a few samples after the retry's answer
        while time.monotonic() < after:
            current = engine.status()
            if current is not None:
                samples.append(current)
            time.sleep(0.2)
        sd_during = engine.file_sd()
    messages = {s["message"] for s in samples}
    assert any("docker did not answer within" in m for m in messages), messages
    assert any("docker does not answer" in m and "retrying in" in m for m in messages), messages
    wrong = [
        s
        for s in samples
        if (s["generation"], s["state"]) != (generation, "running")
        or s["url"] != served["url"]
        or s["engine"] != served["engine"]
    ]
    assert not wrong, wrong[:3]
    assert sd_during == targets
    final = engine.wait_status(
        lambda s: s["message"].startswith("serving at ") and "docker" not in s["message"],
        timeout=90,
    )
    assert (final["generation"], final["state"]) == (generation, "running")
