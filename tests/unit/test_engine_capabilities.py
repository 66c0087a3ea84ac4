"""What each engine kind declares its models serve (status.json's capabilities), as pure rules
in tables and as answers of one look: vLLM's runner as vLLM 0.32.0 resolves it, or the routes
the running server states; llama-server's child arguments and its GGUF's pooling; TensorFold's
chat model; a recipe's own `capabilities` over any kind's rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from supervisor.engines.base import Endpoint
from supervisor.engines.llama_router import api as router_api
from supervisor.engines.llama_router import serves
from supervisor.engines.llama_router.engine import LlamaRouter, RouterLook
from supervisor.engines.llama_router.library_sync import Synced
from supervisor.engines.llama_router.preset import render
from supervisor.engines.loader import load
from supervisor.engines.look import Look, Prerequisites
from supervisor.engines.tensorfold.engine import TensorFold
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.engines.vllm import model as hf_model
from supervisor.engines.vllm import tasks
from supervisor.engines.vllm.engine import Vllm
from supervisor.engines.vllm.steps import VllmLook
from supervisor.library.ggufmeta import read_metadata
from supervisor.protocol.documents import GENERATION
from tests.gguf_fixtures import write_model
from tests.unit.test_engine_slots import ROUTER, container, vllm
from tests.unit.test_served_models import NoDocker

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT = Endpoint("172.30.0.1", 18080)
EMBEDDING = ("embedding",)

# -- vLLM ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "architectures", "pooling_config", "runner", "found"),
    [
        ([], ["LlamaForCausalLM"], False, ("generate", "none"), GENERATION),
        ([], ["Qwen2VLForConditionalGeneration"], False, ("generate", "none"), GENERATION),
        ([], ["BertModel"], False, ("pooling", "embed"), EMBEDDING),  # "Model": pooling, embed
        ([], ["XLMRobertaForSequenceClassification"], False, ("pooling", "classify"), ()),
        ([], ["Qwen3ForCausalLM"], True, ("pooling", "embed"), EMBEDDING),  # modules.json
        ([], ["BertForSequenceClassification"], True, ("pooling", "classify"), ()),
        ([], [], False, ("generate", "none"), GENERATION),  # vLLM's fallback
        (["--runner", "pooling"], ["LlamaForCausalLM"], False, ("pooling", "embed"), EMBEDDING),
        (["--runner=pooling"], ["LlamaForCausalLM"], False, ("pooling", "embed"), EMBEDDING),
        (["--convert", "embed"], ["LlamaForCausalLM"], False, ("pooling", "embed"), EMBEDDING),
        (["--convert", "classify"], ["LlamaForCausalLM"], False, ("pooling", "classify"), ()),
        (["--runner", "generate"], ["BertModel"], True, ("generate", "none"), GENERATION),
        (
            ["--runner", "pooling", "--convert", "none"],
            ["BertModel"],
            False,
            ("pooling", "embed"),
            EMBEDDING,
        ),  # a model that pools natively embeds
        (
            ["--runner", "auto", "--convert", "auto"],
            ["GPT2LMHeadModel"],
            False,
            ("generate", "none"),
            GENERATION,
        ),
        (
            ["--runner", "pooling", "--runner", "generate"],
            ["BertModel"],
            False,
            ("generate", "none"),
            GENERATION,
        ),  # the last one wins
    ],
)
def test_vllm_resolves_its_runner_as_vllm_does(
    args: list[str],
    architectures: list[str],
    pooling_config: bool,
    runner: tuple[str, str],
    found: tuple[str, ...],
) -> None:
    assert tasks.resolve(args, architectures, pooling_config) == runner
    assert tasks.serves(args, architectures, pooling_config) == found


@pytest.mark.parametrize(
    ("paths", "found"),
    [
        # vLLM 0.32.0's /openapi.json paths of a generate model (test_gateway_vllm_capabilities)
        (["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"], GENERATION),
        (["/v1/embeddings", "/pooling", "/v1/models"], EMBEDDING),
        (["/classify", "/v1/models"], ()),
        (["/v1/responses", "/v1/chat/completions"], ("chat", "responses")),
    ],
)
def test_vllm_serves_the_routes_it_states(paths: list[str], found: tuple[str, ...]) -> None:
    assert tasks.from_routes(paths) == found
    assert tasks.routes({"paths": {p: {} for p in paths}}) == tuple(sorted(paths))


@pytest.mark.parametrize("answer", [None, [], {}, {"paths": {}}, {"paths": ["/v1/models"]}])
def test_an_answer_naming_no_routes_is_not_known(answer: Any) -> None:
    assert tasks.routes(answer) is None


@pytest.mark.parametrize(
    ("modules", "pooled"),
    [
        ([{"idx": 1, "type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}], True),
        ([{"type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}], True),
        ([{"type": "sentence_transformers.models.Transformer"}], False),
        ([{"type": "my.Pooling"}], False),
        ({"type": "sentence_transformers.models.Pooling"}, False),
        (None, False),
    ],
)
def test_a_sentence_transformers_pooling_is_read_as_vllm_reads_it(
    modules: Any, pooled: bool
) -> None:
    assert tasks.pooling_config(modules) is pooled


def vllm_engine(tmp_path: Path, args: list[str]) -> Vllm:
    return Vllm("v", vllm(["--served-model-name", "a", "b", *args]), NoDocker(), tmp_path / "s")


@pytest.mark.parametrize(
    ("running", "own", "found"),
    [
        # while it runs, the routes it states, whatever its files say
        (
            True,
            VllmLook(routes=("/v1/embeddings",), architectures=("LlamaForCausalLM",)),
            EMBEDDING,
        ),
        # its routes not read: what its arguments and files resolve to
        (True, VllmLook(architectures=("LlamaForCausalLM",)), GENERATION),
        (
            False,
            VllmLook(routes=("/v1/embeddings",), architectures=("LlamaForCausalLM",)),
            GENERATION,
        ),
        (False, VllmLook(architectures=("BertModel",)), EMBEDDING),
        (False, VllmLook(), None),  # its config.json not there yet (a download to come)
    ],
)
def test_vllm_declares_one_answer_for_each_of_its_names(
    tmp_path: Path, running: bool, own: VllmLook, found: tuple[str, ...] | None
) -> None:
    engine = vllm_engine(tmp_path, [])
    look = Look(container() if running else None, ENDPOINT, (), None, own)
    expected = {} if found is None else {"a": found, "b": found}
    assert engine.capabilities(look) == expected


def test_vllm_reads_its_models_files_in_its_look(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (model / "modules.json").write_text(
        json.dumps([{"type": tasks.POOLING_MODULES.__iter__().__next__()}])
    )

    assert hf_model.read_tasks(model) == (("BertModel",), True)
    assert hf_model.read_tasks(tmp_path / "none") == (None, False)
    assert hf_model.read_tasks(None) == (None, False)


# -- llama-server --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "environment", "declared", "found"),
    [
        ((), {}, "none", GENERATION),  # a chat GGUF
        (("--embeddings",), {}, "mean", EMBEDDING),  # an embedding GGUF, as its section has it
        (("--embedding",), {}, "cls", EMBEDDING),
        (("--embeddings",), {}, "last", EMBEDDING),
        ((), {}, "mean", ()),  # an embedding GGUF without the flag: 501, and it does not chat
        (("--embeddings",), {}, "none", ()),  # a chat GGUF with it: 400, and its chat dies
        (("--embeddings",), {}, "rank", ()),  # a reranker
        (("--embeddings", "--pooling", "mean"), {}, "none", EMBEDDING),
        (("--embeddings", "--pooling=none"), {}, "mean", ()),
        ((), {"LLAMA_ARG_EMBEDDINGS": "1"}, "mean", EMBEDDING),
        ((), {"LLAMA_ARG_EMBEDDINGS": "true", "LLAMA_ARG_POOLING": "cls"}, "none", EMBEDDING),
        ((), {"LLAMA_ARG_EMBEDDINGS": "0"}, "none", GENERATION),
    ],
)
def test_a_router_model_serves_what_its_child_and_its_gguf_say(
    args: tuple[str, ...], environment: dict[str, str], declared: str, found: tuple[str, ...]
) -> None:
    assert serves.serves(args, environment, declared) == found


@pytest.mark.parametrize(
    ("pooling", "declared"),
    [
        (None, "none"),
        (gguf.PoolingType.NONE, "none"),
        (gguf.PoolingType.MEAN, "mean"),
        (gguf.PoolingType.CLS, "cls"),
        (gguf.PoolingType.LAST, "last"),
        (gguf.PoolingType.RANK, "rank"),
    ],
)
def test_the_pooling_a_gguf_declares(
    tmp_path: Path, pooling: gguf.PoolingType | None, declared: str
) -> None:
    path = write_model(tmp_path / "m.gguf", pooling=pooling)
    assert serves.pooling(read_metadata(path)) == declared
    assert serves.pooled(declared) is (pooling not in (None, gguf.PoolingType.NONE))


@pytest.mark.parametrize(
    ("defaults", "embeddings", "args"),
    [
        ({}, False, ()),
        ({}, True, ("--embeddings",)),
        ({"embeddings": True}, False, ("--embeddings",)),
        ({"ctx-size": 4096, "pooling": "cls"}, True, ("--embeddings", "--pooling", "cls")),
    ],
)
def test_the_arguments_a_preset_gives_a_model(
    defaults: dict[str, Any], embeddings: bool, args: tuple[str, ...]
) -> None:
    assert serves.preset_args(defaults, embeddings) == args


class Section:
    def __init__(self, name: str) -> None:
        self.name, self.model_file, self.mmproj_file = name, f"{name}/{name}.gguf", None


def test_an_embedding_models_section_serves_embeddings() -> None:
    text = render([Section("chat"), Section("emb")], {}, [], "/models", embeddings=["emb"])
    assert "[emb]\nmodel = /models/emb/emb.gguf\nembeddings = true\n" in text
    assert "[chat]\nmodel = /models/chat/chat.gguf\n\n" in text


def router_look(
    tmp_path: Path, listing: tuple[router_api.ModelState, ...] | None, running: bool = True
) -> tuple[LlamaRouter, Look[RouterLook]]:
    recipe = load_text(
        tmp_path, ROUTER.format(models=tmp_path / "models", cache=tmp_path / "cache", settings="")
    )
    (tmp_path / "state").mkdir(exist_ok=True)
    engine = LlamaRouter("router", recipe, NoDocker(), tmp_path / "state")
    synced = Synced(
        "lib",
        (("chat", "chat.gguf", None), ("emb", "emb.gguf", None)),
        "preset",
        pooling={"chat": "none", "emb": "mean"},
    )
    own = RouterLook((), None, None, ("chat", "emb", "new"), True, synced, listing)
    return engine, Look(container() if running else None, ENDPOINT, (), None, own)


def load_text(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load(path)


def test_a_stopped_router_declares_each_synced_model_from_its_preset(tmp_path: Path) -> None:
    engine, look = router_look(tmp_path, None, running=False)
    # `new` is named (Ready since the last sync) but no sync read its GGUF: not known
    assert engine.capabilities(look) == {"chat": GENERATION, "emb": EMBEDDING}


def test_a_running_router_declares_a_loaded_model_from_its_childs_arguments(
    tmp_path: Path,
) -> None:
    listing = (
        router_api.ModelState("chat", "loaded", args=("llama-server", "--embeddings")),
        router_api.ModelState("emb", "unloaded", args=("llama-server", "--embeddings")),
    )
    engine, look = router_look(tmp_path, listing)
    # an operator's --embeddings for the chat model: it serves neither (the router's own facts)
    assert engine.capabilities(look) == {"chat": (), "emb": EMBEDDING}


# -- TensorFold and the recipe's word ------------------------------------------------------------


def tensorfold(tmp_path: Path, extra: str = "") -> TensorFold:
    text = (ROOT / "recipes" / "spark-model.toml").read_text()
    recipe = (
        load_text(tmp_path, extra + text) if extra else load(ROOT / "recipes" / "spark-model.toml")
    )
    assert isinstance(recipe, TensorFoldRecipe)
    return TensorFold("spark", recipe, NoDocker(), tmp_path / "state")


def test_tensorfold_serves_chat_and_completions_of_its_model(tmp_path: Path) -> None:
    engine = tensorfold(tmp_path)
    look: Look[Prerequisites] = Look(None, ENDPOINT, (), None, Prerequisites())
    names = engine.served(look)
    assert names and engine.capabilities(look) == dict.fromkeys(names, ("chat", "completion"))


def test_a_recipes_own_capabilities_stand_for_every_name_in_every_state(tmp_path: Path) -> None:
    engine = tensorfold(tmp_path, 'capabilities = ["responses", "chat"]\n')
    look: Look[Prerequisites] = Look(None, ENDPOINT, (), None, Prerequisites())
    assert set(engine.capabilities(look).values()) == {("chat", "responses")}
    (tmp_path / "r").mkdir()
    router, stopped = router_look(tmp_path / "r", None, running=False)
    assert router.capabilities(stopped)  # the kind's own, without one


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('capabilities = ["chat", "chat"]', "each capability is named once"),
        ('capabilities = ["rerank"]', "capabilities.0"),
        ('capabilities = "chat"', "capabilities"),
    ],
)
def test_a_recipes_capabilities_are_checked(tmp_path: Path, line: str, words: str) -> None:
    text = (ROOT / "recipes" / "spark-model.toml").read_text()
    with pytest.raises(ValueError, match=words):
        load_text(tmp_path, line + "\n" + text)
