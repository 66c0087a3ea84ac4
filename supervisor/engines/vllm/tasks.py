"""What a vLLM server serves, as capabilities, pure.

The routes the running server states, else its runner as vLLM 0.32.0 resolves it from its
arguments and its model (vllm/config/model.py).

A server runs one model for one runner. `generate` serves /v1/chat/completions,
/v1/completions and /v1/responses; `pooling` with the `embed` conversion serves /v1/embeddings;
pooling for `classify` serves none of the four. vLLM registers only the routes of its tasks
(entrypoints/launchers/api_server/routers.py), so the running server's `/openapi.json` paths are
what it serves; before it runs (or with `--disable-fastapi-docs`) its runner is resolved as
vLLM resolves `--runner auto` and `--convert auto`: a Sentence Transformers pooling config
(modules.json) or a `--convert` other than none means pooling, else the first architecture of
config.json whose suffix vLLM knows. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from supervisor.engines.flags import flag_values
from supervisor.protocol.documents import GENERATION, Capability, capabilities

Runner = Literal["generate", "pooling"]
Convert = Literal["none", "embed", "classify"]

# vLLM 0.32.0's _SUFFIX_TO_DEFAULTS, in its order (the first suffix that matches wins)
SUFFIXES: Final[tuple[tuple[str, Runner, Convert], ...]] = (
    ("ForCausalLM", "generate", "none"),
    ("ForConditionalGeneration", "generate", "none"),
    ("ChatModel", "generate", "none"),
    ("LMHeadModel", "generate", "none"),
    ("ForTextEncoding", "pooling", "embed"),
    ("EmbeddingModel", "pooling", "embed"),
    ("ForSequenceClassification", "pooling", "classify"),
    ("ForTokenClassification", "pooling", "classify"),
    ("ForAudioClassification", "pooling", "classify"),
    ("ForImageClassification", "pooling", "classify"),
    ("ForVideoClassification", "pooling", "classify"),
    ("ClassificationModel", "pooling", "classify"),
    ("ForRewardModeling", "pooling", "embed"),
    ("RewardModel", "pooling", "embed"),
    ("Model", "pooling", "embed"),
)
# the Sentence Transformers module types vLLM reads as a pooling config
POOLING_MODULES: Final = frozenset(
    {
        "sentence_transformers.models.Pooling",
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    }
)
ROUTES: Final[Mapping[str, Capability]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/responses": "responses",
}


def _choice(args: Sequence[str], flag: str) -> str:
    found = flag_values(args, flag)
    return found[0] if found else "auto"


def _suffix(architectures: Iterable[str], runner: Runner | None = None) -> tuple[Runner, Convert]:
    for arch in architectures:
        for suffix, its_runner, convert in SUFFIXES:
            if (runner is None or runner == its_runner) and arch.endswith(suffix):
                return its_runner, convert
    return ("pooling", "embed") if runner == "pooling" else ("generate", "none")


def resolve(
    args: Sequence[str], architectures: Sequence[str], pooling_config: bool
) -> tuple[Runner, Convert]:
    """vLLM's runner for these arguments and this model (config.json's architectures;
    `pooling_config`: a Sentence Transformers modules.json with a Pooling), and what a pooling
    runner pools for (`embed` or `classify`; `none` for generate): an explicit --convert, else
    what the architecture's suffix says (a model that pools natively, as BertModel, embeds)."""
    said, convert = _choice(args, "--runner"), _choice(args, "--convert")
    runner: Runner
    if said in ("generate", "pooling"):
        runner = "generate" if said == "generate" else "pooling"
    elif convert not in ("auto", "none") or pooling_config:
        runner = "pooling"
    else:
        runner = _suffix(architectures)[0]
    if runner == "generate":
        return runner, "none"
    if convert == "embed":
        return runner, "embed"
    if convert == "classify":
        return runner, "classify"
    return runner, _suffix(architectures, runner)[1]


def serves(
    args: Sequence[str], architectures: Sequence[str], pooling_config: bool
) -> tuple[Capability, ...]:
    """What a server of these arguments and this model serves."""
    runner, pools = resolve(args, architectures, pooling_config)
    if runner == "generate":
        return GENERATION
    return ("embedding",) if pools == "embed" else ()


def from_routes(paths: Iterable[str]) -> tuple[Capability, ...]:
    """What the routes a server registered serve."""
    return capabilities([ROUTES[path] for path in paths if path in ROUTES])


def routes(openapi: Any) -> tuple[str, ...] | None:
    """The paths of an `/openapi.json` answer; None when it names none."""
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    if not isinstance(paths, dict) or not paths:
        return None
    return tuple(sorted(path for path in paths if isinstance(path, str)))


def architectures(config: Any) -> tuple[str, ...]:
    """config.json's `architectures`, the names only."""
    found = config.get("architectures") if isinstance(config, dict) else None
    return tuple(a for a in found if isinstance(a, str)) if isinstance(found, list) else ()


def pooling_config(modules: Any) -> bool:
    """A Sentence Transformers modules.json that has a Pooling module (vLLM's
    get_pooling_config then makes the model a pooling one)."""
    if not isinstance(modules, list):
        return False
    return any(
        isinstance(module, dict) and module.get("type") in POOLING_MODULES for module in modules
    )
