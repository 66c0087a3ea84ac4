"""The TensorFold engine's own pure parts: what its prepare commands are given."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Image
from supervisor.engines.base import Endpoint
from supervisor.engines.loader import parse
from supervisor.engines.look import EngineImage
from supervisor.engines.tensorfold.engine import TensorFold
from tests.support import MINIMAL_RECIPE
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


@pytest.mark.parametrize("data", [Path("/home/u/.local/share/lucia/host/data"), None])
def test_the_container_names_the_data_directory_of_its_installation(
    tmp_path: Path, data: Path | None
) -> None:
    """install.sh --purge tells this installation's engine containers from another user's by
    this label; a worker with no data directory (none is planned) puts none on."""
    recipe = parse(MINIMAL_RECIPE, "x.toml")
    engine = TensorFold("x", recipe, Runtime(), tmp_path, data)  # type: ignore[arg-type]
    found = EngineImage("img:1", Image(id="sha256:" + "a" * 64, labels={}))
    marks = engine.run_spec(found, Endpoint("172.17.0.1", 8123)).labels
    assert (marks[labels.MANAGED], marks[labels.NAME]) == ("true", "x")
    assert marks.get(labels.DATA) == (None if data is None else str(data))
