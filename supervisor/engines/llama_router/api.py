"""llama-server's router API as the worker reads it: `GET /models` (what is offered, loaded,
failed), `POST /models/load|unload`, the build `GET /props` states, and what follows from a
listing: one Prometheus target group per loaded model, the status note, and the loads and
unloads a new load-on-startup set needs. Everything but `get` and `post` is pure.

A router answers `GET /metrics` only for a model named in the query, and a scrape of
`?model=NAME` loads NAME unless `autoload=false` is given too; so every target names its model
and forbids the load, and only loaded models get a target.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

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
        found.append(
            ModelState(
                name=entry["id"],
                value=str(status.get("value", "")),
                failed=status.get("failed") is True or status.get("value") == "failed",
                exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
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
