"""prometheus/lucia-rules.yml passes `promtool check rules` and its own `promtool test rules`,
and those tests catch each alert broken (so none of them passes by not looking)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus" / "lucia-rules.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "lucia-rules.test.yml"
ALERTS = (
    "LuciaWorkerHeartbeatStale",
    "LuciaEngineFailed",
    "LuciaRouterModelLoadFailed",
    "LuciaTargetDown",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: Debian's prometheus package has it (scripts/machine.sh)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_rules_are_valid_and_are_the_four_alerts() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout
    assert re.findall(r"^ +- alert: (\w+)$", RULES.read_text(), re.MULTILINE) == list(ALERTS)


def test_the_rules_pass_their_promtool_tests() -> None:
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def _mutated(tmp_path: Path, old: str, new: str) -> Path:
    text = RULES.read_text()
    assert old in text, old
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "prometheus" / RULES.name).write_text(text.replace(old, new))
    (tmp_path / "tests" / "prometheus").mkdir(parents=True)
    return Path(shutil.copy(RULE_TESTS, tmp_path / "tests" / "prometheus"))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("[1h]) > 60", "[1h]) > 120"),  # heartbeat threshold
        (
            "max_over_time(lucia_worker_last_heartbeat_seconds[1h])",
            "lucia_worker_last_heartbeat_seconds",
        ),  # a dead worker's series ends
        ('{state="failed"} == 1', '{state="running"} == 1'),
        ("lucia_router_model_load_failed == 1", "lucia_router_model_load_failed == 0"),
        ('up{job="lucia"} == 0', "up == 0"),  # another job's target is not an engine's
        ("for: 2m", "for: 0s"),  # a blip of a just-unloaded model is not an outage
        ("group_left (name) lucia_worker_info", "group_left lucia_worker_info"),  # no name
    ],
    ids=["threshold", "dead-worker", "failed", "load-failed", "job", "for", "name"],
)
def test_the_promtool_tests_catch_a_broken_rule(tmp_path: Path, old: str, new: str) -> None:
    tested = promtool("test", "rules", str(_mutated(tmp_path, old, new)))
    output = tested.stdout + tested.stderr
    assert tested.returncode != 0, f"{old!r} -> {new!r} went unnoticed:\n{output}"
    assert "FAILED" in output, output
