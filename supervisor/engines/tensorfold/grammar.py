"""The grammar image: the recipe image plus a pinned xgrammar, proven to import with the engine.

Never the engine's own `[grammar]` extra: that would reinstall the engine over the patched one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from supervisor.docker.labels import GRAMMAR_BASE, GRAMMAR_MODULES, GRAMMAR_REQUIREMENT
from supervisor.engines.tensorfold.recipe import Grammar

MESSAGE: Final = "Adding structured output support to the TensorFold image"


def labels(grammar: Grammar, base_id: str) -> dict[str, str]:
    return {
        GRAMMAR_BASE: base_id,
        GRAMMAR_REQUIREMENT: grammar.requirement,
        GRAMMAR_MODULES: ",".join(grammar.modules),
    }


def current(grammar: Grammar, base_id: str, image_labels: Mapping[str, str]) -> bool:
    """Pure: is an image with these labels the grammar image of this base and pin?"""
    want = labels(grammar, base_id)
    return all(image_labels.get(key) == value for key, value in want.items())


def dockerfile(grammar: Grammar, base_ref: str) -> str:
    """Exec-form steps (JSON arrays): the pin and module names are never shell-interpreted."""
    install = [grammar.python, "-m", "pip", "install", "--no-cache-dir", grammar.requirement]
    check = [grammar.python, "-c", "import " + ", ".join(grammar.modules)]
    return f"FROM {base_ref}\nRUN {json.dumps(install)}\nRUN {json.dumps(check)}\n"
