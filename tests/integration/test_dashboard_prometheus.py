"""prometheus/lucia-dashboard.json against the real Prometheus the tests run, scraping the
real gateway (in front of the real llama-server, with requests, a refusal and its probe) and a
real worker's own metrics: every query runs by `promtool query instant` and by the HTTP API
with a result, and every metric it names is in the scrape. Grafana itself is in neither
Debian nor PyPI here: the dashboard's structure is checked as its JSON model has it
(tests/unit/test_dashboard.py)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import openai
import pytest

from tests import dashboard as board
from tests.gateway_proc import Gateway
from tests.integration.test_gateway_probe_llama import MODEL, gateway, listed, served
from tests.standin import free_port
from tests.system.harness import prometheus_api, running_prometheus, wait_for

pytestmark = pytest.mark.docker
__all__ = ["gateway", "served"]  # the fixtures: a gateway probing a real llama-server


def series_names(prometheus: str) -> set[str]:
    return set(prometheus_api(prometheus, "/api/v1/label/__name__/values") or [])


def answered(prometheus: str, expr: str) -> list[Any]:
    path = "/api/v1/query?query=" + urllib.parse.quote(expr)
    data = prometheus_api(prometheus, path) or {"result": []}
    return list(data["result"])


def test_every_dashboard_query_runs_on_the_real_prometheus(
    gateway: Gateway, make_engine: Any, tmp_path: Path
) -> None:
    worker = make_engine()
    port = free_port()
    worker.start_worker("--metrics-port", str(port))
    worker.wait_status(lambda _: True, timeout=60, what="the worker's first status")
    client = gateway.client()
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    with pytest.raises(openai.AuthenticationError):
        gateway.client(key="not-a-key").models.list()  # a refusal: invalid_api_key
    wait_for(lambda: listed(gateway)["probe"] is not None, 60, "a probe")
    found = board.queries(board.load())
    named = set().union(*(board.names(query.expr) for query in found))
    with running_prometheus(
        gateway.data_dir / "telemetry", tmp_path, [f"127.0.0.1:{port}"]
    ) as prom:
        wait_for(lambda: named <= series_names(prom), 90, f"every series of {sorted(named)}")
        assert board.unpublished(found, series_names(prom)) == []
        for query in found:
            ran = board.promtool("query", "instant", prom, query.expr)
            assert ran.returncode == 0, f"{query}: {ran.stdout}{ran.stderr}"
            assert wait_for(lambda q=query: answered(prom, q.expr), 60, f"a result of {query}")
        # and the check sees a name missing from the scrape
        missing = series_names(prom) - {"lucia_gateway_probes_total"}
        assert board.unpublished(found, missing) == ["panel 10 A: lucia_gateway_probes_total"]
