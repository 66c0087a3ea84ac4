"""`[vllm] device = "cpu"`: no GPU is read, the recipe's image and KV-cache space run, and the
memory plan counts the container's limit (a GPU recipe: its share of the limit)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, Image
from supervisor.engines.base import Endpoint
from supervisor.engines.loader import parse
from supervisor.engines.look import EngineImage, Look
from supervisor.engines.vllm import memory
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.kind import KIND
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.engines.vllm.steps import MemoryFit, Preflight, VllmLook
from supervisor.memplan.fit import Budget
from supervisor.recipe.schema import RecipeError
from supervisor.worker import plan

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3


def cpu_recipe(tmp: Path, vllm: str = "", run: str = 'shm_size = "512m"\nmemory = "6g"') -> str:
    return f"""
name = "c"
engine = "vllm"
model = "tiny"
[vllm]
device = "cpu"
served_name = "tiny"
max_model_len = 1024
nvidia_smi = "{tmp / "no-such-nvidia-smi"}"
{vllm}
[vllm.model.library]
models_dir = "{tmp / "library"}"
guid = "g1"
[run]
port = 8000
{run}
"""


def parsed(text: str) -> VllmRecipe:
    found = parse(text)
    assert isinstance(found, VllmRecipe)
    return found


class NoDocker(Runtime):
    """The runtime boundary with the image present and nothing running."""

    def image(self, ref: str) -> Image | None:
        return Image(id="sha256:" + "a" * 64, labels={})

    def container(self, name: str) -> None:
        return None


def test_a_cpu_engine_reads_no_gpu_and_runs_the_recipes_image(tmp_path: Path) -> None:
    (tmp_path / "library" / "g1" / "files").mkdir(parents=True)
    engine = Vllm(
        "c",
        parsed(cpu_recipe(tmp_path, 'image = "reg.example/vllm-cpu:1"')),
        NoDocker(),
        tmp_path / "state",
    )
    wanted = engine.prerequisites()
    assert not any(isinstance(p, Preflight) for p in wanted.missing)  # no nvidia-smi is run
    assert wanted.image is not None and wanted.image.ref == "reg.example/vllm-cpu:1"
    command = engine.command()
    assert command[:2] == ("--model", "/models/g1")  # the image runs the api_server module
    assert "--served-model-name" in command and "tiny" in command
    assert not any("gpu" in arg for arg in command)
    engine.check_more(None, None)  # type: ignore[arg-type]  # nothing to read: no GPU
    spec = engine.run_spec(wanted.image, Endpoint("172.17.0.1", 8123))
    assert spec.environment["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert (spec.memory, spec.shm_size) == (f"{6 * GIB}b", f"{512 * 1024**2}b")


@pytest.mark.parametrize(
    ("vllm", "run", "says"),
    [
        ("", 'memory = "4g"', "run.shm_size over 160 MiB"),
        ("", 'shm_size = "64m"\nmemory = "4g"', "run.shm_size over 160 MiB"),
        ("", 'shm_size = "512m"', "needs run.memory"),
        ("kv_cache_gib = 4", 'shm_size = "512m"\nmemory = "4g"', "needs run.memory"),
        (
            'channel = "nightly"\nnightly_commit = "' + "a" * 40 + '"',
            'shm_size = "512m"\nmemory = "4g"',
            "device cpu runs vllm.image",
        ),
        ('quantization = "fp8"', 'shm_size = "512m"\nmemory = "4g"', "device cpu runs"),
    ],
)
def test_a_cpu_recipe_without_room_is_refused_with_what_to_set(
    tmp_path: Path, vllm: str, run: str, says: str
) -> None:
    with pytest.raises(RecipeError, match=says):
        parse(cpu_recipe(tmp_path, vllm, run))


def test_the_plan_counts_the_cpu_containers_limit(tmp_path: Path) -> None:
    recipe = parsed(cpu_recipe(tmp_path))
    fits = KIND.memory(recipe, Budget(24 * GIB, 18 * GIB), 2.0)
    assert fits.verdict is not None and fits.verdict.need.need == 6 * GIB and fits.fits
    refused = KIND.memory(recipe, Budget(24 * GIB, 19 * GIB), 2.0)
    assert refused.verdict is not None and not refused.fits
    assert "Lower run.memory" in refused.verdict.message


def test_the_plan_counts_a_gpu_recipes_share_of_the_limit() -> None:
    recipe = parsed((ROOT / "recipes" / "vllm.toml").read_text())
    planned = KIND.memory(recipe, Budget(80 * GIB, 2 * GIB, host=False), 2.0)  # limit = "gpu"
    assert planned.verdict is not None and planned.verdict.need.need == 72 * GIB
    assert planned.fits
    assert memory.gpu_need(recipe, 100 * GIB, host=False).need == 90 * GIB


def test_the_shipped_cpu_recipe_loads_and_is_planned() -> None:
    recipe = parsed((ROOT / "recipes" / "vllm-cpu.toml").read_text())
    assert recipe.vllm.device == "cpu"
    planned = KIND.memory(recipe, Budget(24 * GIB, 18 * GIB), 2.0)
    assert planned.verdict is not None and planned.fits


def test_engine_image_is_what_the_spec_runs(tmp_path: Path) -> None:
    engine = Vllm("c", parsed(cpu_recipe(tmp_path)), NoDocker(), tmp_path / "state")
    found = EngineImage(
        "lucia-vllm-cpu:0.32.0-torch2.13.0", Image(id="sha256:" + "b" * 64, labels={})
    )
    assert engine.run_spec(found, Endpoint("172.17.0.1", 8123)).image == "sha256:" + "b" * 64


class NoImage(NoDocker):
    """The image is not on this dockerd: a start would pull it."""

    def image(self, ref: str) -> Image | None:
        return None


def test_a_missing_cpu_image_is_pulled_only_after_run_memory_fits(tmp_path: Path) -> None:
    (tmp_path / "library" / "g1" / "files").mkdir(parents=True)
    engine = Vllm(
        "c", parsed(cpu_recipe(tmp_path)), NoImage(), tmp_path / "state", tmp_path / "data"
    )
    (first,) = engine.prerequisites().missing
    assert first == MemoryFit(6 * GIB)  # before the pull: nothing is fetched for a refusal
    assert memory.refused(memory.cpu_fit(engine.recipe, 24 * GIB, 18 * GIB)) is None
    why = memory.refused(memory.cpu_fit(engine.recipe, 8 * GIB, 4 * GIB))
    assert why is not None and "needs 6.0 GiB, 4.0 GiB left" in why and "Lower run.memory" in why


class VersionServer(http.server.BaseHTTPRequestHandler):
    """vLLM's /version, answering whatever body the test gives it; `asked` counts its asks
    (a look also reads the routes, /openapi.json, here not found)."""

    body = b'{"version": "0.32.0"}'
    asked = 0

    def do_GET(self) -> None:
        if self.path == "/version":
            type(self).asked += 1
        self.send_response(200 if self.path == "/version" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def running(container_id: str) -> Container:
    return Container(container_id, "c", "sha256:" + "a" * 64, "running", 0, False, "", {}, ())


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (b'{"version": "0.32.0"}', "0.32.0"),
        (b'{"version": "0.32.0\\u001b[31m red"}', None),  # never an answer's other text
        (b'{"version": 32}', None),
        (b"not json", None),
    ],
)
def test_the_version_is_what_vllm_says_once_per_container(
    tmp_path: Path, body: bytes, shown: str | None
) -> None:
    (tmp_path / "library" / "g1" / "files").mkdir(parents=True)
    engine = Vllm("c", parsed(cpu_recipe(tmp_path)), NoDocker(), tmp_path / "state")

    class Handler(VersionServer):
        pass

    handler = Handler
    handler.body, handler.asked = body, 0
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = Endpoint("127.0.0.1", server.server_address[1])

        def version(found: Container | None) -> str | None:  # one look: its answer
            return engine.version(engine.seen(Look(found, endpoint, (), None, VllmLook())))

        assert version(None) is None and handler.asked == 0
        assert version(running("one")) == shown
        assert version(running("one")) == shown
        assert handler.asked == (1 if shown else 2)  # a version read is not asked again
        if shown:
            assert version(running("two")) == shown and handler.asked == 2  # a new one
    finally:
        server.shutdown()
        server.server_close()


def test_status_names_the_version_the_engine_reported() -> None:
    engine = plan.running_engine(running("one"), "0.32.0")
    assert json.loads(engine.model_dump_json(by_alias=True))["engineVersion"] == "0.32.0"
    assert plan.running_engine(running("one")).engine_version is None
