"""The shipped Grafana dashboard (prometheus/lucia-dashboard.json), as the tests read it: its
structure as Grafana imports it, its queries, the metric names each names, and promtool.

Grafana is in neither Debian nor PyPI here, so no test loads the dashboard into one: its
structure is checked as Grafana's dashboard JSON model has it, and every query is checked by
the Prometheus the tests run (tests/unit/test_dashboard.py, tests/integration/
test_dashboard_prometheus.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prometheus_client.registry import CollectorRegistry

ROOT: Final = Path(__file__).resolve().parents[1]
DASHBOARD: Final = ROOT / "prometheus" / "lucia-dashboard.json"
# every metric the dashboard reads is lucia-supervisor's own: the worker's and the gateway's
NAME: Final = re.compile(r"\blucia_[a-z0-9_]+\b")
_SUFFIXES: Final = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


@dataclass(frozen=True)
class Query:
    panel: int
    ref: str
    expr: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    document = json.loads(path.read_text())
    assert isinstance(document, dict)
    return document


def problems(dashboard: dict[str, Any]) -> list[str]:
    """What Grafana's import would miss: the schema version, panels with a Prometheus data
    source and a layout, ids unique, targets with a refId (unique in its panel) and an expr."""
    found: list[str] = []
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        found.append("schemaVersion: an int, 36 or later")
    for key in ("title", "uid"):
        if not isinstance(dashboard.get(key), str) or not dashboard[key]:
            found.append(f"{key}: a string")
    panels = dashboard.get("panels")
    if not isinstance(panels, list) or not panels:
        return [*found, "panels: a list of panels"]
    ids = [panel.get("id") for panel in panels]
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        found.append(f"panel ids: unique ints ({ids})")
    for panel in panels:
        found.extend(_panel_problems(panel))
    return found


def _panel_problems(panel: dict[str, Any]) -> list[str]:
    found: list[str] = []
    where = f"panel {panel.get('id')} ({panel.get('title')})"
    if not isinstance(panel.get("title"), str) or not isinstance(panel.get("type"), str):
        found.append(f"{where}: a title and a type")
    if (panel.get("datasource") or {}).get("type") != "prometheus":
        found.append(f"{where}: a prometheus datasource")
    grid = panel.get("gridPos") or {}
    if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")):
        found.append(f"{where}: gridPos h, w, x, y")
    targets = panel.get("targets")
    if not isinstance(targets, list) or not targets:
        return [*found, f"{where}: targets"]
    refs = [target.get("refId") for target in targets]
    if len(set(refs)) != len(refs) or not all(isinstance(r, str) and r for r in refs):
        found.append(f"{where}: refIds unique ({refs})")
    for target in targets:
        if not isinstance(target.get("expr"), str) or not target["expr"].strip():
            found.append(f"{where} {target.get('refId')}: an expr")
        source = target.get("datasource") or panel.get("datasource") or {}
        if source.get("type") != "prometheus":
            found.append(f"{where} {target.get('refId')}: a prometheus datasource")
    return found


def queries(dashboard: dict[str, Any]) -> list[Query]:
    return [
        Query(panel["id"], target["refId"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def names(expr: str) -> set[str]:
    """The metric names a query reads (every one is lucia_...)."""
    return set(NAME.findall(expr))


def unpublished(found: Iterable[Query], published: set[str]) -> list[str]:
    """Each query's names that nobody publishes: 'panel 3 A: lucia_...'."""
    return [
        f"panel {query.panel} {query.ref}: {name}"
        for query in found
        for name in sorted(names(query.expr) - published)
    ]


def exposed_names(*registries: CollectorRegistry) -> set[str]:
    """Every sample name the registries' families may expose, each labelled child or not."""
    found: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            for suffix in _SUFFIXES.get(family.type, ("",)):
                found.add(family.name + suffix)
    return found


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: Debian's prometheus package has it (scripts/machine.sh)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def as_rules(found: Iterable[Query]) -> str:
    """The queries as recording rules, so that `promtool check rules` parses each one."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for query in found:
        lines.append(f"      - record: dashboard:panel_{query.panel}_{query.ref}")
        lines.append(f"        expr: {json.dumps(query.expr)}")
    return "\n".join(lines) + "\n"
