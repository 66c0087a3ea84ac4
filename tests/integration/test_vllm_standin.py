"""The busybox stand-in of vllm/vllm-openai, run directly with the real dockerd: its entrypoint,
the arguments the preflight builds, its routes, and the arguments it refuses."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import docker
import pytest

from supervisor.engines.vllm import preflight as pf
from supervisor.hw.gpu import CudaVersion, Gpu, GpuFacts
from tests.fixtures import ROOT, RUN_ID, TEST_LABEL

pytestmark = pytest.mark.docker

STANDIN = ROOT / "tests" / "vllm-standin"


@pytest.fixture(scope="module")
def standin_image(client: docker.DockerClient, base_image: str) -> str:
    tag = f"lucia-test-vllm-{RUN_ID}:0.32.0"
    client.images.build(
        path=str(STANDIN),
        tag=tag,
        rm=True,
        buildargs={"BASE": base_image},
        labels={TEST_LABEL: RUN_ID},
    )
    return tag


@pytest.fixture
def run(client: docker.DockerClient, standin_image: str) -> Iterator[Any]:
    started: list[Any] = []

    def start(args: tuple[str, ...], **env: str) -> Any:
        container = client.containers.run(
            standin_image,
            list(args),
            detach=True,
            environment=env,
            labels={TEST_LABEL: RUN_ID},
            ports={"8000/tcp": ("127.0.0.1", None)},
        )
        started.append(container)
        return container

    yield start
    for container in started:
        container.remove(force=True)


def url(container: Any, path: str) -> str:
    container.reload()
    port = container.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"]
    return f"http://127.0.0.1:{port}{path}"


def get(container: Any, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url(container, path), timeout=5) as answer:
        return answer.status, answer.read()


def wait_healthy(container: Any, timeout: float = 30) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if get(container, "/health")[0] == 200:
                return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"not healthy in {timeout}s: {container.logs().decode()[-2000:]}")


H100 = GpuFacts(
    (Gpu(0, "NVIDIA H100 80GB HBM3", (9, 0), 81559, 81559, "580.95.05"),), CudaVersion(13, 0)
)


def launch(**kw: Any) -> pf.Launch:
    choices = pf.Choices(
        channel="stable",
        quantization="fp8",
        memory_share=90,
        model="org/model",
        revision="a" * 40,
        served_name="served-1",
        max_model_len=8192,
        **kw,
    )
    result = pf.decide(choices, H100)
    assert isinstance(result, pf.Launch)
    return result


def test_the_preflights_arguments_serve_the_routes(run: Any) -> None:
    args = launch().args
    container = run(args, LOAD_DELAY="2")
    time.sleep(0.5)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        get(container, "/health")  # like vLLM: nothing listens while the model loads
    assert wait_healthy(container) > 1.0
    status, body = get(container, "/health")
    assert (status, body) == (200, b"")
    models = json.loads(get(container, "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["served-1"]
    assert models["data"][0]["max_model_len"] == 8192 and models["data"][0]["root"] == "org/model"
    assert json.loads(get(container, "/version")[1]) == {"version": "0.32.0"}
    metrics = get(container, "/metrics")[1].decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:generation_tokens_total",
    ):
        assert f'{name}{{engine="0",model_name="served-1"}} 0.0' in metrics
    logs = container.logs().decode()
    assert "gpu_memory_utilization=0.90" in logs and "quantization='fp8'" in logs
    assert "enable_prefix_caching=true" in logs and "revision='" + "a" * 40 in logs


def test_the_entrypoint_is_vllm_serve(client: docker.DockerClient, standin_image: str) -> None:
    config = client.images.get(standin_image).attrs["Config"]
    assert config["Entrypoint"] == ["/usr/local/bin/vllm", "serve"]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("org/model", "--no-such-flag"), 2, "unrecognized arguments: --no-such-flag"),
        (("serve", "org/model"), 2, "unrecognized arguments: org/model"),  # `vllm serve serve`
        (("org/model", "--gpu-memory-utilization", "90"), 1, "must be within (0, 1]"),
        (("org/model", "--quantization", "int3"), 2, "invalid choice: 'int3'"),
        ((), 2, "required: model_tag"),
    ],
)
def test_refused_arguments_exit_like_vllm(
    run: Any, args: tuple[str, ...], code: int, needle: str
) -> None:
    container = run(args)
    assert container.wait(timeout=30)["StatusCode"] == code
    assert needle in container.logs().decode()


def test_death_while_loading_and_while_serving(run: Any) -> None:
    loading = run(launch().args, FAIL_LOAD="3")
    assert loading.wait(timeout=30)["StatusCode"] == 3
    serving = run(launch().args)
    wait_healthy(serving)
    serving.exec_run(["sh", "-c", "echo 137 > /tmp/die"])
    assert serving.wait(timeout=30)["StatusCode"] == 137


def test_sigterm_stops_it_cleanly(run: Any) -> None:
    container = run(launch().args)
    wait_healthy(container)
    container.stop(timeout=10)
    assert container.wait(timeout=30)["StatusCode"] == 0
