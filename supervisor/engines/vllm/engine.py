"""vLLM on a GPU server: a GPU preflight before anything is pulled, the image it picks, the
model's download, the KV-cache tier directories, and one `vllm serve` container; on a CPU
server (`device = "cpu"`) the recipe's CPU image with no GPU read at all (engines/vllm/cpu.py).
What differs between the two is the recipe's `Device`, chosen once when the engine is made.

The order of the prerequisites is the guarantee: `Preflight` (nvidia-smi read, the guide's
refusals) comes before the image pull, so a refused recipe pulls and starts nothing. A pass is
kept in the state directory (`preflight.json`, keyed by the recipe's choices), so a worker
restart adopts the running engine without a new step. The Check step before every start or
replacement reads the GPU again and decides again, with what the replaced engine holds counted
as free: a refusal there leaves the running engine serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Image, Mount, RunSpec
from supervisor.engines.base import Endpoint, Prerequisite, StepContext
from supervisor.engines.container import ContainerEngine
from supervisor.engines.look import EngineImage, Look, PulledImage
from supervisor.engines.vllm import account, namespaces, probes, secretfiles, tasks, tier_image
from supervisor.engines.vllm import memory as vllm_memory
from supervisor.engines.vllm import model as hf_model
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm import tiers as kv_tiers
from supervisor.engines.vllm.device import Device, choose, probe_gpu
from supervisor.engines.vllm.model import ModelDownload
from supervisor.engines.vllm.recipe import VllmRecipe, max_num_seqs, served_names
from supervisor.engines.vllm.steps import (
    MemoryFit,
    Preflight,
    TierDirectories,
    TierImage,
    VllmLook,
    refused,
)
from supervisor.engines.vllm.weights import ModelFiles
from supervisor.errors import Blocked, Permanent
from supervisor.hw import gpu
from supervisor.memplan import guard
from supervisor.memplan.need import EngineNeed
from supervisor.protocol import files
from supervisor.protocol.documents import Capability, TargetGroup

MEMORY_LABEL: Final = "lucia.vllm.memory"  # the memory share it was started with (percent)
NAMESPACE_LABEL: Final = namespaces.LABEL  # the KV-cache namespace it mounts
log = logs.get("vllm")


class Vllm(ContainerEngine[VllmRecipe, VllmLook]):
    kind = "vllm"

    def __init__(
        self,
        name: str,
        recipe: VllmRecipe,
        runtime: Runtime,
        state_dir: Path,
        data_dir: Path | None = None,
    ) -> None:
        self.device: Device = choose(recipe)  # the memory plan measures through it
        super().__init__(name, recipe, runtime, state_dir, data_dir, measure=self.device.measure)
        self.choices = self.device.choices
        self._stamp = state_dir / "preflight.json"
        self._model_stamp = state_dir / "model.json"
        self._secrets_root = state_dir / "secrets"
        self._fitted: int | None = None  # the CPU need last found to fit, before a pull
        self._versions = probes.Versions()
        self._routes = probes.Routes()
        self._off = probes.TierWatch()  # the KV tiers the running engine switched off
        self._plugin = tier_image.Current()  # read once, and again by each build
        self._starting = namespaces.Starting()  # namespaces held from a Check to its start

    # -- the GPU -------------------------------------------------------------------------------

    def probe(self) -> gpu.GpuFacts | gpu.GpuUnavailable:
        return probe_gpu(self.recipe.vllm.nvidia_smi)

    def _choices_key(self) -> str:
        blob = json.dumps([repr(self.choices), self.recipe.vllm.nvidia_smi], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _launch(self) -> pf.Launch | None:
        """What runs: on a CPU the recipe's image; on a GPU the last preflight's pass."""
        return self.device.launch(self._passed)

    def _passed(self) -> pf.Launch | None:
        """The launch of the last preflight that passed for these choices, if any."""
        try:
            data = json.loads(files.read_text(self._stamp))
            if data["key"] == self._choices_key():
                return pf.Launch(str(data["image"]), tuple(str(a) for a in data["args"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _preflight(self, ctx: StepContext) -> None:
        facts = self.probe()
        launch = refused(pf.decide(self.choices, facts))
        shown = facts.gpus[0].name if isinstance(facts, gpu.GpuFacts) else ""
        ctx.progress(
            f"GPU preflight passed ({shown}, CUDA {getattr(facts, 'cuda', '')}): {launch.image}"
        )
        record = {"key": self._choices_key(), "image": launch.image, "args": list(launch.args)}
        files.write_atomic(self._stamp, json.dumps(record).encode(), 0o600)
        log.info("vLLM preflight passed", image=launch.image)

    # -- observe -------------------------------------------------------------------------------

    def prerequisites(self) -> VllmLook:
        self.key_id()  # a key the plugin would refuse stops here, before any pull or build
        launch = self._launch()
        if launch is None:  # nothing is pulled before the GPU says which image, or refuses
            return VllmLook((Preflight(),))
        image = self.runtime.image(launch.image)
        if image is None:
            need = self.device.fit_before_pull(self.guard is not None)
            if need is not None and need != self._fitted:  # a pull only for a start that fits
                return VllmLook((MemoryFit(need),))
            return VllmLook((PulledImage(launch.image),))
        found, tier_labels = EngineImage(launch.image, image), dict[str, str]()
        if self.recipe.tiers.any:  # the base plus the plugin, rebuilt for another base or version
            ref = tier_image.tag(launch.image)
            built, plugin = self.runtime.image(ref), self._plugin.get()
            if (
                built is None
                or plugin is None
                or not tier_image.current(plugin, image.id, built.labels)
            ):
                return VllmLook((TierImage(ref),))
            found, tier_labels = EngineImage(ref, built), dict(built.labels)
        hf = self.recipe.vllm.model.hf
        if hf is not None and not self.files.downloaded():
            return VllmLook((ModelDownload(hf.id, hf.revision),), tier_labels=tier_labels)
        space = self.namespace(image)
        if not all((tier.root / space).is_dir() for tier in self.recipe.tier_plan().disks):
            return VllmLook((TierDirectories(space),), namespace=space, tier_labels=tier_labels)
        return VllmLook((), found, namespace=space, tier_labels=tier_labels)

    def namespace(self, image: Image) -> str:
        return kv_tiers.namespace(self.identity(image))

    def identity(self, image: Image) -> kv_tiers.CacheIdentity:
        """Everything that makes an old block wrong, for the namespace (a tier image counts as
        its base; the plugin's version only when there are tiers)."""
        recipe, tiers = self.recipe, self.recipe.tiers
        plugin = self._plugin.get() if tiers.any else None
        return kv_tiers.CacheIdentity(
            model_manifest=self.model_manifest(),
            image_digest=image.labels.get(labels.TIERS_BASE, image.id),
            plugin_version=plugin.version if plugin is not None else "",
            key_id=self.key_id(),
            layout=kv_tiers.KvLayout(
                tiers.kv_dtype, recipe.block_size, **hf_model.read_layout(self.files.directory())
            ),
            parallel=recipe.parallel(),
            engine_args=(f"quantization={recipe.vllm.quantization}", *recipe.vllm.args),
        )

    # -- the model -----------------------------------------------------------------------------

    def _file_secrets(self) -> dict[str, str]:
        return hf_model.file_secrets(self.recipe.secrets, self.recipe.tiers.key_secret)

    def _download(self, what: ModelDownload, ctx: StepContext) -> None:
        launch = self._launch()  # on a CPU the recipe's image: no preflight has passed
        image = self.runtime.image(launch.image) if launch else None
        if image is None:
            raise Blocked("the engine image is missing; it is pulled again")
        snapshot = self.files.snapshot()
        where = hf_model.Where(image.id, self.recipe.run.network, self.volumes(), snapshot)
        hf_model.download(
            self.runtime,
            what,
            where,
            settings=self.recipe.environment,
            secrets=self.secrets(),
            secrets_root=self._secrets_root,
            labels={labels.NAME: self.name},
            ctx=ctx,
        )
        self.files.record_download()
        log.info("model downloaded", model=what.repo_id, revision=what.revision)

    # -- old namespaces ------------------------------------------------------------------------

    def _prune(self, space: str, ctx: StepContext | None = None) -> None:
        """Old namespaces go once the cap needs their room; never one a container names, a
        worker is starting or a store holds (namespaces.py)."""
        namespaces.prune_tiers(self.runtime, self.recipe.tier_plan().disks, space, ctx)

    @property
    def files(self) -> ModelFiles:
        """The recipe's model on the host, as the recipe and its volumes say now."""
        return ModelFiles(self.recipe, self.volumes(), self._model_stamp)

    def model_manifest(self) -> str:
        return self.files.manifest()

    def key_id(self) -> str:
        """The cache key's id; with tiers, a key the plugin would refuse stops the engine."""
        key = self.secrets().get(name := self.recipe.tiers.key_secret, "")
        if self.recipe.tiers.any and (why := kv_tiers.key_refused(key)):
            raise Permanent(f"secret {name}: {why}")
        return kv_tiers.key_id(key) if key else ""

    # -- make ----------------------------------------------------------------------------------

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        match what:
            case Preflight():
                self._preflight(ctx)
            case MemoryFit(need):
                room = guard.room(None)  # the machine alone: what others hold is the Check's
                budget = room.budget
                why = vllm_memory.refused(
                    vllm_memory.cpu_fit(self.recipe, budget.limit, budget.reserves)
                )
                if why is not None:
                    raise Permanent(why)
                self._fitted = need
                ctx.progress(f"run.memory fits this machine (limit {budget.limit} bytes)")
            case TierDirectories(space):
                self._starting.hold_tiers(self.recipe.tier_plan().disks, space, ctx)
                self._prune(space, ctx)
            case TierImage():
                launch = self._launch()
                assert launch is not None  # the step comes after the base image is there
                self._plugin.build(
                    self.runtime,
                    launch.image,
                    self.state_dir / "tier-build",
                    ctx,
                    self.device.site_packages,
                )  # the plugin read afresh
            case ModelDownload():
                self._download(what, ctx)
            case _:
                super().make_own(what, ctx)

    def check_more(self, spec: RunSpec, ctx: StepContext) -> None:
        """Just before the start: the secret files it mounts, then, on a GPU, the guide's
        refusals and the memory share free once the engine it replaces is stopped."""
        names = self._file_secrets()
        if names:
            secrets = self.secrets()
            secretfiles.write(self._secrets_root, {n: secrets[n] for n in names})
        if disks := self.recipe.tier_plan().disks:  # made again, held from prunes till the start
            self._starting.hold_tiers(disks, spec.labels[NAMESPACE_LABEL], ctx)
        launch = self.device.recheck(ctx, self._replaced_share)
        if launch is None:  # nothing to read again: a CPU
            return
        ref = tier_image.tag(launch.image) if self.recipe.tiers.any else launch.image
        wanted = (ref, (*launch.args, *self.engine_args()))
        if wanted != (spec.labels.get(labels.IMAGE_REF), spec.command):
            with contextlib.suppress(FileNotFoundError):
                self._stamp.unlink()  # the next request runs the preflight afresh
            raise Permanent(
                f"the GPU changed since the preflight (it now asks for {launch.image}); "
                "request again"
            )

    def _replaced_share(self) -> int | None:
        """The memory share the running engine this start replaces was started with."""
        replaced = self.runtime.container(self.container_name)
        if replaced is not None and replaced.running and replaced.managed:
            with contextlib.suppress(ValueError, KeyError):
                return int(replaced.labels[MEMORY_LABEL])
        return None

    # -- run -----------------------------------------------------------------------------------

    def command(self) -> tuple[str, ...]:
        launch = self._launch()
        return (*(launch.args if launch else ()), *self.engine_args())

    def memory_need(self) -> EngineNeed | None:
        """The container's limit on a CPU; on a GPU the recipe's share of the memory limit."""
        return self.device.need(self.guard is not None)

    def engine_args(self) -> tuple[str, ...]:
        """The layout's flags, then the connector when there are tiers: its settings are in the
        environment (run_spec) and the key in its file, never in argv."""
        tiers = ("--kv-transfer-config", tier_image.transfer_config())
        extra = (*self.recipe.otlp_args(), *(tiers if self.recipe.tiers.any else ()))
        return (*self.recipe.layout_args(), *extra)

    def run_spec(self, found: EngineImage, endpoint: Endpoint) -> RunSpec:
        base = super().run_spec(found, endpoint)
        space = self.namespace(found.image)
        plan = self.recipe.tier_plan()
        tiers = kv_tiers.container(plan, space, self.key_id())
        names = self._file_secrets()
        given = secretfiles.plan(self._secrets_root, names)
        environment = account.environment(base.environment, leaving_out=names)  # HOME, HF_HOME
        environment.update(given.environment)  # paths of read-only files, never the values
        if self.recipe.vllm.model.hf is not None:  # downloaded by its own step: never at load
            environment.setdefault("HF_HUB_OFFLINE", "1")
        if self.recipe.tiers.any:
            environment.update(tiers.environment)  # the key is a file among the secrets above
        environment.update(self.device.environment)  # a CPU's KV cache space
        environment.update(self.recipe.otlp_environment())  # its own spans' exporter
        mounts = tuple(Mount(source, target) for source, target in tiers.volumes)
        return replace(
            base,
            environment=environment,
            mounts=mounts + base.mounts + given.mounts,
            shm_size=f"{tiers.shm_size}b" if tiers.shm_size else base.shm_size,
            memory=f"{tiers.memory}b" if tiers.memory else base.memory,
            labels={**base.labels, NAMESPACE_LABEL: space},
            user=account.user(),  # the tier directories' owner (prepare): the worker's uid
        )

    def mounts(self) -> tuple[Mount, ...]:
        ref = self.recipe.vllm.model.library
        if ref is None:
            return ()
        return (Mount(str(self.files.library_files()), self.recipe.model_argument, read_only=True),)

    def extra_labels(self) -> dict[str, str]:
        revision = (
            self.recipe.model_revision
            or hashlib.sha256(self.model_manifest().encode()).hexdigest()[:16]
        )
        return {labels.MODEL_REVISION: revision, MEMORY_LABEL: str(self.recipe.vllm.memory)}

    def ready(self) -> bool:
        """`/health` answers 200 (the engine loaded), then `/v1/models` lists the served name."""
        return self.endpoint is not None and probes.ready(
            self.endpoint.url, self.recipe.run.ready_path, self.recipe.vllm.served_name
        )

    def seen(self, look: Look[VllmLook]) -> Look[VllmLook]:
        """What the model's files say it is, and while it runs the version and the routes the
        engine states, and the KV tiers it has switched off."""
        container, url = look.container, look.endpoint.url if look.endpoint else None
        running = container.id if container is not None and container.running else None
        version = self._versions.of(running, url) if running and url else None
        routes = self._routes.of(running, url) if running and url else None
        note = self._off.note(url if self.recipe.tiers.any else None)
        architectures, pooling = hf_model.read_tasks(self.files.directory())
        own = replace(
            look.own,
            version=version,
            tiers_note=note,
            routes=routes,
            architectures=architectures,
            pooling_config=pooling,
        )
        return replace(look, own=own)

    def serves(self, look: Look[VllmLook]) -> dict[str, tuple[Capability, ...]]:
        """Every served name is the one model: the routes the running engine states, else what
        vLLM resolves for its arguments and its model's files (tasks.py); not known while the
        model's config.json is not there to read (a download still to come)."""
        own = look.own
        if look.running and own.routes is not None:
            found = tasks.from_routes(own.routes)
        elif own.architectures is not None:
            found = tasks.serves(self.recipe.vllm.args, own.architectures, own.pooling_config)
        else:
            return {}
        return {name: found for name in self.served(look)}

    def version(self, look: Look[VllmLook]) -> str | None:
        return look.own.version

    def targets(self, look: Look[VllmLook]) -> tuple[TargetGroup, ...]:
        group = {
            "model": self.recipe.model or self.recipe.vllm.served_name,
            "served_name": self.recipe.vllm.served_name,
        }
        return (self.target_group(look.endpoint, group),) if look.endpoint else ()

    def notes(self, look: Look[VllmLook]) -> str:  # the tier image's plugin; the tiers off
        return "; ".join(filter(None, (tier_image.note(look.own.tier_labels), look.own.tiers_note)))

    def settle(self, running: str | None, started: bool) -> None:
        self._starting.release()  # the start has run or will not: its namespace is released
        space = self.last.own.namespace if self.last is not None else None
        if started and running is not None and space is not None:
            self._prune(space)  # the replaced engine's namespace, once it has gone

    def named(self) -> tuple[str, ...]:
        return served_names(self.recipe)

    def parallel(self) -> int | None:
        return max_num_seqs(self.recipe)

    def private_files(self) -> tuple[Path, ...]:
        return (self._stamp, self._model_stamp)
