"""bench/report.py's RESULTS.md: the suite's rewrite keeps the separate scripts' results."""

from __future__ import annotations

from pathlib import Path

from bench.report import SEPARATE_SCRIPTS, Row, write_results


def _write(path: Path, p50: float) -> None:
    row = Row("ack", "request -> status", "ms", p50, p50 + 1, 10, "20 ms", "+1 ms")
    write_results(
        path,
        rows=[row],
        machine={"cores": "2"},
        command="python -m bench.run",
        wall=60.0,
        durations={"ack": 15.0},
        run_id="abc12345",
        load=("0.1", "0.2"),
        problems=[],
    )


def test_a_rewrite_keeps_the_separate_scripts_results_and_replaces_the_suites(
    tmp_path: Path,
) -> None:
    path = tmp_path / "RESULTS.md"
    _write(path, 27.0)
    separate = f"{SEPARATE_SCRIPTS}\n\n## KV tiers: time to first token\n\n| row | median |\n"
    path.write_text(path.read_text() + "\n" + separate)
    _write(path, 31.0)
    text = path.read_text()
    assert text.startswith("# Benchmark results\n")
    assert text.endswith(separate)
    assert text.count(SEPARATE_SCRIPTS) == 1
    assert "31.0 ms" in text
    assert "27.0 ms" not in text


def test_without_that_part_the_file_is_the_suites_alone(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    _write(path, 27.0)
    assert SEPARATE_SCRIPTS not in path.read_text()
    path.write_text(path.read_text() + "\n# Separate scripts, mentioned in passing\n")
    _write(path, 31.0)
    assert "in passing" not in path.read_text()
