"""The model library on the page: each download's state and progress, and the CLI's actions.

Reads <models>/<guid>/model.json as `lucia-supervisor models list` does; adds, retries,
cancels and removes through the same functions as `models add` and `models retry|cancel|
remove` (library.control): an add checks the hub and the space at once and queues a model the
lucia-models service picks up; an action is applied at once when no queue runs, else left for
the queue. Names and messages come from the hub and the queue: the page shows them as text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import paths
from supervisor.host.models import control
from supervisor.host.models import manifest as mf
from supervisor.host.models.hub import Hub, HubRefused
from supervisor.host.models.job import read_token
from supervisor.host.models.lease import CatalogLease


class LibraryRefused(Exception):
    """An add or action the library will not take; str() says why, for the operator."""


def row(model: mf.ModelManifest) -> dict[str, Any]:
    """Pure: what the page shows of one download."""
    return {
        "id": model.id,
        "name": model.name,
        "repo": model.source.repo,
        "revision": model.source.revision,
        "commit": model.source.commit,
        "include": model.source.include,
        "state": model.state,
        "since": model.since,
        "message": model.message,
        "bytesDone": model.bytes_done,
        "bytesTotal": model.bytes_total,
        "speed": model.speed,
        "secondsLeft": model.seconds_left,
    }


def _hub() -> Hub:
    return Hub.from_env(read_token(paths.hf_token_file(None)))


class ModelsSection:
    """The models section (sources.SectionSource) and its actions, on the library at root."""

    def __init__(self, root: Path, hub: Callable[[], Hub] = _hub) -> None:
        self.root = root
        self.hub = hub

    def read(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "queueRunning": CatalogLease(self.root).holder() is not None,
            "models": [row(model) for model in mf.load_all(self.root)],
        }

    def add(self, repo: str, revision: str, include: list[str], name: str | None) -> dict[str, Any]:
        """Queue a download as `models add` does; LibraryRefused says why not."""
        try:
            model = control.add(self.root, self.hub(), repo, revision, include=include, name=name)
        except (HubRefused, control.RequestRefused, ValueError) as exc:
            raise LibraryRefused(str(exc)) from None
        return row(model)

    def request(self, guid: str, action: control.Action) -> bool:
        """Retry, cancel or remove as the CLI does: True when applied now, False when left
        for the running queue; LibraryRefused says why not."""
        try:
            mf.model_dir(self.root, guid)  # a GUID, nothing else
            return control.request(self.root, guid, action)
        except (LookupError, control.RequestRefused, FileNotFoundError, ValueError) as exc:
            raise LibraryRefused(str(exc)) from None
