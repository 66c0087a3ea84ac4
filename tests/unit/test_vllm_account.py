"""Who the vLLM engine runs as: the worker's uid and gid, its HOME and HF_HOME, in the run spec,
its fingerprint and the download step; and recipes that still point into /root refused."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from supervisor.docker.spec import RunSpec, changed_settings
from supervisor.engines.base import Endpoint, StepContext
from supervisor.engines.loader import parse
from supervisor.engines.look import EngineImage
from supervisor.engines.vllm import account, tier_image
from supervisor.engines.vllm import model as hf_model
from supervisor.engines.vllm.model import ModelDownload
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.recipe.schema import RecipeError
from tests.unit.test_vllm_engine import _downloaded, _hf_engine, _Images

WORKER = f"{os.getuid()}:{os.getgid()}"


@pytest.mark.parametrize(
    ("targets", "settings", "refused"),
    [
        (["/var/cache/huggingface"], {}, None),
        (["/cache", "/models/x"], {"HF_HOME": "/var/cache/hf"}, None),
        (["/rootfs/cache"], {}, None),  # only /root itself and below it
        (["/root/.cache/huggingface"], {}, "/root/.cache/huggingface"),
        (["/root"], {}, "/root"),
        ([], {"HF_HOME": "/root/.cache/huggingface"}, "HF_HOME=/root/.cache/huggingface"),
        ([], {"HF_HUB_CACHE": "/root/hub"}, "HF_HUB_CACHE=/root/hub"),
    ],
)
def test_what_points_into_root_is_refused_with_the_fix(
    targets: list[str], settings: dict[str, str], refused: str | None
) -> None:
    why = account.refused_paths(targets, settings)
    if refused is None:
        assert why is None
    else:
        assert why is not None and why.startswith(refused + ":")
        assert f'target = "{account.HF_HOME}"' in why and "not root" in why


@pytest.mark.parametrize(
    ("settings", "home", "hub"),
    [
        ({}, account.HF_HOME, f"{account.HF_HOME}/hub"),
        ({"HF_HOME": "/hf"}, "/hf", "/hf/hub"),
        ({"HF_HUB_CACHE": "/hub"}, account.HF_HOME, "/hub"),  # huggingface_hub: the cache wins
    ],
)
def test_the_engine_environment_and_the_hub_cache_agree(
    settings: dict[str, str], home: str, hub: str
) -> None:
    found = account.environment(settings)
    assert found["HOME"] == account.ENGINE_HOME
    assert found["USER"] == found["LOGNAME"] != ""
    assert found["HF_HOME"] == home
    assert str(hf_model.hub_cache(found)) == str(hf_model.hub_cache(settings)) == hub


def test_the_engine_runs_as_the_worker_and_a_change_of_user_replaces_it(tmp_path: Path) -> None:
    found = _hf_engine(tmp_path)
    _downloaded(tmp_path, {})
    image = _Images().image("x")
    assert image is not None
    spec = found.run_spec(
        EngineImage(tier_image.tag("vllm/vllm-openai:v0.32.0"), image), Endpoint("172.17.0.1", 8000)
    )
    assert spec.user == WORKER
    assert spec.environment["HOME"] == account.ENGINE_HOME
    assert spec.environment["HF_HOME"] == account.HF_HOME
    other = RunSpec(**{**spec.__dict__, "user": "4242:4242"})
    assert changed_settings(spec.fingerprint(), other.fingerprint()) == ("user",)


def test_a_container_without_a_user_keeps_its_fingerprint() -> None:
    """Engines that set none (tensorfold, llama-router) are not replaced by the new field."""
    spec = RunSpec("n", "img", "lucia", "172.17.0.1", 8000, 8000)
    assert "user=" not in spec.fingerprint()
    assert spec.fingerprint().split(",")[-1].startswith("labels=")


class _Download(_Images):
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.calls: list[dict[str, object]] = []

    def run_streamed(self, image_id: str, *args: object, **kwargs: object) -> tuple[int, list[str]]:
        self.calls.append(kwargs)
        _downloaded(self.tmp, {"num_hidden_layers": 2})
        return 0, ["done"]


def test_the_download_runs_as_the_engines_user_with_its_home(tmp_path: Path) -> None:
    found = _hf_engine(tmp_path)
    runtime = _Download(tmp_path)
    found.runtime = runtime
    found.make(
        ModelDownload("org/model", "0123456789abcdef0123456789abcdef01234567"),
        StepContext(threading.Event(), lambda _line: None),
    )
    (call,) = runtime.calls
    assert call["user"] == WORKER
    environment = call["environment"]
    assert isinstance(environment, dict)
    assert environment["HOME"] == account.ENGINE_HOME
    assert environment["HF_HOME"] == account.HF_HOME


def test_a_recipe_mounting_the_cache_in_root_is_refused() -> None:
    text = """
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
volumes = [{ source = "/srv/hf", target = "/root/.cache/huggingface" }]
"""
    with pytest.raises(RecipeError) as refused:
        parse(text)
    assert "/root/.cache/huggingface: the vLLM engine runs as the service user" in str(
        refused.value
    )
    assert isinstance(parse(text.replace("/root/.cache/huggingface", account.HF_HOME)), VllmRecipe)
