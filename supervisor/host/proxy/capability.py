"""Pure: whether a model serves what a route asks of it, from what its engine declares.

Each forwarded route asks for one capability (`/v1/chat/completions` chat, `/v1/completions`
completion, `/v1/embeddings` embedding, `/v1/responses` responses). An engine's worker declares
what each of its models serves in status.json's `capabilities`, in every state: a stopped
engine's is what its recipe and its model's files say (and, for a model a router has run, what
its last run's arguments gave). A model whose declaration leaves the route out is refused with
400 `capability_not_served`, naming what it serves, before any engine is started for it. A
model whose capabilities are not known (a worker older than this gateway, a router model no
sync has read yet) is forwarded as before: an engine is never started to find out, and a
request is never refused on a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from supervisor.host.proxy import body
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import Capability

CODE: Final = "capability_not_served"
ROUTES: Final[Mapping[str, Capability]] = {
    body.CHAT: "chat",
    body.COMPLETIONS: "completion",
    body.EMBEDDINGS: "embedding",
    body.RESPONSES: "responses",
}
# what each capability is asked for by, in the refusal's words
_ROUTE_OF: Final[Mapping[Capability, str]] = {cap: path for path, cap in ROUTES.items()}


def serves(declared: tuple[Capability, ...] | None, path: str) -> bool | None:
    """Whether a model that declares `declared` serves `path`; None when it is not known (no
    declaration, or a route that asks for none of them)."""
    wanted = ROUTES.get(path)
    if declared is None or wanted is None:
        return None
    return wanted in declared


def check(path: str, model: str, engine: str, declared: tuple[Capability, ...] | None) -> None:
    """Refuse (400 capability_not_served) a request for `path` to a model whose declaration
    leaves it out; nothing when it serves it or is not known."""
    if serves(declared, path) is not False:
        return
    assert declared is not None
    wanted = ROUTES[path]
    shown = ", ".join(f"{cap} ({_ROUTE_OF[cap]})" for cap in declared)
    offers = shown or "none of chat, completion, embedding and responses"
    raise Refusal(
        400,
        CODE,
        f"the model `{model}` (engine {engine}) does not serve {wanted}, which {path} asks "
        f"for; it serves {offers}",
        param="model",
        details={"capabilities": list(declared)},
    )
