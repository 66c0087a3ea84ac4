"""The TensorFold engine's own pure parts: what its prepare commands are given."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.docker.runtime import Runtime
from supervisor.engines.loader import parse
from supervisor.engines.tensorfold.engine import TensorFold
from tests.unit.test_plan import PREPARE_MAKES_IMAGE


def test_the_prepare_environment_has_no_token_of_the_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The prepare's environment: PATH, HOME, the settings with the caches expanded, and a
    token only when the recipe has one as a secret."""
    monkeypatch.setenv("HF_TOKEN", "hf_theworkers")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_theworkers")
    monkeypatch.setenv("HOME", str(tmp_path))
    text = PREPARE_MAKES_IMAGE + '[settings]\nHF_CACHE = "~/hf"\nKERNEL_CACHE = "~/k"\n'
    engine = TensorFold("x", parse(text, "x.toml"), Runtime(), tmp_path)  # type: ignore[arg-type]
    env = engine.prepare_environment()
    assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env
    assert env["HF_HUB_DISABLE_IMPLICIT_TOKEN"] == "1"
    assert (env["HF_CACHE"], env["KERNEL_CACHE"]) == (f"{tmp_path}/hf", f"{tmp_path}/k")
    token = tmp_path / "token"
    token.write_text("hf_therecipes\n")
    text += f'[secrets]\nHF_TOKEN = "{token}"\n'
    engine = TensorFold("x", parse(text, "x.toml"), Runtime(), tmp_path)  # type: ignore[arg-type]
    env = engine.prepare_environment()
    assert env["HF_TOKEN"] == "hf_therecipes" and "HF_HUB_DISABLE_IMPLICIT_TOKEN" not in env
    assert "HUGGING_FACE_HUB_TOKEN" not in env
