"""A real Prometheus (Debian's) scraping the real llama-server router through the worker's file_sd
(the real vLLM CPU server's scrape is in tests/integration/test_vllm_cpu_engine.py).

The worker runs as a process of its own (not under systemd: tests/system/test_systemd.py covers
the unit); Prometheus reads its file_sd file and scrapes every loaded model's target with
?model=NAME&autoload=false, which never loads a model.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import Engine
from tests.gguf_fixtures import add_model, write_llama
from tests.system.harness import prometheus_query as _query
from tests.system.harness import prometheus_targets as _targets
from tests.system.harness import (
    running_prometheus,
    wait_for,
)

pytestmark = pytest.mark.docker


def _models(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url + "/models", timeout=5) as response:
        listing = json.loads(response.read())
    return {entry["id"]: entry["status"]["value"] for entry in listing["data"]}


def _load(url: str, model: str) -> None:
    request = urllib.request.Request(
        url + "/models/load", method="POST", data=json.dumps({"model": model}).encode()
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read()) == {"success": True}


@pytest.fixture
def router_engine(make_engine) -> Engine:
    engine: Engine = make_engine(
        kind="llama-router", load_on_startup=("alpha",), models_max=2, defaults={"ctx-size": 256}
    )
    for name in ("alpha", "beta", "zeta"):
        write_llama(add_model(engine.models_dir, "Ready") / f"{name}.gguf")
    return engine


@pytest.fixture
def prometheus(router_engine: Engine, tmp_path: Path) -> Iterator[str]:
    with running_prometheus(router_engine.data_dir / "telemetry", tmp_path) as url:
        yield url


def test_prometheus_scrapes_every_loaded_model_without_loading_any(
    router_engine: Engine, prometheus: str
) -> None:
    engine = router_engine
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "running", timeout=120)
    url = status["url"]
    _load(url, "zeta")
    wait_for(lambda: len(engine.file_sd()) == 2, 10, "two targets in file_sd")

    def both_up() -> list[dict[str, Any]]:
        found = _targets(prometheus, engine.name)
        return found if len(found) == 2 and all(t["health"] == "up" for t in found) else []

    before = _models(url)
    assert before == {"alpha": "loaded", "beta": "unloaded", "zeta": "loaded"}
    targets = wait_for(both_up, 60, "both targets up")
    assert sorted(t["labels"]["model"] for t in targets) == ["alpha", "zeta"]
    for target in targets:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(target["scrapeUrl"]).query)
        assert query == {"model": [target["labels"]["model"]], "autoload": ["false"]}
        assert target["labels"]["engine"] == "llama-router"
    assert wait_for(
        lambda: (
            _query(prometheus, f'up{{name="{engine.name}"}}') == {"alpha": "1", "zeta": "1"} or None
        ),
        30,
        "up == 1 for both",
    )
    series = wait_for(
        lambda: _query(prometheus, f'llamacpp:prompt_tokens_total{{name="{engine.name}"}}') or None,
        30,
        "llamacpp: series",
    )
    assert set(series) == {"alpha", "zeta"}
    time.sleep(3)  # a few more scrapes of each target
    assert _models(url) == before, "a scrape loaded or unloaded a model"

    # beta loads beyond models-max: the router evicts the least recently used
    _load(url, "beta")
    wait_for(lambda: _models(url)["beta"] == "loaded", 60, "beta loaded")
    loaded = sorted(name for name, value in _models(url).items() if value == "loaded")
    assert len(loaded) == 2 and "beta" in loaded, loaded
    wait_for(
        lambda: sorted(g["labels"]["model"] for g in engine.file_sd()) == loaded,
        3,
        "file_sd follows the eviction by the next poll",
    )
    wait_for(
        lambda: sorted(t["labels"]["model"] for t in _targets(prometheus, engine.name)) == loaded,
        30,
        "Prometheus drops the evicted model's target",
    )
    assert wait_for(
        lambda: (
            all(t["health"] == "up" for t in _targets(prometheus, engine.name))
            and _query(prometheus, f'up{{name="{engine.name}"}} == 1')
        ),
        30,
        "the new target up",
    )
    time.sleep(3)
    assert sorted(name for name, value in _models(url).items() if value == "loaded") == loaded, (
        "a scrape of the evicted model's target, before file_sd dropped it, loaded it back"
    )
