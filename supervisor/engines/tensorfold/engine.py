"""The Spark TensorFold recipe: pinned checkout, recipe image, downloads, grammar image, server."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.docker import labels
from supervisor.docker.process import run
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import BuildRequest, RunSpec
from supervisor.engines.base import Prerequisite, StepContext
from supervisor.engines.container import ContainerEngine
from supervisor.engines.look import EngineImage, Look, Prerequisites
from supervisor.engines.tensorfold import grammar
from supervisor.engines.tensorfold import memory as tensorfold_memory
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe, parallel, served_names
from supervisor.engines.tensorfold.source import GitCheckout
from supervisor.errors import BuildFailed, Permanent
from supervisor.memplan.need import EngineNeed
from supervisor.protocol import files
from supervisor.protocol.documents import Capability, TargetGroup

_PROBE_TIMEOUT: Final = 2.0
_CACHE_SETTINGS: Final = ("HF_CACHE", "KERNEL_CACHE")  # directories prepare and run both use
_CHECK_TIMEOUT: Final = 120.0
# A cancelled prepare gets this long after SIGTERM: `docker run` passes the signal on to its
# container and waits for it, and a download in a container may not stop for it at once.
_PREPARE_GRACE: Final = 0.5
_TOKENS: Final = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@dataclass(frozen=True)
class Checkout:
    commit: str

    @property
    def description(self) -> str:
        return f"checking out {self.commit[:12]}"


@dataclass(frozen=True)
class RecipeImage:
    tag: str

    @property
    def description(self) -> str:
        return f"building {self.tag}"


@dataclass(frozen=True)
class GrammarImage:
    tag: str

    @property
    def description(self) -> str:
        return grammar.MESSAGE


@dataclass(frozen=True)
class PreparedCheckout:
    @property
    def description(self) -> str:
        return "running the recipe's prepare commands"


def missing(
    recipe: TensorFoldRecipe,
    *,
    checkout_ok: bool,
    recipe_ok: bool,
    prepared: bool,
    grammar_ok: bool,
) -> tuple[Prerequisite, ...]:
    """Pure: which prerequisites to make, in order. The checkout is only needed to build the
    recipe image or to run the prepare commands, so a worker restart never touches git.

    With `image.from = "prepare"` the prepare commands make the recipe image: recipe_ok then
    says only that it exists, and a missing one runs them again, before the grammar image."""
    steps: list[Prerequisite] = []
    if recipe.image_from_prepare:
        again = not prepared or not recipe_ok
        if again and not checkout_ok:
            steps.append(Checkout(recipe.source.commit))
        if again:
            steps.append(PreparedCheckout())
        if not grammar_ok:
            steps.append(GrammarImage(recipe.grammar_tag))
        return tuple(steps)
    if (not recipe_ok or not prepared) and not checkout_ok:
        steps.append(Checkout(recipe.source.commit))
    if not recipe_ok:
        steps.append(RecipeImage(recipe.image.tag))
    if not grammar_ok:
        steps.append(GrammarImage(recipe.grammar_tag))
    if not prepared:
        steps.append(PreparedCheckout())
    return tuple(steps)


class TensorFold(ContainerEngine[TensorFoldRecipe, Prerequisites]):
    kind = "tensorfold"

    def __init__(
        self,
        name: str,
        recipe: TensorFoldRecipe,
        runtime: Runtime,
        state_dir: Path,
        data_dir: Path | None = None,
    ) -> None:
        super().__init__(name, recipe, runtime, state_dir, data_dir)
        self.checkout = GitCheckout(
            state_dir / "checkout", recipe.source.repository, recipe.source.commit
        )
        self._stamp = state_dir / "prepared.json"

    # -- observe -------------------------------------------------------------------------------

    def prerequisites(self) -> Prerequisites:
        recipe = self.recipe
        base = self.runtime.image(recipe.image.tag)
        recipe_ok = base is not None and (
            recipe.image_from_prepare
            or base.labels.get(labels.RECIPE_COMMIT) == recipe.source.commit
        )
        image = self.runtime.image(recipe.grammar_tag) if base is not None and recipe_ok else None
        grammar_ok = (
            base is not None
            and image is not None
            and grammar.current(recipe.grammar, base.id, image.labels)
        )
        prepared = self._prepared()
        checkout_ok = (recipe_ok and prepared) or self.checkout.verify() is None
        return Prerequisites(
            missing(
                recipe,
                checkout_ok=checkout_ok,
                recipe_ok=recipe_ok,
                prepared=prepared,
                grammar_ok=grammar_ok,
            ),
            EngineImage(recipe.grammar_tag, image) if image is not None and grammar_ok else None,
        )

    def _prepare_key(self) -> str:
        recipe = self.recipe
        facts: list[object] = [recipe.source.commit, recipe.prepare.commands, recipe.environment]
        if recipe.image_from_prepare:
            facts.append(recipe.image.tag)
        blob = json.dumps(facts, sort_keys=True)
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

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        match what:
            case Checkout():
                self.checkout.ensure(ctx)
            case RecipeImage():
                self._build_recipe_image(ctx)
            case GrammarImage():
                self._build_grammar_image(ctx)
            case PreparedCheckout():
                self._run_prepare(ctx)
            case _:
                super().make_own(what, ctx)

    def _build_recipe_image(self, ctx: StepContext) -> None:
        spec = self.recipe.image
        ctx.progress(f"building {spec.tag} from {self.recipe.source.commit[:12]}")
        self.runtime.build(
            BuildRequest(
                tag=spec.tag,
                labels={
                    labels.RECIPE_COMMIT: self.recipe.source.commit,
                    labels.RECIPE_REPOSITORY: self.recipe.source.repository,
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

    def prepare_environment(self) -> dict[str, str]:
        """What the prepare commands see: PATH, HOME, the settings (the cache directories
        expanded, as the container's mounts are) and the recipe's secrets. Nothing else of the
        worker's environment, so a token in it never reaches a download by accident; without a
        token of the recipe's own, huggingface_hub must not pick up a cached one either."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "LANG": "C.UTF-8",
        }
        if "DOCKER_HOST" in os.environ:
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        settings = self.recipe.environment
        for key in _CACHE_SETTINGS:
            if key in settings:
                settings[key] = str(Path(settings[key]).expanduser())
        secrets = self.secrets()
        env.update(settings)
        for key in _TOKENS:
            env.pop(key, None)
        env.update(secrets)
        if not any(key in secrets for key in _TOKENS):
            env["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"  # noqa: S105 (a switch, not a token)
        return env

    def _run_prepare(self, ctx: StepContext) -> None:
        env = self.prepare_environment()
        for command in self.recipe.prepare.commands:
            ctx.progress(f"running {' '.join(command)}")
            outcome = run(
                command,
                cwd=self.checkout.path,
                env=env,
                progress=ctx.progress,
                cancel=ctx.cancel,
                grace=_PREPARE_GRACE,
            )
            if outcome.code != 0:
                raise BuildFailed(
                    f"prepare command {command[0]} (exit {outcome.code})", outcome.tail
                )
        files.write_atomic(self._stamp, json.dumps({"key": self._prepare_key()}).encode(), 0o600)

    # -- run -----------------------------------------------------------------------------------

    def check_more(self, spec: RunSpec, ctx: StepContext) -> None:
        """The recipe's check command (TensorFold's own argument parser, as start.sh runs it
        before it stops a server), in a throwaway container on the image the start would use."""
        command = self.recipe.check_command
        if not command:
            return
        ctx.progress("checking the engine's arguments with its own parser")
        code, tail = self.runtime.run_once(
            spec.image, command[0], command[1:], _CHECK_TIMEOUT, {labels.NAME: self.name}
        )
        if code != 0:
            errors = [line for line in tail if "error:" in line] or tail or ["no output"]
            raise Permanent(
                f"the engine's own check refused the recipe's arguments (exit {code}): "
                f"{errors[-1]}; the running engine, if any, was left alone"
            )

    def extra_labels(self) -> dict[str, str]:
        return {labels.RECIPE_COMMIT: self.recipe.source.commit}

    def ready(self) -> bool:
        if self.endpoint is None:
            return False
        url = self.endpoint.url + self.recipe.run.ready_path
        try:
            with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT) as response:  # noqa: S310
                return int(response.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def named(self) -> tuple[str, ...]:
        return served_names(self.recipe)

    def serves(self, look: Look[Prerequisites]) -> dict[str, tuple[Capability, ...]]:
        """A chat model: TensorFold serves chat and text completions of it (a recipe whose
        engine serves more, or less, says so in its `capabilities`)."""
        return {name: ("chat", "completion") for name in self.served(look)}

    def parallel(self) -> int | None:
        return parallel(self.recipe)

    def private_files(self) -> tuple[Path, ...]:
        return (self._stamp,)

    def memory_need(self) -> EngineNeed | None:
        found = tensorfold_memory.recipe_figures(self.recipe)
        return tensorfold_memory.tensorfold_need(self.recipe, found) if found is not None else None

    def targets(self, look: Look[Prerequisites]) -> tuple[TargetGroup, ...]:
        if look.endpoint is None:
            return ()
        group = {"model": self.recipe.model, "recipe_commit": self.recipe.source.commit}
        return (self.target_group(look.endpoint, group),)
