"""The Spark TensorFold recipe: pinned checkout, recipe image, downloads, grammar image, server."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

from .. import files
from ..errors import BuildFailed
from ..plan import Observed
from ..process import run
from ..protocol import TargetGroup
from ..recipe import TensorFoldRecipe
from ..runtime import BuildRequest, RunSpec, Runtime
from ..source import Checkout
from . import grammar
from .base import Endpoint, StepContext
from .container import ContainerEngine

COMMIT_LABEL: Final = "lucia.recipe.commit"
CHECKOUT: Final = "checkout"
RECIPE_IMAGE: Final = "recipe-image"
GRAMMAR_IMAGE: Final = "grammar-image"
PREPARE: Final = "prepare"
_PROBE_TIMEOUT: Final = 2.0


def missing(
    *, checkout_ok: bool, recipe_ok: bool, prepared: bool, grammar_ok: bool
) -> tuple[str, ...]:
    """Pure: which prerequisites to make, in order. The checkout is only needed to build the
    recipe image or to run the prepare commands, so a worker restart never touches git."""
    steps: list[str] = []
    if (not recipe_ok or not prepared) and not checkout_ok:
        steps.append(CHECKOUT)
    if not recipe_ok:
        steps.append(RECIPE_IMAGE)
    if not grammar_ok:
        steps.append(GRAMMAR_IMAGE)
    if not prepared:
        steps.append(PREPARE)
    return tuple(steps)


class TensorFold(ContainerEngine):
    kind = "tensorfold"

    def __init__(
        self, name: str, recipe: TensorFoldRecipe, runtime: Runtime, state_dir: Path
    ) -> None:
        super().__init__(name, recipe, runtime, state_dir)
        self.recipe = recipe
        self.poll_interval = 30.0
        self.checkout = Checkout(
            state_dir / "checkout", recipe.source.repository, recipe.source.commit
        )
        self._stamp = state_dir / "prepared.json"

    # -- observe -------------------------------------------------------------------------------

    def observe(self) -> Observed:
        recipe = self.recipe
        base = self.runtime.image(recipe.image.tag)
        recipe_ok = base is not None and base.labels.get(COMMIT_LABEL) == recipe.source.commit
        image = self.runtime.image(recipe.grammar_tag) if base is not None and recipe_ok else None
        grammar_ok = (
            base is not None
            and image is not None
            and grammar.current(recipe.grammar, base.id, image.labels)
        )
        prepared = self._prepared()
        checkout_ok = (recipe_ok and prepared) or self.checkout.verify() is None
        return Observed(
            container=self.runtime.container(self.container_name),
            missing=missing(
                checkout_ok=checkout_ok,
                recipe_ok=recipe_ok,
                prepared=prepared,
                grammar_ok=grammar_ok,
            ),
            image_id=image.id if image is not None and grammar_ok else None,
        )

    def _prepare_key(self) -> str:
        recipe = self.recipe
        blob = json.dumps(
            [recipe.source.commit, recipe.prepare.commands, recipe.environment], sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def _prepared(self) -> bool:
        if not self.recipe.prepare.commands:
            return True
        try:
            stamp = json.loads(files.read_text(self._stamp))
        except (OSError, ValueError):
            return False
        return isinstance(stamp, dict) and stamp.get("key") == self._prepare_key()

    # -- make ----------------------------------------------------------------------------------

    def make(self, what: str, ctx: StepContext) -> None:
        if what == CHECKOUT:
            self.checkout.ensure(ctx)
        elif what == RECIPE_IMAGE:
            self._build_recipe_image(ctx)
        elif what == GRAMMAR_IMAGE:
            self._build_grammar_image(ctx)
        elif what == PREPARE:
            self._run_prepare(ctx)
        else:
            raise ValueError(f"unknown prerequisite {what!r}")

    def _build_recipe_image(self, ctx: StepContext) -> None:
        spec = self.recipe.image
        ctx.progress(f"building {spec.tag} from {self.recipe.source.commit[:12]}")
        self.runtime.build(
            BuildRequest(
                tag=spec.tag,
                labels={
                    COMMIT_LABEL: self.recipe.source.commit,
                    "lucia.recipe.repository": self.recipe.source.repository,
                },
                context=str(self.checkout.path / spec.context),
                dockerfile=spec.dockerfile,
                build_args=spec.build_args,
            ),
            ctx.progress,
            ctx.cancel,
        )

    def _build_grammar_image(self, ctx: StepContext) -> None:
        base = self.runtime.image(self.recipe.image.tag)
        if base is None:
            raise BuildFailed(
                f"build of {self.recipe.grammar_tag}",
                [f"its base {self.recipe.image.tag} is missing"],
            )
        ctx.progress(grammar.MESSAGE)
        self.runtime.build(
            BuildRequest(
                tag=self.recipe.grammar_tag,
                labels=grammar.labels(self.recipe.grammar, base.id),
                dockerfile_text=grammar.dockerfile(self.recipe.grammar, base.id),
            ),
            lambda line: ctx.progress(f"{grammar.MESSAGE}: {line}"),
            ctx.cancel,
        )

    def _run_prepare(self, ctx: StepContext) -> None:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "LANG": "C.UTF-8",
            **self.recipe.environment,
            **self.secrets(),
        }
        for command in self.recipe.prepare.commands:
            ctx.progress(f"running {' '.join(command)}")
            outcome = run(
                command, cwd=self.checkout.path, env=env, progress=ctx.progress, cancel=ctx.cancel
            )
            if outcome.code != 0:
                raise BuildFailed(
                    f"prepare command {command[0]} (exit {outcome.code})", outcome.tail
                )
        files.write_atomic(self._stamp, json.dumps({"key": self._prepare_key()}).encode(), 0o600)

    # -- run -----------------------------------------------------------------------------------

    def run_spec(self, image_id: str, generation: int, endpoint: Endpoint) -> RunSpec:
        return self.container_spec(
            image_id,
            generation,
            endpoint,
            command=tuple(self.recipe.command),
            labels={COMMIT_LABEL: self.recipe.source.commit},
        )

    def ready(self, endpoint: Endpoint) -> bool:
        url = endpoint.url + self.recipe.run.ready_path
        try:
            with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT) as response:  # noqa: S310
                return int(response.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def notes(self) -> str:
        return ""

    def private_files(self) -> tuple[Path, ...]:
        return (self._stamp,)

    def targets(self, endpoint: Endpoint) -> TargetGroup:
        return self.target_group(
            endpoint, {"model": self.recipe.model, "recipe_commit": self.recipe.source.commit}
        )
