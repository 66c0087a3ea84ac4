"""Modules of one concept: at most 400 lines, one opening line, and only docker/ imports docker."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# Still to be split (issue 20); each must still be too long, so that a split removes it here.
OVERSIZED: frozenset[str] = frozenset()
# Whose opening sentence runs over more than one line; each must still do so.
LONG_OPENING = frozenset(
    {
        "supervisor/engines/container.py",
        "supervisor/engines/llama_router/api.py",
        "supervisor/engines/llama_router/memory.py",
        "supervisor/engines/llama_router/plan.py",
        "supervisor/engines/vllm/engine.py",
        "supervisor/engines/vllm/preflight.py",
        "supervisor/redaction.py",
        "supervisor/worker/actions.py",
    }
)


def modules() -> list[str]:
    found = [*(ROOT / "supervisor").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    return sorted(str(path.relative_to(ROOT)) for path in found)


def opening(path: str) -> str | None:
    """The docstring's first line when it is a line of its own (alone, or before a blank line)."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text()), clean=False)
    if doc is None:
        return None
    lines = doc.split("\n")
    if not lines[0].strip() or (len(lines) > 1 and lines[1].strip()):
        return None
    return lines[0]


def test_the_exceptions_name_real_modules() -> None:
    assert set(modules()) >= OVERSIZED
    assert set(modules()) >= LONG_OPENING


@pytest.mark.parametrize("path", modules())
def test_no_module_is_over_400_lines(path: str) -> None:
    lines = len((ROOT / path).read_text().splitlines())
    if path in OVERSIZED:
        assert lines > MAX_LINES, f"{path} is {lines} lines now: remove it from OVERSIZED"
    else:
        assert lines <= MAX_LINES, f"{path} is {lines} lines: split it along its concepts"


@pytest.mark.parametrize("path", modules())
def test_every_module_opens_with_one_line_saying_what_it_is(path: str) -> None:
    if (ROOT / path).name == "__init__.py" and not (ROOT / path).read_text().strip():
        return  # an empty package marker says nothing
    first = opening(path)
    if path in LONG_OPENING:
        assert first is None, f"{path} opens with one line now: remove it from LONG_OPENING"
    else:
        assert first, f"{path}: the docstring's first line must say alone what the module is"


def docker_imports(path: Path) -> list[str]:
    """The docker SDK modules a file imports (not supervisor.docker)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "docker"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "docker"
        ):
            found.append(str(node.module))
    return found


def test_only_the_docker_package_imports_the_docker_sdk() -> None:
    importers = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "supervisor").rglob("*.py")
        if docker_imports(path)
    }
    assert importers, "the scan found no import of docker at all"
    outside = sorted(p for p in importers if not p.startswith("supervisor/docker/"))
    assert outside == []


def top_imports(path: Path) -> set[str]:
    """The top-level packages a file imports, wherever in the file (absolute imports only)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        # the extras read a request's prompt embeddings, which only vLLM hands over
        (
            "torch",
            {
                "kvplugin/lucia_kv/connector.py",
                "kvplugin/lucia_kv/transfer.py",
                "kvplugin/lucia_kv/extras.py",
            },
        ),
        ("vllm", {"kvplugin/lucia_kv/connector.py"}),
    ],
)
def test_only_the_connector_and_its_helpers_import_torch_and_vllm(
    package: str, allowed: set[str]
) -> None:
    files = [*(ROOT / "supervisor").rglob("*.py"), *(ROOT / "kvplugin").rglob("*.py")]
    importers = {str(p.relative_to(ROOT)) for p in files if package in top_imports(p)}
    assert importers, f"the scan found no import of {package} at all"
    assert sorted(importers - allowed) == []


def documented_layout() -> list[str]:
    """The paths docs/architecture.md's Layout block names: one entry a line, its first word,
    two spaces of indent per folder level (a folder's name ends in /; its line stands for its
    package)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    after = text[text.index("\n## Layout\n") :]
    block = after[after.index("```\n") + 4 :]
    folders: list[str] = []
    paths = []
    for line in block[: block.index("```")].splitlines():
        if not line.strip():
            continue
        depth, rest = divmod(len(line) - len(line.lstrip(" ")), 2)
        assert rest == 0 and depth <= len(folders), f"Layout: misindented: {line!r}"
        del folders[depth:]
        name = line.split()[0]
        paths.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    return paths


def package_files() -> set[str]:
    """What the Layout must name under supervisor/: each folder, and each module but the
    package markers (__init__.py; py.typed), which the folder's line stands for."""
    found = {"supervisor/"}
    for path in (ROOT / "supervisor").rglob("*.py"):
        relative = path.relative_to(ROOT)
        found |= {f"{parent}/" for parent in map(str, relative.parents) if parent != "."}
        if path.name != "__init__.py":
            found.add(str(relative))
    return found


def test_the_documented_layout_names_every_module_and_nothing_else() -> None:
    named = documented_layout()
    assert len(named) == len(set(named)), "the Layout names a path twice"
    inside = {path for path in named if path.startswith("supervisor/")}
    assert sorted(package_files() - inside) == [], "add these to the Layout in docs/architecture.md"
    assert sorted(inside - package_files()) == [], "in docs/architecture.md, not here"
    outside = [path for path in named if not path.startswith("supervisor/")]
    assert [path for path in outside if not (ROOT / path).exists()] == []
