"""The probe against the real llama-server (a router serving one tiny llama model), through the
gateway's real process, with the official `openai` client and the page in a real browser.

The test plays the worker's side of the file protocol (status.json, with a heartbeat) for a
router it starts straight from docker. The fault is the real llama-server's own: the router's
child for the model is frozen (SIGSTOP), so the router still answers /health and lists the
model as loaded, while a generation gets no answer; the probe times out and the model is
`degraded` in /v1/models and on the page, until the child is let go (SIGCONT) and a probe
succeeds again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
from selenium.webdriver.common.by import By

from supervisor.host.protocol import request
from supervisor.protocol.documents import RunningEngine, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from tests.browser import chromium, engine, shot, sign_in, until
from tests.gateway_proc import Gateway, metric, running_gateway
from tests.gguf_fixtures import TinyLlama, write_llama
from tests.llama_server import LlamaRouter, Section
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

NAME = "probed"
MODEL = "alpha"
TIMEOUT_S = 10
SETTINGS = f"""[probe]
interval_s = 0.5
timeout_s = {TIMEOUT_S}
"""
HEARTBEAT_S = 5.0


@dataclass
class Served:
    router: LlamaRouter
    data: Path
    build: str  # the metrics' build label


def write_status(data: Path, router: LlamaRouter, running: RunningEngine) -> None:
    """What the router's worker writes while it serves (its heartbeat)."""
    now = utc_now()
    status = Status(
        generation=1,
        state="running",
        since=now.replace(microsecond=0, second=0, minute=0),
        message=f"serving at {router.url}",
        url=router.url,
        checked_at=now,
        models=(MODEL,),
        slots={MODEL: 1},
        engine=running,
    )
    write_atomic(ensure_dir(data / NAME) / "status.json", dump(status))


@pytest.fixture
def served(
    llama_router: Any,
    llama_server_image: str,
    client: docker.DockerClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("probe-llama")
    models = work / "models"
    models.mkdir()
    write_llama(models / f"{MODEL}.gguf", TinyLlama(context=512))
    router: LlamaRouter = llama_router(
        models, [Section(MODEL, f"{MODEL}.gguf", {"load-on-startup": True})]
    )
    router.wait_value(MODEL, "loaded")
    image = client.images.get(llama_server_image)
    running = RunningEngine(
        image=llama_server_image,
        image_id=str(image.id),
        container_id=str(router.container.id),
        model=MODEL,
    )
    data = ensure_dir(work / "data")
    request(data, NAME, "running", "operator")  # generation 1, as an operator asked
    stop = threading.Event()

    def heartbeat() -> None:
        while True:
            write_status(data, router, running)
            if stop.wait(HEARTBEAT_S):
                return

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        yield Served(router, data, f"unknown@{str(image.id).removeprefix('sha256:')[:12]}")
    finally:
        stop.set()
        beat.join()


@pytest.fixture
def gateway(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("probe-gateway"), served.data, SETTINGS) as gw:
        yield gw


def listed(gateway: Gateway) -> dict[str, Any]:
    """The model's entry in /v1/models, as the official client gives it."""
    (model,) = [m for m in gateway.client().models.list().data if m.id == MODEL]
    extra = model.model_extra or {}
    assert extra["engine"] == NAME
    return extra


def child_pid(router: LlamaRouter) -> int:
    """The host pid of the router's child that serves MODEL (docker top names its args)."""
    top = router.container.top(ps_args="-o pid,args")
    (pid,) = [int(p[0]) for p in top["Processes"] if f"--alias {MODEL}" in p[1]]
    return pid


def test_a_serving_engine_is_probed_recorded_and_measured(gateway: Gateway, served: Served) -> None:
    wait_for(lambda: listed(gateway)["probe"] is not None, 60, "a probe of the model")
    entry = listed(gateway)
    assert entry["degraded"] is False and entry["probe"]["degraded"] is False
    assert entry["probe"]["ttftS"] > 0
    at = {"engine": NAME, "model": MODEL, "build": served.build}
    exposed = gateway.metrics()
    assert metric(exposed, "lucia_gateway_probe_ttft_seconds_count", **at) >= 1, exposed
    assert metric(exposed, "lucia_gateway_probes_total", **at, outcome="ok") >= 1
    assert metric(exposed, "lucia_gateway_requests_total") == 0  # no user's request

    def probe_rows() -> dict[str, Any] | None:
        settings = str(gateway.log.parent / "gateway.toml")
        done = gateway.cli("usage", "--by", "key", "--json", "--settings", settings)
        groups = json.loads(done.stdout)["groups"]
        return next((g for g in groups if g["keyId"] == "probe" and g["ok"] >= 1), None)

    rows = wait_for(probe_rows, 30, "the probe's rows committed")
    assert rows["completionTokens"] >= rows["ok"]  # the engine's own count: a token each
    assert rows["ttftSeconds"]["p50"] > 0


def test_an_engine_that_cannot_generate_is_degraded_and_recovers(
    gateway: Gateway, served: Served
) -> None:
    router = served.router
    wait_for(lambda: listed(gateway)["probe"] is not None, 60, "a first probe")
    assert listed(gateway)["degraded"] is False
    pid = child_pid(router)
    os.kill(pid, signal.SIGSTOP)
    try:
        # the router answers /health and lists the model loaded: only a generation tells
        assert router.get("/health").status == 200
        assert router.models()[MODEL]["value"] == "loaded"
        entry = wait_for(
            lambda: (found := listed(gateway))["degraded"] and found, 60, "the model degraded"
        )
        assert entry["probe"]["reason"] == f"no answer within {TIMEOUT_S} s"
        assert entry["state"] == "running"
        exposed = gateway.metrics()
        assert metric(exposed, "lucia_gateway_probe_degraded", engine=NAME, model=MODEL) == 1
        assert metric(exposed, "lucia_gateway_probes_total", engine=NAME, outcome="timed_out")
        with chromium() as browser:
            sign_in(browser, gateway.url, gateway.owner)
            title = engine(NAME) + " h3"
            until(
                browser,
                lambda d: "degraded" in d.find_element(By.CSS_SELECTOR, title).text,
                what="the engine marked degraded",
            )
            said = browser.find_element(By.CSS_SELECTOR, engine(NAME)).text
            assert f"{MODEL}: failed (no answer within {TIMEOUT_S} s)" in said
            shot(browser, "probe-degraded")
            os.kill(pid, signal.SIGCONT)
            wait_for(lambda: not listed(gateway)["degraded"], 60, "the model probed ok again")
            until(
                browser,
                lambda d: "degraded" not in d.find_element(By.CSS_SELECTOR, title).text,
                what="the mark gone from the page",
            )
            assert f"{MODEL}: ok" in browser.find_element(By.CSS_SELECTOR, engine(NAME)).text
            shot(browser, "probe-recovered")
    finally:
        os.kill(pid, signal.SIGCONT)
    exposed = gateway.metrics()
    assert metric(exposed, "lucia_gateway_probe_degraded", engine=NAME, model=MODEL) == 0
    log = gateway.log_text()
    assert "engine degraded: its probe failed" in log and "engine probed ok again" in log
    assert all(key not in log for key in (gateway.owner, gateway.inference, gateway.issued))
