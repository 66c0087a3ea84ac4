"""The README and docs/: short where it must be, every link leads somewhere, one home each."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from supervisor.cli import build_parser
from supervisor.engines.registry import kinds
from supervisor.host.gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")

# Each section of the README as it was before the reference moved to docs/, and its new home:
# nothing the README said is lost, and a test fails when one of these homes goes away.
FORMER_SECTIONS = {
    "On a fresh machine: two commands": "README.md#on-a-fresh-machine-two-commands",
    "On a fresh machine (in full)": "docs/operating.md#the-two-commands-in-full",
    "Operating it": "docs/operating.md#installing-as-the-service-user",
    "Operating it: the units": "docs/operating.md#the-units-and-their-journal",
    "Operating it: Prometheus": "docs/operating.md#monitoring",
    "The protocol": "docs/protocol.md",
    "The protocol: Failures": "docs/protocol.md#failures",
    "The gateway": "docs/gateway.md",
    "What a model serves": "docs/gateway.md#what-a-model-serves",
    "The gateway: settings": "docs/gateway.md#settings",
    "The gateway: TLS": "docs/gateway.md#tls",
    "The gateway: admission": "docs/gateway.md#admission",
    "The gateway: bodies and bounds": "docs/gateway.md#bounds-on-bodies-and-requests",
    "The gateway: roles": "docs/gateway.md#keys-and-roles",
    "The gateway: metrics": "docs/gateway.md#upstream-connections-deadlines-and-metrics",
    "The probe": "docs/gateway.md#the-probe",
    "The probe: what a request costs": "docs/gateway.md#what-a-request-costs",
    "The probe: budgets": "docs/gateway.md#budgets",
    "Served names": "docs/gateway.md#served-names",
    "The record": "docs/record.md",
    "Tracing": "docs/gateway.md#tracing",
    "Several machines, one service (a fleet)": "docs/fleet.md",
    "Peer keys and the peer route (a fleet)": "docs/fleet.md#peer-keys-and-the-peer-route-a-fleet",
    "One address for the fleet": "docs/fleet.md#one-address-for-the-fleet",
    "The fleet's catalog": "docs/fleet.md#the-fleets-catalog",
    "The page in a fleet": "docs/fleet.md#the-page-in-a-fleet",
    "The operator's page": "docs/page.md",
    "The CLI": "docs/cli.md",
    "Inference keys": "docs/cli.md#inference-keys",
    "The model library": "docs/library.md",
    "The model library: commands": "docs/cli.md#the-model-library",
    "Recipes": "docs/recipes/README.md",
    "tensorfold (the Spark recipe)": "docs/recipes/tensorfold.md",
    "llama-router": "docs/recipes/llama-router.md",
    "llama-router: alerting rules": "docs/operating.md#alerting-rules",
    "llama-router: a Grafana dashboard": "docs/operating.md#a-grafana-dashboard",
    "vllm (a GPU server's catalog engine)": "docs/recipes/vllm.md",
    "The context cache's tier plugin": "docs/recipes/cache-plugin.md",
    "The memory plan": "docs/memory-plan.md",
    "What is tested, and how": "docs/testing.md",
    "The chaos soak": "docs/testing.md#the-chaos-soak",
    "The real vLLM CPU image": "docs/testing.md#the-real-vllm-cpu-image",
    "Several machines on one": "docs/testing.md#several-machines-on-one-testsmachinespy",
    "Benchmarks": "docs/benchmarks.md",
    "How the worker is built": "docs/architecture.md#how-the-worker-is-built",
    "Layout": "docs/architecture.md#layout",
    "Adding an engine": "docs/architecture.md#adding-an-engine-one-folder-and-one-recipe",
}


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(text: str) -> str:
    """The text outside fenced code blocks, where links and headings count."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken(page: Path, target: str) -> str | None:
    """Why a relative link from `page` leads nowhere, or None."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None  # a URL of its own scheme: not this tree's
    path, _, anchor = target.partition("#")
    where = (page.parent / path).resolve() if path else page
    if not where.exists():
        return f"{target}: no {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}"
    if anchor and where.suffix == ".md" and anchor not in anchors(where):
        return f"{target}: no heading #{anchor} in {where.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        (
            "The gateway (`lucia-supervisor gateway`, unit `lucia-gateway`)",
            "the-gateway-lucia-supervisor-gateway-unit-lucia-gateway",
        ),
        ("The fleet's catalog", "the-fleets-catalog"),
        (
            "Several machines on one (`tests/machines.py`)",
            "several-machines-on-one-testsmachinespy",
        ),
        ("On a fresh machine: two commands", "on-a-fresh-machine-two-commands"),
        (
            "Upstream connections, deadlines and metrics",
            "upstream-connections-deadlines-and-metrics",
        ),
    ],
)
def test_a_heading_gets_the_anchor_a_renderer_gives_it(heading: str, expected: str) -> None:
    assert slug(heading) == expected


@pytest.mark.parametrize(
    "page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_link_leads_somewhere(page: Path) -> None:
    targets = LINK.findall(prose(page.read_text()))
    assert [why for target in targets if (why := broken(page, target))] == []


def test_a_link_that_leads_nowhere_is_found(tmp_path: Path) -> None:
    page = DOCS / "gateway.md"
    assert broken(page, "record.md") is None
    assert broken(page, "#the-probe") is None
    assert broken(page, "record.md#no-such-heading") is not None
    assert broken(page, "no-such-page.md") is not None
    assert broken(page, "https://example.org/anything") is None
    assert LINK.findall("see [a [b] c](x.md#y) and ![pic](p.png)") == ["x.md#y", "p.png"]


def test_the_readme_is_short_and_links_every_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(prose(text))}
    assert sorted(str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in linked) == []
    assert text.count("```sh\n") >= 2 and "bash scripts/demo.sh" in text
    assert ".venv/bin/python -m tests.run" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_opens_with_what_it_is_for(page: Path) -> None:
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2] and not lines[2].startswith(("#", "```", "|", "-", "!")), lines[2]


@pytest.mark.parametrize(("section", "home"), sorted(FORMER_SECTIONS.items()))
def test_each_former_readme_section_has_a_home(section: str, home: str) -> None:
    path, _, anchor = home.partition("#")
    assert (ROOT / path).exists(), section
    assert not anchor or anchor in anchors(ROOT / path), f"{section}: {home}"


def commands() -> list[str]:
    """Every command of the CLI, as `lucia-supervisor NAME` or `... NAME SUB`."""
    found = []
    for name, sub in _choices(build_parser()).items():
        inner = _choices(sub)
        found += [f"{name} {each}" for each in inner] if inner else [name]
    return found


def _choices(parser: Any) -> dict[str, Any]:
    for action in parser._actions:  # argparse keeps its subparsers only there
        if action.choices and isinstance(action.choices, dict):
            return dict(action.choices)
    return {}


def _row(command: str) -> str:
    """A table row's opening that documents `command` (a sub-command among alternatives too)."""
    name, _, sub = command.partition(" ")
    return rf"`lucia-supervisor {name}" + (rf" (?:[\w-]+\|)*{re.escape(sub)}\b" if sub else r"\b")


def test_every_command_has_one_home_in_the_cli_page() -> None:
    rows = {
        page: [
            line
            for line in page.read_text().splitlines()
            if line.startswith("| `lucia-supervisor ")
        ]
        for page in PAGES
    }
    assert [page.name for page, found in rows.items() if found] == ["cli.md"]
    documented = " ".join(re.sub(r"\\\|", "|", row) for row in rows[DOCS / "cli.md"])
    missing = [command for command in commands() if not re.search(_row(command), documented)]
    assert missing == []


def test_every_gateway_setting_has_its_home_in_the_gateway_page() -> None:
    blocks = re.findall(r"```toml\n(.*?)```", (DOCS / "gateway.md").read_text(), re.S)
    documented: dict[str, set[str]] = {}
    section = ""
    for line in "\n".join(blocks).splitlines():
        header = re.match(r"\[(\w+)\]", line)
        if header:
            section = header.group(1)
        key = re.match(r"#? ?(\w+) = ", line)
        if key and section:
            documented.setdefault(section, set()).add(key.group(1))
    missing = [
        f"[{name}] {key}"
        for name, field in GatewaySettings.model_fields.items()
        if isinstance(field.default_factory, type) and issubclass(field.default_factory, BaseModel)
        for key in field.default_factory.model_fields
        if key not in documented.get(name, set())
    ]
    assert missing == []


RECIPE_PAGES = {"tensorfold": "tensorfold.md", "llama-router": "llama-router.md", "vllm": "vllm.md"}
# sections whose keys are at home on another page: the memory plan's figures
SECTION_HOMES = {"memory": DOCS / "memory-plan.md"}


def key_rows(text: str) -> dict[str, str]:
    """A recipe page's table: each section's row text ("" for the top level)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        row = re.match(r"\| (top level|`\[[^|]*\]`(?: or `\[[^|]*\]`)*) \| (.*) \|$", line)
        if row:
            for section in re.findall(r"\[([^\]]+)\]", row.group(1)) or [""]:
                found[section] = found.get(section, "") + row.group(2)
    return found


def recipe_keys(model: type[BaseModel], section: str = "") -> Iterator[tuple[str, str]]:
    """(section, key) for every key of a recipe schema, sections dotted as TOML has them."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        inner = _models(field.annotation)
        for each in inner:
            yield from recipe_keys(each, f"{section}.{key}" if section else key)
        if not inner:
            yield section, key


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in typing.get_args(annotation) for found in _models(arg)]


@pytest.mark.parametrize("kind", sorted(RECIPE_PAGES))
def test_every_recipe_key_has_its_home_in_the_recipe_pages(kind: str) -> None:
    rows = [
        key_rows((DOCS / "recipes" / page).read_text())
        for page in (RECIPE_PAGES[kind], "README.md")
    ]

    def documented(section: str, key: str) -> bool:
        if section == "" and (key in rows[0] or key in rows[1]):
            return True  # a table of its own, as [settings] and [secrets] have
        if section in SECTION_HOMES:
            return re.search(rf"\b{key} = ", SECTION_HOMES[section].read_text()) is not None
        while True:  # a sub-table's keys may be in its parent's row ([tiers.nvme] in [tiers])
            if any(re.search(rf"`{key}(`| =)", table.get(section, "")) for table in rows):
                return True
            if "." not in section:
                return False
            section = section.rsplit(".", 1)[0]

    schema = kinds()[kind].recipe
    missing = [f"[{s}] {k}" if s else k for s, k in recipe_keys(schema) if not documented(s, k)]
    assert missing == []
