"""Every shell script of the repository: it parses, the operator-facing ones name any failure
under set -e, and none pipes into a reader that exits early under pipefail (the writer dies of
SIGPIPE, exit 141, and set -e ends the script)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# what an operator or CI runs: each installs the ERR trap (scripts/llama-server-image.sh's test
# and tests/integration/test_machine_scripts.py prove what it prints)
OPERATOR_SCRIPTS = [
    "scripts/machine.sh",
    "scripts/llama-server-image.sh",
    "scripts/systemd-user.sh",
    "scripts/demo.sh",
    "install.sh",
    ".ci/run",
]

# sourced by the scripts above, never run on their own
SHARED = ["scripts/lib/errors.sh", "scripts/lib/images.sh"]
TRAP = """trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR"""

# readers that can stop before their writer is done: head, grep -q / -m, sed ...q, awk ... exit
EARLY_EXIT = re.compile(
    r"\|\s*(head\b|grep\s+(-\w*[qm]|--quiet|--max-count)|sed\b[^|]*[\d;{/'\s]q\b|awk\b[^|]*\bexit\b)"
)

# pipelines kept as the real Spark recipe has them (tests/tensorfold-recipe models it; the output
# is a few lines, far below a pipe's 64 KiB)
REAL_RECIPE_LINES = {
    (
        "tests/tensorfold-recipe/start.sh",
        "docker ps -a --format '{{.Names}}' | grep -qx \"$CONTAINER_NAME\"",
    ),
    ("tests/tensorfold-recipe/start.sh", 'ss -ltn "sport = :$PORT" 2>/dev/null | grep -q LISTEN'),
    (
        "tests/tensorfold-recipe/scripts/prepare.sh",
        'snapshot=$(compgen -G "$(model_cache_dir)/snapshots/*/" | head -1)',
    ),
}


def shell_scripts() -> list[str]:
    """Every tracked file that is a shell script: *.sh, and any file with a shell shebang."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in listed:
        path = ROOT / name
        if not path.is_file():
            continue
        with path.open("rb") as file:
            first = file.readline()
        if name.endswith(".sh") or re.match(rb"#!\s*(/usr/bin/env\s+)?(/bin/)?(ba)?sh\b", first):
            found.append(name)
    return sorted(found)


def is_posix_sh(name: str) -> bool:
    """A #!/bin/sh script (busybox's, in the stand-in images): no pipefail there."""
    return (ROOT / name).read_text().startswith("#!/bin/sh")


def logical_lines(text: str) -> list[str]:
    """Lines with continuations joined: `a \\` + `| b`, and `a |` + `b`, are one pipeline."""
    text = re.sub(r"\\\n\s*", " ", text)
    text = re.sub(r"\|\s*\n\s*", "| ", text)
    return [line.strip() for line in text.splitlines()]


def test_the_scripts_are_found() -> None:
    scripts = shell_scripts()
    for name in [
        *OPERATOR_SCRIPTS,
        "scripts/as-lucia",
        "tests/tensorfold-recipe/start.sh",
        "tests/tensorfold-recipe/stand-in/bin/tensorfold",
        "demo/llama-router/llama-server",
        *SHARED,
    ]:
        assert name in scripts


@pytest.mark.parametrize("name", shell_scripts())
def test_it_parses(name: str) -> None:
    shell = "sh" if is_posix_sh(name) else "bash"
    done = subprocess.run(
        [shell, "-n", str(ROOT / name)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", [n for n in shell_scripts() if not is_posix_sh(n)])
def test_no_reader_of_a_pipe_exits_early(name: str) -> None:
    kept = [fragment for script, fragment in REAL_RECIPE_LINES if script == name]
    hits = [
        line
        for line in logical_lines((ROOT / name).read_text())
        if not line.startswith("#")
        and EARLY_EXIT.search(line)
        and not any(fragment in line for fragment in kept)
    ]
    assert hits == [], f"{name}: a pipe into an early-exit reader under pipefail"


@pytest.mark.parametrize("name", OPERATOR_SCRIPTS)
def test_a_set_e_exit_names_what_failed(name: str) -> None:
    text = (ROOT / name).read_text()
    assert "set -euo pipefail" in text
    assert "\nset -E\n" in text
    assert f"\n{TRAP}\n" in text


def _script(path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run `body` as the script `path`, under the operator scripts' set -e and ERR trap."""
    lib = ROOT / "scripts" / "lib"
    path.write_text(
        f"#!/usr/bin/env bash\nset -euo pipefail\nsource {lib}/errors.sh\n"
        f"source {lib}/images.sh\nset -E\n{TRAP}\n{body}\n"
    )
    return subprocess.run(
        ["bash", str(path)], capture_output=True, text=True, check=False, timeout=60
    )


def test_the_shared_error_report_is_under_the_name_of_the_script(tmp_path: Path) -> None:
    done = _script(tmp_path / "some-step.sh", "true\ntrue | sh -c 'exit 3'\necho not reached")
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (
        "some-step.sh: line 8: `sh -c 'exit 3'` failed (exit 3; pipeline exits 0 3)\n"
    )


def test_the_shared_die_is_under_the_name_of_the_script(tmp_path: Path) -> None:
    done = _script(tmp_path / "other.sh", 'die "no such thing"\necho not reached')
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "other.sh: no such thing\n")


def test_the_mirror_variable_named_wins_over_the_machine_s_apt(tmp_path: Path) -> None:
    done = _script(
        tmp_path / "image.sh", "MY_MIRROR=http://mirror.invalid/debian debian_mirror MY_MIRROR"
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "http://mirror.invalid/debian\n", "")


@pytest.mark.parametrize(
    ("line", "early"),
    [
        ("systemctl status x | head -5", True),
        ("id -nG u | tr ' ' '\\n' | grep -qx docker", True),
        ("docker ps | grep -m1 x", True),
        ("tar -xOf t ./s | awk '$1 == 1 {print $2; exit}'", True),
        ("journalctl | sed -n '/x/{p;q}'", True),
        ("journalctl | sed 3q", True),
        ("docker images | sort -r | awk -F'\\t' '!found {print $2; found = 1}'", False),
        ("df -BG --output=avail x | tail -1 | tr -dc '0-9'", False),
        ("printf '%s' \"$v\" | tr -c 'A-Za-z' '_' | cut -c1-128", False),
        ("grep -q x file", False),
    ],
)
def test_the_early_exit_pattern(line: str, early: bool) -> None:
    assert bool(EARLY_EXIT.search(line)) is early
