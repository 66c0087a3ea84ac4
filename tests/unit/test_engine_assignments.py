"""An engine's answers are functions of its look: no method of a class under supervisor/engines
keeps state in `self.<attr>` except its constructor, its observation and its effectful steps."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ENGINES = Path(__file__).resolve().parents[2] / "supervisor" / "engines"
# the constructor, the one look, and the steps that change the world (make, the checks before a
# start, and the settling of a start's outcome)
ALLOWED = frozenset(
    {"__init__", "observe", "make", "make_own", "preflight", "check_more", "settle"}
)
# the effectful caches and holds an engine owns, each its own class with its own state: a GGUF
# header read per library, a git checkout's last error, the namespaces a start holds, vLLM's
# version, routes and tiers read per container, the tier plugin as last read from disk; and
# two helpers of the router's sync step: a copy that falls back to a plain copy once, and its
# progress messages' throttle
CACHES = frozenset(
    {
        "Headers",
        "GitCheckout",
        "Starting",
        "Versions",
        "Routes",
        "TierWatch",
        "Current",
        "_Copier",
        "_Throttle",
    }
)


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        yield from node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        yield node.target


def _flat(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for item in target.elts:
            yield from _flat(item)
    elif isinstance(target, ast.Starred):
        yield from _flat(target.value)
    else:
        yield target


def assignments(path: Path) -> Iterator[str]:
    """`Class.method: self.attr` for each assignment to an attribute of self outside ALLOWED."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if cls.name in CACHES:
            continue
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or method.name in ALLOWED:
                continue
            for node in ast.walk(method):
                for target in (t for top in _targets(node) for t in _flat(top)):
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        yield (
                            f"{path.relative_to(ENGINES)}: {cls.name}.{method.name}: "
                            f"self.{target.attr}"
                        )


def test_only_the_look_and_the_steps_keep_state() -> None:
    found = [line for path in sorted(ENGINES.rglob("*.py")) for line in assignments(path)]
    assert found == [], "state kept outside observe and the effectful steps:\n" + "\n".join(found)
