"""The router's load-on-startup set, and a new one applied through the router's API.

Which models the set is, the set a running router container has, and the loads and unloads
that give it a new one instead of a restart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.engines.base import StepContext
from supervisor.engines.llama_router import api as router_api
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.errors import Cancelled, Transient
from supervisor.protocol import files

_LOAD_POLL: Final = 0.25
log = logs.get("llama-router")

Record = tuple[str, tuple[str, ...], tuple[str, ...]]  # container id, the set, reloaded since


@dataclass(frozen=True)
class StartupModels:
    """A running router given a new load-on-startup set through its API, not a restart: the
    models new to the set are loaded, those dropped from it unloaded; the rest serve on."""

    container_id: str
    wanted: tuple[str, ...]
    load: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        doing = [f"loading {', '.join(self.load)}"] if self.load else []
        doing += [f"unloading {', '.join(self.unload)}"] if self.unload else []
        return "applying the load-on-startup set" + (f": {'; '.join(doing)}" if doing else "")


def startup_models(recipe: LlamaRouterRecipe, cached: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in recipe.router.load_on_startup if name in cached)


def _settled(model: router_api.ModelState | None) -> bool:
    """A load has ended: loaded, failed, or the model is no longer offered."""
    return (
        model is None
        or model.value == router_api.LOADED
        or (model.failed and model.value != router_api.LOADING)
    )


class Applied:
    """The load-on-startup set a router container has (<state>/startup.json), and the models
    whose sections it has reloaded since (and so unloaded)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> Record | None:
        try:
            data = json.loads(files.read_text(self.path, limit=1024 * 1024))
            models = tuple(str(name) for name in data["models"])
            reloaded = tuple(str(name) for name in data.get("reloaded", []))
            return str(data["container"]), models, reloaded
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def record(
        self, container_id: str, models: tuple[str, ...], reloaded: tuple[str, ...] = ()
    ) -> None:
        document = {"container": container_id, "models": list(models), "reloaded": reloaded}
        files.write_atomic(self.path, json.dumps(document).encode(), 0o600)


def apply(
    what: StartupModels,
    ctx: StepContext,
    *,
    url: Callable[[], str],
    models: Callable[[], tuple[router_api.ModelState, ...] | None],
    ready_timeout: float,
    applied: Applied,
) -> None:
    """POST /models/unload and /models/load, then wait for the loads to end (loaded or
    failed; a failure is named in the status by the next observation)."""
    for path, names in (("/models/unload", what.unload), ("/models/load", what.load)):
        for name in names:
            ctx.progress(f"{path.rsplit('/', 1)[1]}ing {name} on the running router")
            try:
                code = router_api.post(url(), path, {"model": name})
            except OSError as exc:
                raise Transient(f"the router did not take {path} for {name}: {exc}") from None
            log.info("router asked", path=path, model=name, answer=code)
            if code >= 500:
                raise Transient(f"the router answered {code} to {path} for {name}")
    deadline = time.monotonic() + ready_timeout
    while what.load and time.monotonic() < deadline:
        states = {model.name: model for model in models() or ()}
        if all(_settled(states.get(name)) for name in what.load):
            break
        if ctx.sleep(_LOAD_POLL):
            raise Cancelled("loading the load-on-startup models was cancelled")
    applied.record(what.container_id, what.wanted)
