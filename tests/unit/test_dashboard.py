"""prometheus/lucia-dashboard.json: Grafana's structure, every query parsed by promtool, and
every metric it names published by the worker's or the gateway's exporter (their registries);
each check fails on a dashboard broken its way. Against the real Prometheus scraping the real
parts: tests/integration/test_dashboard_prometheus.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.host.proxy.metrics import GatewayMetrics
from supervisor.worker.telemetry import WorkerMetrics
from tests import dashboard as board

PUBLISHED = board.exposed_names(GatewayMetrics(dict).registry, WorkerMetrics("demo").registry)
PANELS = (
    "Engine state",
    "Worker heartbeat age",
    "Gateway requests by outcome",
    "Running and waiting per engine",
    "Time to first token per model and build (p50, p95)",
    "Tokens per key",
    "Refusals by reason",
    "Probe: time to first token",
    "Probe: degraded",
    "Probe outcomes",
)


def test_the_dashboard_has_grafanas_structure_and_its_panels() -> None:
    found = board.load()
    assert board.problems(found) == []
    assert [panel["title"] for panel in found["panels"]] == list(PANELS)
    assert found["__inputs"][0]["pluginId"] == "prometheus"  # imported with a data source


@pytest.mark.parametrize(
    ("breaks", "says"),
    [
        (lambda d: d.pop("schemaVersion"), "schemaVersion"),
        (lambda d: d["panels"][1].update(id=1), "panel ids"),
        (lambda d: d["panels"][0].pop("datasource"), "prometheus datasource"),
        (lambda d: d["panels"][3]["targets"][1].update(refId="A"), "refIds unique"),
        (lambda d: d["panels"][2]["targets"][0].pop("expr"), "an expr"),
        (lambda d: d["panels"][2].pop("gridPos"), "gridPos"),
    ],
    ids=["schema", "ids", "datasource", "refid", "expr", "grid"],
)
def test_a_broken_structure_is_caught(breaks: Any, says: str) -> None:
    broken = copy.deepcopy(board.load())
    breaks(broken)
    assert any(says in problem for problem in board.problems(broken))


def test_every_query_parses_by_promtool(tmp_path: Path) -> None:
    rules = tmp_path / "dashboard-rules.yml"
    found = board.queries(board.load())
    rules.write_text(board.as_rules(found))
    checked = board.promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(found)} rules found" in checked.stdout


def test_a_query_that_does_not_parse_is_caught(tmp_path: Path) -> None:
    found = board.queries(board.load())
    broken = [*found[:-1], board.Query(99, "A", found[-1].expr.replace("[5m]", "[5m"))]
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text(board.as_rules(broken))
    assert board.promtool("check", "rules", str(rules)).returncode != 0


def test_every_metric_it_names_is_published_by_the_worker_or_the_gateway() -> None:
    found = board.queries(board.load())
    assert board.unpublished(found, PUBLISHED) == []
    named = set().union(*(board.names(query.expr) for query in found))
    assert {
        "lucia_worker_state",
        "lucia_worker_last_heartbeat_seconds",
        "lucia_gateway_requests_total",
        "lucia_gateway_ttft_seconds_bucket",
        "lucia_gateway_probe_ttft_seconds_bucket",
        "lucia_gateway_probe_degraded",
    } <= named


def test_a_metric_nobody_publishes_is_caught() -> None:
    text = board.DASHBOARD.read_text().replace(
        "lucia_gateway_refusals_total", "lucia_gateway_refused_total"
    )
    found = board.queries(json.loads(text))
    assert board.unpublished(found, PUBLISHED) == ["panel 7 A: lucia_gateway_refused_total"]
