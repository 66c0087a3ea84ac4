"""What each engine kind publishes in status.json's `slots` (how many requests each model holds
at once, while it runs): the router from each loaded model's /props (the real llama-server's
answers in tests/data/llama-server/, served by a local HTTP server at the runtime boundary),
vLLM from its launch (`--max-num-seqs`, else vLLM 0.32.0's own default on the device),
TensorFold from its `--parallel`."""

from __future__ import annotations

import copy
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from supervisor.docker import labels
from supervisor.docker.spec import Container
from supervisor.engines.base import Endpoint
from supervisor.engines.llama_router.engine import LlamaRouter, RouterLook
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.loader import load, parse
from supervisor.engines.look import Look, Prerequisites
from supervisor.engines.tensorfold.engine import TensorFold
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe, parallel
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.recipe import VllmRecipe, max_num_seqs
from tests.support import MINIMAL_RECIPE
from tests.unit.test_served_models import NoDocker

ROOT = Path(__file__).resolve().parents[2]
CAPTURED = ROOT / "tests" / "data" / "llama-server"


def container(container_id: str = "c1", status: str = "running", managed: bool = True) -> Container:
    found = {labels.MANAGED: "true"} if managed else {}
    return Container(container_id, "lucia-x", "sha256:" + "a" * 64, status, 0, False, "", found, ())


def look_at(
    found: Container | None, endpoint: Endpoint | None = None, own: Prerequisites | None = None
) -> Look[Any]:
    """A look that found this container, and nothing missing."""
    return Look(found, endpoint, (), None, own if own is not None else Prerequisites())


# -- vLLM: max_num_seqs --------------------------------------------------------------------------

VLLM = """
name = "v"
engine = "vllm"
[vllm]
DEVICE
served_name = "small"
max_model_len = 4096
tensor_parallel = TP
args = ARGS
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
shm_size = "512m"
memory = "8g"
"""


def vllm(args: list[str], device: str = "gpu", tp: int = 1) -> VllmRecipe:
    text = VLLM.replace("ARGS", json.dumps(args)).replace("TP", str(tp))
    recipe = parse(text.replace("DEVICE", f'device = "{device}"'))
    assert isinstance(recipe, VllmRecipe)
    return recipe


@pytest.mark.parametrize(
    ("device", "tp", "args", "expected"),
    [
        ("cpu", 1, [], 128),  # vLLM 0.32.0's CPU default for its OpenAI server
        ("cpu", 2, [], 256),  # 128 per tensor x pipeline rank
        ("gpu", 1, [], 256),  # the least of its GPU defaults (1024 on 70 GiB cards)
        ("gpu", 2, [], 256),
        ("gpu", 1, ["--max-num-seqs", "8"], 8),
        ("cpu", 1, ["--max_num_seqs=3"], 3),
        ("gpu", 1, ["--max-num-seqs", "8", "--max-num-seqs", "16"], 16),  # the last one wins
        ("gpu", 1, ["--performance-mode", "throughput"], 512),  # vLLM doubles its default
        ("gpu", 1, ["--performance-mode", "throughput", "--max-num-seqs", "8"], 8),
        ("gpu", 1, ["--max-num-batched-tokens", "64"], 64),  # vLLM caps its default by it
        ("gpu", 1, ["--max-num-batched-tokens", "64", "--max-num-seqs", "128"], 128),
        ("gpu", 1, ["--max-num-seqs", "8", "--data-parallel-size", "2"], 16),  # per rank
        ("gpu", 1, ["-dp=4"], 1024),
        ("gpu", 1, ["--max-num-seqs", "zero"], 256),  # vLLM refuses it itself
    ],
)
def test_vllm_runs_its_max_num_seqs_at_once(
    device: str, tp: int, args: list[str], expected: int
) -> None:
    assert max_num_seqs(vllm(args, device, tp)) == expected


def test_the_shipped_vllm_recipes_run_vllms_default() -> None:
    for name, expected in (("vllm.toml", 256), ("vllm-cpu.toml", 128)):
        recipe = load(ROOT / "recipes" / name)
        assert isinstance(recipe, VllmRecipe)
        assert max_num_seqs(recipe) == expected, name


def test_vllm_publishes_its_slots_under_its_first_name_only_while_it_runs(tmp_path: Path) -> None:
    recipe = vllm(["--max-num-seqs", "8", "--served-model-name", "a", "b"])
    engine = Vllm("v", recipe, NoDocker(), tmp_path / "state")
    assert engine.info.models == ("a", "b")
    assert engine.slots(look_at(container())) == {"a": 8}, "two names of one model: counted once"
    assert engine.slots(look_at(None)) == {}
    assert engine.slots(look_at(container(status="exited"))) == {}
    assert engine.slots(look_at(container(managed=False))) == {}


# -- TensorFold: --parallel ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "settings", "expected"),
    [
        ('["tensorfold", "serve", "m", "--parallel", "${PARALLEL}"]', "PARALLEL = 4", 4),
        ('["tensorfold", "serve", "m", "--parallel=2"]', "PARALLEL = 4", 2),  # what runs wins
        ('["tensorfold", "serve", "m"]', "PARALLEL = 3", 3),
        ('["tensorfold", "serve", "m"]', "OTHER = 1", None),  # its own default is not assumed
        ('["tensorfold", "serve", "m", "--parallel", "${PARALLEL}"]', 'PARALLEL = "0"', None),
    ],
)
def test_tensorfold_serves_its_parallel_setting_at_once(
    command: str, settings: str, expected: int | None
) -> None:
    text = MINIMAL_RECIPE.replace("[run]", f"[settings]\n{settings}\n[run]")
    recipe = parse(text + f"command = {command}\n")
    assert isinstance(recipe, TensorFoldRecipe)
    assert parallel(recipe) == expected


def test_the_spark_recipe_serves_four_at_once(tmp_path: Path) -> None:
    recipe = load(ROOT / "recipes" / "spark-model.toml")
    assert isinstance(recipe, TensorFoldRecipe)
    engine = TensorFold("spark", recipe, NoDocker(), tmp_path / "state")
    assert engine.slots(look_at(container())) == {"Qwen3.8-Flash-Next": 4}
    assert engine.slots(look_at(None)) == {}


# -- the router: each loaded model's /props --------------------------------------------------------

ROUTER = """
name = "router"
engine = "llama-router"
[library]
models_dir = "{models}"
cache_dir = "{cache}"
[router]
image = "lucia-test/llama:1"
models_max = 2
[settings]
{settings}
[run]
port = 18080
"""


class RouterAnswers(http.server.BaseHTTPRequestHandler):
    """A real router's recorded /models and /props?model=tiny&autoload=false; paths asked."""

    answers: ClassVar[dict[str, Any]] = {}
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).asked.append(self.path)
        found = self.answers.get(self.path)
        body = json.dumps(found if found is not None else {"error": {"code": 400}}).encode()
        self.send_response(200 if found is not None else 400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answers() -> Iterator[tuple[type[RouterAnswers], Endpoint]]:
    class Handler(RouterAnswers):
        answers: ClassVar[dict[str, Any]] = {}
        asked: ClassVar[list[str]] = []

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Handler, Endpoint("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def router(tmp_path: Path, settings: str = "") -> LlamaRouter:
    recipe = parse(
        ROUTER.format(models=tmp_path / "models", cache=tmp_path / "cache", settings=settings)
    )
    assert isinstance(recipe, LlamaRouterRecipe)
    (tmp_path / "state").mkdir(exist_ok=True)
    return LlamaRouter("router", recipe, NoDocker(), tmp_path / "state")


def looked(engine: LlamaRouter, found: Container, endpoint: Endpoint) -> dict[str, int]:
    """The slots of one look at a router that runs (its /models polled, its /props asked)."""
    return engine.slots(engine.seen(look_at(found, endpoint, RouterLook())))


def recorded(name: str) -> dict[str, Any]:
    return dict(json.loads((CAPTURED / f"{name}.json").read_text()))


PROPS = "/props?model=tiny&autoload=false"


def test_the_router_publishes_each_loaded_models_slots_asking_once_per_child(
    tmp_path: Path, answers: tuple[type[RouterAnswers], Endpoint]
) -> None:
    handler, endpoint = answers
    auto = recorded("auto-ctx256")  # the demo's: 4 slots sharing 256 cells
    handler.answers.update({"/models": auto["models"], PROPS: auto["props"]})
    engine = router(tmp_path)
    assert looked(engine, container("one"), endpoint) == {"tiny": 1}
    assert looked(engine, container("one"), endpoint) == {"tiny": 1}
    assert handler.asked.count(PROPS) == 1, "a child's slots are read once"
    # a model's /props is asked without loading it (the router's own /props is its build)
    assert not any("autoload=false" not in path for path in handler.asked if "props?" in path)

    explicit = recorded("parallel4-ctx1024")  # reloaded with --parallel 4: a new child
    handler.answers.update({"/models": explicit["models"], PROPS: explicit["props"]})
    assert looked(engine, container("one"), endpoint) == {"tiny": 4}
    assert handler.asked.count(PROPS) == 2
    assert looked(engine, container("two"), endpoint) == {"tiny": 4}, "a new container: asked"
    assert handler.asked.count(PROPS) == 3

    unloaded = copy.deepcopy(explicit["models"])
    unloaded["data"][0]["status"]["value"] = "unloaded"
    handler.answers["/models"] = unloaded
    assert looked(engine, container("two"), endpoint) == {}, "an unloaded model has no slots"
    assert handler.asked.count(PROPS) == 3, "and is never asked (a /props would load it)"
    assert looked(engine, container("two", status="exited"), endpoint) == {}


def test_the_router_leaves_out_a_model_whose_props_do_not_answer(
    tmp_path: Path, answers: tuple[type[RouterAnswers], Endpoint]
) -> None:
    handler, endpoint = answers
    handler.answers["/models"] = recorded("auto-ctx256")["models"]  # /props: 400
    engine = router(tmp_path)
    assert looked(engine, container(), endpoint) == {}
    handler.answers[PROPS] = recorded("auto-ctx256")["props"]
    assert looked(engine, container(), endpoint) == {"tiny": 1}, "asked again at the next look"


def test_the_routers_environment_counts_as_its_childs(
    tmp_path: Path, answers: tuple[type[RouterAnswers], Endpoint]
) -> None:
    """LLAMA_ARG_N_PARALLEL in the recipe's settings (the container's environment) reaches the
    child without a flag on its command line (recorded: 2 slots, a cache each)."""
    handler, endpoint = answers
    found = recorded("env-parallel2-ctx256")
    handler.answers.update({"/models": found["models"], PROPS: found["props"]})
    engine = router(tmp_path, 'LLAMA_ARG_N_PARALLEL = "2"')
    assert looked(engine, container(), endpoint) == {"tiny": 2}
    unset = router(tmp_path)
    assert unset.slots(look_at(container(), endpoint, RouterLook())) == {}, "no listing: none"
    # not knowing of the variable, the child's slots would count as auto's: one shared cache
    assert looked(unset, container(), endpoint) == {"tiny": 1}
