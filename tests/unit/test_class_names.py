"""One class name, one thing: no top-level class name is defined in two modules of supervisor/."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def repeats(sources: Mapping[str, str]) -> dict[str, list[str]]:
    """Each top-level class name defined in more than one of these modules (path: source),
    with the modules that define it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path, source in sorted(sources.items()):
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(path)
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def package() -> dict[str, str]:
    """Every module under supervisor/, by its path."""
    paths = (ROOT / "supervisor").rglob("*.py")
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def test_no_class_name_is_defined_in_two_modules() -> None:
    assert repeats(package()) == {}, "one class name, one thing: rename all but one of each"


def test_a_repeat_names_its_modules() -> None:
    sources = {
        "a.py": "class Settings:\n    pass\n",
        "b.py": "def Settings() -> None: ...\n\n\nclass Metrics: ...\n",
        "c.py": "class Settings: ...\n\n\nclass Other:\n    class Metrics: ...\n",
    }
    assert repeats(sources) == {"Settings": ["a.py", "c.py"]}
