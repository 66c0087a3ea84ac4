"""tests/schedule.py and tests/run.py: which cases share a process, which run alone, and the
exit status of a two-phase run."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import dockerd as dockerd_module
from tests import run, schedule

TESTS = Path(__file__).resolve().parents[1]


@dataclass
class Mark:
    args: tuple[Any, ...]


@dataclass
class Item:
    """What schedule.group reads of a pytest item."""

    nodeid: str
    fixturenames: tuple[str, ...] = ()
    marks: dict[str, Mark] = field(default_factory=dict)

    def get_closest_marker(self, name: str) -> Mark | None:
        return self.marks.get(name)


@pytest.mark.parametrize(
    ("nodeid", "expected"),
    [
        ("tests/system/test_systemd.py::test_x", "lucia"),
        ("tests/system/test_installed_vllm_tiers.py::test_x", "lucia"),
        ("tests/integration/test_kv_tiers_vllm.py::test_x", "vllm"),
        ("tests/integration/test_vllm_cpu_engine.py::test_x", "vllm"),
        ("tests/integration/test_vllm_cpu_image.py::test_health_version_and_models", "vllm"),
        (
            "tests/integration/test_vllm_cpu_image.py::test_a_cold_build_under_a_private_tag_then_a"
            "_cached_run",
            "cold-build",
        ),
        ("tests/conformance/test_worker_rules.py::test_death[vllm]", "vllm"),
        ("tests/conformance/test_worker_rules.py::test_x[vllm-every field]", "vllm"),
        (
            "tests/conformance/test_worker_rules.py::test_x[tensorfold]",
            "tests/conformance/test_worker_rules.py",
        ),
        ("tests/unit/test_units.py::test_x[vllm]", "tests/unit/test_units.py"),
        ("tests/unit/test_paths.py::test_x", "tests/unit/test_paths.py"),
    ],
)
def test_each_case_has_one_group(nodeid: str, expected: str) -> None:
    assert schedule.group_of(nodeid) == expected


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (Item("a", ("installation", "user_manager")), "lucia"),
        (Item("a", ("user_manager", "vllm_cpu_image")), "lucia"),
        (Item("a", ("start_vllm_cpu",)), "vllm"),
        (Item("a", ("vllm_cpu_images", "client")), "vllm"),
        (Item("a", ("client",), {"vllm_cold_build": Mark(())}), "cold-build"),
        (Item("a", ("make_engine", "tmp_path")), None),
    ],
)
def test_what_a_case_holds_names_its_group(item: Item, expected: str | None) -> None:
    assert schedule.held_group(item) == expected


def test_a_case_outside_the_group_it_holds_stops_the_collection(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS.parent))
    pytester.makeconftest("""
import pytest
pytest_plugins = ["tests.schedule"]
@pytest.fixture
def vllm_cpu_image():
    return "image"
""")
    pytester.makepyfile(test_new="def test_a_load(vllm_cpu_image):\n    pass\n")
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_new.py::test_a_load: holds what the group 'vllm' holds*"])


def _stops_dockerd(function: ast.FunctionDef) -> bool:
    """Restarts or stalls a dockerd: calls `.restart()` or `.stalled()` on the private one."""
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "private_dockerd"
            and node.func.attr in {"restart", "stalled"}
        ):
            return True
    return False


def _marked_alone(function: ast.FunctionDef) -> bool:
    return any(ast.unparse(mark) == "pytest.mark.alone" for mark in function.decorator_list)


def _sources() -> list[tuple[Path, ast.Module]]:
    return [
        (path, ast.parse(path.read_text(), str(path)))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "dockerd.py" and path != Path(__file__).resolve()
    ]


def test_no_case_signals_or_restarts_the_machines_dockerd() -> None:
    """The machine's dockerd serves the operator's engines while the tests run: what tests/dockerd
    offers is a private dockerd only, and nothing else in the tests looks for dockerd's pid."""
    module = dockerd_module
    public = {
        name
        for name in vars(module)
        if not name.startswith("_")
        and callable(vars(module)[name])
        and getattr(vars(module)[name], "__module__", None) == module.__name__
    }
    assert public == {"Private", "private"}
    offenders = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dockerd"
                and node.func.attr not in {"Private", "private"}
            ):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in ("pidof", "dockerd"):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert offenders == []


def test_every_case_that_stops_or_freezes_dockerd_runs_alone() -> None:
    found = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.startswith("test_")
                and _stops_dockerd(node)
            ):
                found[f"{path.relative_to(TESTS)}::{node.name}"] = _marked_alone(node)
    assert len(found) >= 3, found  # the restart and the two stalls are seen
    assert [name for name, alone in found.items() if not alone] == []


@pytest.mark.parametrize(
    ("shared", "alone", "expected"),
    [
        (0, 0, 0),
        (0, run.NO_TESTS, 0),  # only shared cases selected
        (run.NO_TESTS, 0, 0),  # only alone cases selected
        (run.NO_TESTS, run.NO_TESTS, run.NO_TESTS),
        (1, 0, 1),
        (0, 1, 1),
        (2, 1, 2),  # the first failing phase's code
        (run.NO_TESTS, 1, 1),
    ],
)
def test_the_exit_status_of_both_phases(
    monkeypatch: pytest.MonkeyPatch, shared: int, alone: int, expected: int
) -> None:
    ran: list[tuple[str, list[str], list[str]]] = []
    codes = {"shared": shared, "alone": alone}

    def phase(name: str, extra: list[str], args: list[str]) -> tuple[int, float]:
        ran.append((name, extra, args))
        return codes[name], 0.0

    monkeypatch.setattr(run, "phase", phase)
    assert run.main(["--workers", "2", "-x", "tests/unit"]) == expected
    assert [name for name, _, _ in ran] == ["shared", "alone"]  # both always run
    assert ran[0][1][:2] == ["-n", "2"] and ran[1][1] == []
    assert all(args == ["-x", "tests/unit"] for _, _, args in ran)


def test_no_two_test_modules_share_a_name() -> None:
    """The test folders are no packages, so pytest imports each module by its file name: a second
    module of the same name, in another folder, stops the whole collection."""
    names: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert {name: found for name, found in names.items() if len(found) > 1} == {}
