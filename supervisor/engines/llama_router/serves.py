"""What a router's model serves, as capabilities, pure.

From the arguments its child runs with and the pooling type its GGUF's header declares.

llama-server (b11669, Debian's llama.cpp 0.7.0, tests/integration/test_llama_server_facts.py):
`--embeddings` "restricts to only support embedding use case; use only with dedicated embedding
models". With it, a model whose pooling (its `--pooling`, else its GGUF's `<arch>.pooling_type`)
is mean, cls or last answers /v1/embeddings; one with none (a chat model) answers them 400 "not
OAI compatible" and its child dies on a chat. Without it, /v1/embeddings is 501 and the model
generates: /v1/chat/completions, /v1/completions and /v1/responses. A GGUF that declares a
pooling type is an embedding model: it does not chat, whatever it would answer if asked, so the
worker gives its preset section `embeddings = true` (one with `rank` pools for reranking, and
serves none of the four). `/props` states neither the flag nor the pooling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from supervisor.library.ggufmeta import Metadata
from supervisor.protocol.documents import GENERATION, Capability

# llama.cpp's enum llama_pooling_type, as GGUF headers store it
POOLING: Final[Mapping[int, str]] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
EMBEDS: Final = frozenset({"mean", "cls", "last"})  # what /v1/embeddings takes
_EMBEDDINGS: Final = ("--embedding", "--embeddings")
_EMBEDDINGS_ENV: Final = "LLAMA_ARG_EMBEDDINGS"
_POOLING_ENV: Final = "LLAMA_ARG_POOLING"
_TRUE: Final = ("1", "true", "on", "yes", "enabled")


def pooling(meta: Metadata) -> str:
    """The pooling type a GGUF's header declares (`none` when it declares none)."""
    found = meta.arch_key("pooling_type")
    if isinstance(found, bool) or not isinstance(found, int):
        return "none"
    return POOLING.get(found, "none")


def pooled(declared: str) -> bool:
    """Whether a GGUF that declares this pooling is an embedding model (or a reranker)."""
    return declared != "none"


def _said(args: Sequence[str], flag: str) -> str | None:
    found: str | None = None
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name == flag:
            found = value if equals else (args[at + 1] if at + 1 < len(args) else "")
    return found


def serves(
    args: Sequence[str], environment: Mapping[str, str], declared: str
) -> tuple[Capability, ...]:
    """What a model serves whose child runs with `args` (and the router's environment), its
    GGUF declaring the pooling `declared`."""
    embeddings = any(arg in _EMBEDDINGS for arg in args) or (
        environment.get(_EMBEDDINGS_ENV, "").strip().lower() in _TRUE
    )
    pools = _said(args, "--pooling") or environment.get(_POOLING_ENV) or declared
    if embeddings:
        return ("embedding",) if pools in EMBEDS else ()
    return () if pooled(declared) else GENERATION


def preset_args(defaults: Mapping[str, object], embeddings: bool) -> tuple[str, ...]:
    """The arguments of a model's child that decide what it serves, as its preset gives them:
    the defaults' `embeddings` and `pooling`, and its section's `embeddings = true`."""
    args: list[str] = []
    if defaults.get("embeddings") is True or defaults.get("embedding") is True or embeddings:
        args.append("--embeddings")
    said = defaults.get("pooling")
    if isinstance(said, str):
        args += ["--pooling", said]
    return tuple(args)
