"""llama-server's router API as the worker reads it: `GET /models` (what is offered, loaded,
failed, and each child's command line), `POST /models/load|unload`, the build `GET /props`
states, a loaded model's slots (`GET /props?model=NAME`), and what follows from a listing: one
Prometheus target group per loaded model, the status note, and the loads and unloads a new
load-on-startup set needs. Everything but `get` and `post` is pure.

A router answers `GET /metrics` only for a model named in the query, and a scrape of
`?model=NAME` loads NAME unless `autoload=false` is given too; so every target names its model
and forbids the load, and only loaded models get a target.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from supervisor.memplan.kv import CELL_PAD
from supervisor.protocol.documents import TargetGroup

TIMEOUT: Final = 2.0  # /models answers at once, even while a child loads
LOADED: Final = "loaded"
LOADING: Final = "loading"
_BUILD: Final = re.compile(r"[0-9A-Za-z.+_-]{1,64}")  # b11669-Debian


@dataclass(frozen=True)
class ModelState:
    """One offered model, as /models reports it."""

    name: str
    value: str  # unloaded, loading, loaded (and whatever a newer router adds)
    failed: bool = False  # its last load failed
    exit_code: int | None = None
    args: tuple[str, ...] = ()  # the command line the router runs its child with

    @property
    def active(self) -> bool:
        """Loaded, or on its way: a load request for it would be redundant."""
        return self.value in (LOADED, LOADING)


def parse(listing: Any) -> tuple[ModelState, ...]:
    """The models of a `GET /models` answer, in its order; anything unreadable is left out."""
    data = listing.get("data") if isinstance(listing, dict) else None
    found = []
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        status = entry.get("status")
        status = status if isinstance(status, dict) else {}
        code = status.get("exit_code")
        given = status.get("args")
        args = given if isinstance(given, list) and all(isinstance(a, str) for a in given) else ()
        found.append(
            ModelState(
                name=entry["id"],
                value=str(status.get("value", "")),
                failed=status.get("failed") is True or status.get("value") == "failed",
                exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
                args=tuple(args),
            )
        )
    return tuple(found)


def target_groups(
    models: Iterable[ModelState], address: str, labels: Mapping[str, str]
) -> tuple[TargetGroup, ...]:
    """One group per loaded model: the router's address, scraped with ?model=NAME&autoload=false.
    `labels` carries __metrics_path__, engine and name."""
    return tuple(
        TargetGroup(
            targets=[address],
            labels={
                **labels,
                "__param_model": model.name,
                "__param_autoload": "false",
                "model": model.name,
            },
        )
        for model in models
        if model.value == LOADED
    )


def build(props: Any) -> str | None:
    """The build a `GET /props` answer states (`build_info`, as `b11669-Debian`), when it looks
    like one: status.json carries a build, never whatever else the answer holds."""
    found = props.get("build_info") if isinstance(props, dict) else None
    return found if isinstance(found, str) and _BUILD.fullmatch(found) else None


# the child's flags and the variables that stand for them (llama-server --help); a flag wins
_CTX_SIZE: Final = (("--ctx-size", "-c"), "LLAMA_ARG_CTX_SIZE")
_PARALLEL: Final = (("--parallel", "-np"), "LLAMA_ARG_N_PARALLEL")
_PER_SLOT: Final = (("--kv-unified-per-slot",), "LLAMA_ARG_KV_UNIFIED_PER_SLOT")
_UNIFIED: Final = ("--kv-unified", "-kvu")
_NOT_UNIFIED: Final = ("--no-kv-unified", "-no-kvu")
_UNIFIED_ENV: Final = "LLAMA_ARG_KV_UNIFIED"
_TRUE: Final = ("1", "true", "on", "yes", "enabled")


def props_path(model: str) -> str:
    """A loaded model's /props, never loading one that is not (`autoload=false`: 400)."""
    return "/props?" + urllib.parse.urlencode({"model": model, "autoload": "false"})


def _setting(
    args: Sequence[str], environment: Mapping[str, str], flags: tuple[tuple[str, ...], str]
) -> int | None:
    """A number the child's last flag gives, else its variable; None when neither does."""
    names, variable = flags
    found: str | None = environment.get(variable)
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in names:
            found = value if equals else (args[at + 1] if at + 1 < len(args) else "")
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None


def _unified(args: Sequence[str], environment: Mapping[str, str]) -> bool:
    """Whether the child's slots share one KV cache: its last --kv-unified / --no-kv-unified,
    else LLAMA_ARG_KV_UNIFIED, else llama-server's default: shared when the number of slots
    is auto (no --parallel, or one below 1)."""
    said: bool | None = None
    if _UNIFIED_ENV in environment:
        said = environment[_UNIFIED_ENV].strip().lower() in _TRUE
    for arg in args:
        if arg in _UNIFIED:
            said = True
        elif arg in _NOT_UNIFIED:
            said = False
    if said is not None:
        return said
    parallel = _setting(args, environment, _PARALLEL)
    return parallel is None or parallel < 1


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def slots(props: Any, args: Sequence[str], environment: Mapping[str, str]) -> int | None:
    """How many requests a loaded model's child holds at once, each with room for its slot's
    whole context (`n_ctx` of its /props, which llama-server caps at the model's own context):
    its `total_slots` when each slot has a cache of its own (an explicit --parallel); when its
    slots share one cache (llama-server's auto: 4 slots, or --kv-unified), as many as that
    cache holds slot contexts of, at least one. The cache is --ctx-size padded to 256 cells as
    llama-server pads it (memplan.kv); without a ctx-size, --kv-unified-per-slot per slot, else
    the model's own context, one slot's. None when /props names no slots or context (a model
    that is not loaded answers 400, not these)."""
    if not isinstance(props, dict):
        return None
    total = props.get("total_slots")
    settings = props.get("default_generation_settings")
    context = settings.get("n_ctx") if isinstance(settings, dict) else None
    if not (_count(total) and _count(context)):
        return None
    assert isinstance(total, int) and isinstance(context, int)
    if not _unified(args, environment):
        return total
    ctx = _setting(args, environment, _CTX_SIZE) or 0
    per_slot = _setting(args, environment, _PER_SLOT) or 0
    if ctx > 0:
        cells = -(-ctx // CELL_PAD) * CELL_PAD
    elif per_slot > 0:
        cells = total * per_slot
    else:
        cells = context
    return max(1, min(total, cells // context))


def failed(models: Iterable[ModelState]) -> tuple[ModelState, ...]:
    """Models whose last load failed and that are not loaded now."""
    return tuple(model for model in models if model.failed and model.value != LOADED)


def note(models: tuple[ModelState, ...]) -> str:
    """What status.json says the router serves: loaded, offered, failed with exit codes."""
    loaded = [model.name for model in models if model.value == LOADED]
    loading = [model.name for model in models if model.value == LOADING]
    parts = [
        f"loaded: {', '.join(loaded) or 'none'}",
        *([f"loading: {', '.join(loading)}"] if loading else []),
        f"offered: {', '.join(model.name for model in models) or 'none'}",
    ]
    broken = failed(models)
    if broken:
        codes = ", ".join(
            f"{m.name} (exit code {m.exit_code if m.exit_code is not None else 'unknown'})"
            for m in broken
        )
        parts.append(f"failed to load: {codes}")
    return "; ".join(parts)


def changes(
    models: tuple[ModelState, ...],
    wanted: Iterable[str],
    applied: Iterable[str],
    reloaded: Iterable[str] = (),
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(load, unload) that bring a running router from the load-on-startup set it was given
    (`applied`) to the preset's (`wanted`): only the difference, so a startup model the router
    evicted (models-max) is not loaded back, and a model loaded on demand is left alone. A
    model whose section the router `reloaded` (it unloads those, and loads none) is due again."""
    by_name = {model.name: model for model in models}
    wanted, applied = tuple(dict.fromkeys(wanted)), tuple(dict.fromkeys(applied))
    due = set(reloaded)
    load = tuple(
        name
        for name in wanted
        if (name in due or name not in applied) and name in by_name and not by_name[name].active
    )
    unload = tuple(
        name for name in applied if name not in wanted and name in by_name and by_name[name].active
    )
    return load, unload


def get(base_url: str, path: str, timeout: float = TIMEOUT) -> Any:
    """GET a JSON answer; raises OSError (URLError included) or ValueError."""
    with urllib.request.urlopen(base_url + path, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read().decode())


def post(base_url: str, path: str, document: Mapping[str, Any], timeout: float = TIMEOUT) -> int:
    """POST a JSON document; the HTTP status (an error status is returned, not raised)."""
    request = urllib.request.Request(  # noqa: S310
        base_url + path,
        data=json.dumps(document).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
