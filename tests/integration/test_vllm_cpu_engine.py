"""The vllm engine on a CPU server through the worker, against the real vLLM 0.32.0 CPU server:
it runs, answers a completion on the gateway address, status.json names what runs, and Debian's
Prometheus scrapes it through the worker's file_sd with up == 1 (one load for the three); a recipe
whose memory does not fit the machine is refused before anything is pulled or started.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker import labels
from tests.fixtures import RUN_ID, Engine
from tests.system.harness import prometheus_query, prometheus_targets, running_prometheus, wait_for
from tests.vllm_cpu import library_revision

pytestmark = pytest.mark.docker


def _complete(url: str, prompt: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        ).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200
        return dict(json.loads(answer.read()))


def test_the_real_cpu_server_runs_answers_on_the_gateway_and_status_names_it(
    make_engine: Callable[..., Engine], client: docker.DockerClient, tmp_path: Path
) -> None:
    engine: Engine = make_engine(kind="vllm", vllm_device="cpu")
    with running_prometheus(engine.data_dir / "telemetry", tmp_path) as prometheus:
        engine.start_worker()
        status = engine.wait_state(engine.request("running"), "running", timeout=900)
        _answers_on_the_gateway(engine, client, status)
        _names_what_runs(engine, client, status)
        _scraped_by_prometheus(engine, prometheus, status)
    engine.request("stopped")
    assert engine.wait_status(lambda s: s["state"] == "stopped", timeout=120)["engine"] is None


def _answers_on_the_gateway(
    engine: Engine, client: docker.DockerClient, status: dict[str, Any]
) -> None:
    network = client.networks.get(engine.network)
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    assert status["url"] == f"http://{gateway}:{engine.port}"
    first = _complete(status["url"], "the quick brown fox")
    (choice,) = first["choices"]
    assert first["model"] == "tiny" and choice["finish_reason"] == "length", first
    assert first["usage"]["completion_tokens"] == 6 and choice["text"], first
    assert _complete(status["url"], "the quick brown fox")["choices"][0]["text"] == choice["text"]


def _names_what_runs(engine: Engine, client: docker.DockerClient, status: dict[str, Any]) -> None:
    container = client.containers.get(engine.container)
    running = status["engine"]
    assert running["image"] == engine.vllm_image
    assert running["imageId"] == container.attrs["Image"]
    assert engine.vllm_image in client.images.get(running["imageId"]).tags
    assert running["containerId"] == container.id
    assert running["model"] == "tiny-llama"
    assert running["engineVersion"] == "0.32.0"  # what the server's /version says
    # what it runs at once: vLLM 0.32.0's own max_num_seqs on a CPU, as its debug log says
    # ("Defaulting max_num_seqs to 128 for OPENAI_API_SERVER usage context")
    assert status["slots"] == {"tiny": 128}
    files = engine.models_dir / engine.vllm_guid / "files"
    assert running["modelRevision"] == library_revision(files, engine.vllm_guid), running
    assert container.labels[labels.MODEL_REVISION] == running["modelRevision"]
    # the model is the library copy, mounted read-only where --model points
    (mount,) = [m for m in container.attrs["Mounts"] if m["Source"] == str(files)]
    assert mount["RW"] is False
    args = container.attrs["Args"]
    assert args[args.index("--model") + 1] == mount["Destination"]


def _scraped_by_prometheus(engine: Engine, prometheus: str, status: dict[str, Any]) -> None:
    """Debian's Prometheus, reading the worker's file_sd, scrapes the server's /metrics."""
    (group,) = engine.file_sd()
    assert group["targets"] == [urllib.parse.urlsplit(status["url"]).netloc]

    def up() -> list[dict[str, Any]]:
        found = prometheus_targets(prometheus, engine.name)
        return found if len(found) == 1 and found[0]["health"] == "up" else []

    (target,) = wait_for(up, 60, "the vLLM target up")
    assert target["labels"]["engine"] == "vllm"
    assert target["labels"]["served_name"] == "tiny"
    assert target["scrapeUrl"] == status["url"] + "/metrics"
    assert wait_for(
        lambda: (
            prometheus_query(prometheus, f'up{{name="{engine.name}"}}') == {"tiny-llama": "1"}
            or None
        ),
        30,
        "up == 1",
    )
    assert wait_for(
        lambda: (
            prometheus_query(prometheus, f'vllm:prefix_cache_hits_total{{name="{engine.name}"}}')
            or None
        ),
        30,
        "a vllm: series",
    )


def test_a_cpu_recipe_over_the_machine_limit_is_refused_before_any_pull(
    make_engine: Callable[..., Engine], client: docker.DockerClient, tmp_path: Path
) -> None:
    machine = tmp_path / "machine.toml"
    machine.write_text('limit = 2.0\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    absent = f"lucia-test-vllm-cpu-absent-{RUN_ID}:none"  # a pull would fail, saying so
    engine: Engine = make_engine(
        kind="vllm", vllm_device="cpu", vllm_image=absent, env={"LUCIA_MACHINE_FILE": str(machine)}
    )
    engine.start_worker()
    failed = engine.wait_state(engine.request("running"), "failed", timeout=120)
    assert failed["message"] == (
        "The model tiny-llama does not fit after voice, OS, services, and runtime reservations: "
        "needs 4.0 GiB, 2.0 GiB left (limit 2.0, reserves 0.0). Lower run.memory."
    ), failed
    assert "pull" not in engine.log_tail(200).lower()
    assert client.containers.list(all=True, filters={"name": engine.container}) == []
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(absent)
