"""One running engine handed from case to case, for a kind whose every start is slow.

A case takes the engine, proves its rule on it, and hands it on only once every assertion
passed and it still serves; the next case takes that one instead of starting its own. A case
that ends the engine (a stop, a death) or fails hands nothing on: the next take removes what
is left of it and starts a fresh engine. Taking an engine that runs is what the adoption rule
and the replacement rules themselves are about, so a case gets the same running engine it
would have started: a worker, a status `running` for its request, its container serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import docker
import pytest

from tests.fixtures import REPO_TEMPLATE, Engine, EngineFactory, RecipeRepo
from tests.standin import recipe_repository


class Relay:
    """The engine one case hands to the next (kept per module and per kind)."""

    def __init__(self, factory: EngineFactory, client: docker.DockerClient) -> None:
        self.factory = factory
        self.client = client
        self._out: Engine | None = None  # the engine taken last
        self._handed = False  # handed on by the case that took it
        self.starts = 0  # fresh engines started

    def take(self, make: Callable[[], Engine], timeout: float) -> tuple[Engine, dict[str, Any]]:
        """The engine handed on, while it still serves; else a fresh one from `make`, up."""
        engine, handed = self._out, self._handed
        self._out, self._handed = None, False
        if engine is not None:
            status = self.serving(engine) if handed else None
            if status is not None:
                self._out = engine
                return engine, status
            self.factory.discard(engine)  # ended by its case, or left as a failed case left it
        engine = make()
        self._out = engine
        self.starts += 1
        _, status = engine.up(timeout=timeout)
        return engine, status

    def hand_on(self, engine: Engine) -> None:
        """The case passed and leaves `engine` running: the next case may take it."""
        assert engine is self._out, "only the engine taken last can be handed on"
        self._handed = True

    def serving(self, engine: Engine) -> dict[str, Any] | None:
        """Its status when its last worker runs, says `running` for the current request on the
        recipe's port with nothing refused, and names the container that runs; else None."""
        if not engine.procs or engine.procs[-1].poll() is not None:
            return None
        try:
            generation = json.loads((engine.dir / "desired.json").read_text())["generation"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        status = engine.status()
        if (
            status is None
            or status["state"] != "running"
            or status["generation"] != generation
            or status.get("refused") is not None
            or status["url"] != f"http://{engine.gateway()}:{engine.port}"
        ):
            return None
        try:
            container = self.client.containers.get(engine.container)
        except docker.errors.NotFound:
            return None
        running = (status.get("engine") or {}).get("containerId")
        return status if container.status == "running" and running == container.id else None


class Relays:
    """One relay per engine kind, over one engine factory whose directory is the module's."""

    def __init__(self, factory: EngineFactory, client: docker.DockerClient) -> None:
        self.factory = factory
        self.client = client
        self._relays: dict[str, Relay] = {}

    def of(self, kind: str) -> Relay:
        return self._relays.setdefault(kind, Relay(self.factory, self.client))


@pytest.fixture(scope="module")
def relays(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Relays]:
    directory = tmp_path_factory.mktemp("relay")
    repo: list[RecipeRepo] = []

    def recipe_repo() -> RecipeRepo:
        if not repo:
            recipe_repository(directory / "recipe-repo", REPO_TEMPLATE, "recipe 0.7.0")
            repo.append(RecipeRepo(directory / "recipe-repo"))
        return repo[0]

    factory = EngineFactory(client, base_image, directory, recipe_repo, request)
    yield Relays(factory, client)
    factory.close()
