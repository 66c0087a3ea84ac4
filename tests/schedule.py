"""Which tests may run side by side (pytest-xdist), and which run alone.

Most of the suite waits: on dockerd, on systemd, on an engine's heartbeat. `python -m tests.run`
runs it in two phases. The shared phase spreads groups over a few processes; a group runs in one
process, in order, so what it holds is never held twice at once:
- `vllm`: every case that loads the real vLLM CPU server: one load at a time on two cores, and
  the conformance relay hands its engine from case to case within one process;
- `lucia`: the service user's systemd manager and what `install.sh` installs in its home;
- `cold-build`: the vLLM CPU image built from nothing under a private tag;
- every other module is a group of its own, so its module-scoped engines are set up once.
The alone phase (`@pytest.mark.alone`) runs one case at a time with nothing beside it: the cases
that stop, restart or freeze the machine's dockerd, and the few that count what happens during a
race the machine's two cores decide (answers while a model loads).

The controller sees node ids only, so a group is named from the node id (`group_of`). Every
collection checks that against what each case holds (`held_group`: its fixtures and marks), so a
new case that loads vLLM or installs as the test user cannot land outside its group unnoticed.

Plain `python -m pytest` still runs everything, in one process.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

# In this order: the longest group starts first, so that it does not start last.
GROUPS = ("vllm", "lucia", "cold-build")
PHASES = ("all", "shared", "alone")
VLLM_MODULES = frozenset(
    {
        "tests/integration/test_gateway_capabilities_vllm.py",
        "tests/integration/test_gateway_charges_vllm.py",
        "tests/integration/test_gateway_vllm.py",
        "tests/integration/test_kv_tiers_shared_root.py",
        "tests/integration/test_kv_tiers_vllm.py",
        "tests/integration/test_kv_tiers_worker.py",
        "tests/integration/test_models_vllm_e2e.py",
        "tests/integration/test_vllm_cpu_engine.py",
        "tests/integration/test_vllm_cpu_image.py",
        "tests/integration/test_vllm_model_download.py",
        "tests/integration/test_vllm_tracing_args.py",
    }
)
LUCIA_MODULES = frozenset(
    {
        "tests/system/test_gateway_unit.py",
        "tests/system/test_installed_tiers.py",
        "tests/system/test_installed_vllm_tier_faults.py",
        "tests/system/test_installed_vllm_tiers.py",
        "tests/system/test_models_unit.py",
        "tests/system/test_systemd.py",
    }
)
COLD_BUILD = "tests/integration/test_vllm_cpu_image.py::test_a_cold_build_under_a_private_tag"
_VLLM_CONFORMANCE = re.compile(r"^tests/conformance/.*\[vllm\b")
_VLLM_FIXTURES = frozenset({"vllm_cpu_image", "vllm_cpu_images", "start_vllm_cpu"})


def group_of(nodeid: str) -> str:
    """The group a case runs in during the shared phase, from its node id."""
    module = nodeid.split("::", 1)[0]
    if module in LUCIA_MODULES:
        return "lucia"
    if nodeid.startswith(COLD_BUILD):
        return "cold-build"
    if module in VLLM_MODULES or _VLLM_CONFORMANCE.search(nodeid):
        return "vllm"
    return module


def held_group(item: Any) -> str | None:
    """The group that what a case holds demands, or None when it demands none."""
    names = set(getattr(item, "fixturenames", ()))
    if "user_manager" in names:
        return "lucia"
    if item.get_closest_marker("vllm_cold_build") is not None:
        return "cold-build"
    if names & _VLLM_FIXTURES:
        return "vllm"
    return None


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, with `group_of` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=PHASES,
        default="all",
        help="shared: only cases that may run beside others; alone: only those that may not "
        "(python -m tests.run runs both)",
    )


_spent: defaultdict[str, float] = defaultdict(float)  # group -> seconds, setup to teardown


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[group_of(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The groups by time spent: the longest is the floor of the shared phase's wall time."""
    if not _spent:
        return
    terminalreporter.section("time by group (tests/schedule.py)")
    for name, seconds in sorted(_spent.items(), key=lambda item: -item[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
    terminalreporter.write_line(f"{sum(_spent.values()):8.1f} s  in all")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling:
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [
        f"{item.nodeid}: holds what the group {held!r} holds, but runs in {group_of(item.nodeid)!r}"
        for item in items
        if (held := held_group(item)) is not None and held != group_of(item.nodeid)
    ]
    if wrong:
        raise pytest.UsageError(
            "tests/schedule.py: add the module to its group:\n  " + "\n  ".join(wrong)
        )
    phase = config.getoption("--phase")
    if phase != "all":
        alone = phase == "alone"
        keep = [item for item in items if (item.get_closest_marker("alone") is not None) == alone]
        if len(keep) < len(items):
            kept = set(keep)
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = keep
    if hasattr(config, "workerinput"):  # the longest groups first, so that none starts last
        rank = {name: index for index, name in enumerate(GROUPS)}
        items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(GROUPS)))
