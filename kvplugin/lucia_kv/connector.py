"""The vLLM KV connector over the block store (the only module that imports vllm).

Select it with `--kv-transfer-config '{"kv_connector": "LuciaTierConnector",
"kv_connector_module_path": "lucia_kv.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'`; the settings
are lucia_kv.config's. The scheduler side
finds how many leading full blocks of a prompt the tiers hold (a stat per block, no reads) and
plans loads and saves; the worker side loads blocks into vLLM's paged KV before the forward
(a block that does not load is reported, so vLLM recomputes it) and queues the step's full
blocks for the store's background writers after it, each way a host buffer of blocks at a time
(lucia_kv.batches: at most `buffer_bytes` held at once) through lucia_kv.transfer (one copy and
one wait per step, on the GPU too, while a step's blocks fit the buffer). The worker side reports
the store's counters to vLLM after each step (LuciaKVStats), and vLLM's API server adds them to
its own /metrics (LuciaPromMetrics) as lucia_kv_<name>_total{model_name, engine, tier[, reason]}.

A block's key chains the engine's seed (parallel layout, KV dtype), the token ids up to it and
the extras vLLM's own prefix cache keys it with (cache salt, LoRA adapter, multimodal items,
prompt embeddings: lucia_kv.scheduling, read by lucia_kv.extras); a request whose extras have no
name that lasts a restart skips the tiers (lucia_kv_requests_unkeyable_total). A request vLLM
has skip reading cached KV (`skip_reading_prefix_cache`: prompt logprobs, some pooling requests)
matches nothing in the tiers, as vLLM's own offloading connectors do, and is saved as any other
(lucia_kv_requests_read_skipped_total).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import batches, report
from .config import ConfigError, StoreConfig, for_rank, resolve, tiers
from .extras import RequestExtras, skips_reading
from .metrics import HELP, REASONED, UNTIERED, exposed, label_names
from .scheduling import Scheduling, StepPlan, seed
from .store import Store, probe
from .transfer import Blocks, block_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("lucia_kv")


@dataclass
class LuciaKVStats(KVConnectorStats):
    """The store's counter deltas of one step or more (lucia_kv.report's plain data)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        try:
            report.merge(self.data, report.parse(other.data))
        except report.ReportError as exc:  # never the engine's end: a count is lost, said so
            log.warning("a KV tier stats report was not added: %s", exc)
        return self

    def reduce(self) -> dict[str, int | float]:
        return report.reduce(self.data)

    def is_empty(self) -> bool:
        return not self.data


class LuciaPromMetrics(KVConnectorPromMetrics):
    """The store's counters in vLLM's /metrics: one counter per lucia_kv.metrics name, with
    vLLM's labels (model_name, engine), then tier, then reason where the counter has one."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = _counters(self._counter_cls, tuple(labelnames))
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # the series without a reason start at 0 on every configured tier (rate() needs them)
        for engine in per_engine_labelvalues:
            for name in HELP:
                if name not in REASONED:
                    tiered = [(tier,) for tier in _tier_names(vllm_config)]
                    for values in [()] if name in UNTIERED else tiered:
                        self._child(engine, name, values)

    def _child(self, engine: int, name: str, values: tuple[str, ...]) -> Any:
        key = (engine, name, values)
        child = self._children.get(key)
        if child is None:
            engine_values = self.per_engine_labelvalues[engine]
            child = self._counters[name].labels(*engine_values, *values)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        try:
            counts = report.parse(transfer_stats_data)
        except report.ReportError as exc:
            log.warning("a KV tier stats report was dropped: %s", exc)
            return
        for name, values, amount in report.series(counts):
            self._child(engine_idx, name, values).inc(amount)


_REGISTERED: dict[tuple[type[Any], tuple[str, ...]], dict[str, Any]] = {}


def _counters(counter_cls: type[Any], labelnames: tuple[str, ...]) -> dict[str, Any]:
    """The counters, registered once per process: a logger built again (vLLM's tests do)
    shares them, where registering the names twice would raise."""
    key = (counter_cls, labelnames)
    if key not in _REGISTERED:
        _REGISTERED[key] = {
            name: counter_cls(
                name=exposed(name),
                documentation=text,
                labelnames=[*labelnames, *label_names(name)],
            )
            for name, text in HELP.items()
        }
    return _REGISTERED[key]


def _tier_names(vllm_config: VllmConfig) -> tuple[str, ...]:
    """The tiers the workers' stores have (the API server's process has no store, no key)."""
    transfer = vllm_config.kv_transfer_config
    try:
        found = tiers((transfer.kv_connector_extra_config if transfer else None) or {})
    except ConfigError:
        return ()  # the worker refuses to start and says why
    return tuple(tier.name for tier in found)


class LuciaStepMetadata(KVConnectorMetadata):
    """The step's plan, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _seed(vllm_config: VllmConfig) -> bytes:
    """What shapes every block's bytes beyond its tokens, its request's extras and the
    namespace: the parallel layout and the KV cache's dtype (the model's, under "auto")."""
    parallel = vllm_config.parallel_config
    kv_dtype = str(vllm_config.cache_config.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return seed(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, kv_dtype)


class LuciaTierConnector(KVConnectorBase_V1):
    """KV blocks to and from lucia_kv's encrypted shm/NVMe/HDD tiers."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            raise ConfigError(
                'set "kv_load_failure_policy": "recompute" in --kv-transfer-config: with vLLM\'s '
                "default (fail) a block that does not load fails its request instead of being "
                "recomputed"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._config: StoreConfig = resolve(extra)
        self._block_size = vllm_config.cache_config.block_size
        self._requests: dict[str, Request] = {}
        self._extras = RequestExtras(vllm_config, self._block_size)
        self._scheduling = Scheduling(self._block_size, _seed(vllm_config))
        self._rank = 0
        self._store: Store | None = None
        self._reporter: report.Reporter | None = None
        self._blocks: Blocks | None = None  # the layers' KV caches, in name order
        self._pins: dict[str, list[bytes]] = {}
        self._load_errors: set[int] = set()
        parallel = vllm_config.parallel_config
        ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # this data-parallel engine's index (kept when a dense model's ranks are made
        # independent engines of size 1) and size
        dp = (parallel.data_parallel_index, parallel.data_parallel_size)
        # the scheduler probes rank 0's share: every rank saves the same blocks
        self._config = for_rank(self._config, 0, ranks, *dp)
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            rank = get_pp_group().rank_in_group * parallel.tensor_parallel_size
            rank += get_tensor_model_parallel_rank()
            self._rank = rank
            self._config = for_rank(resolve(extra), rank, ranks, *dp)  # the plan's keys, dirs
            self._store = Store(self._config)
            self._reporter = report.Reporter(self._store.metrics)
        log.info(
            "lucia-kv %s: namespace %s, tiers %s",
            self._config.plugin_version,
            self._config.namespace,
            ", ".join(f"{t.name}={t.max_bytes}" for t in self._config.tiers),
        )

    # --- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        extras = self._extras.of(request)
        if extras is None:
            self._scheduling.unkeyable(request.request_id)
            return 0, False
        rid, computed = request.request_id, num_computed_tokens
        if skips_reading(request):  # its answer needs every prompt token computed: saved only
            return self._scheduling.read_skipped(rid, computed, extras), False
        # the ids vLLM computes the KV of (a prompt of embeddings: 0s, its digests in extras)
        prompt = list(request.all_token_ids[: request.num_prompt_tokens])
        keys = self._scheduling.prompt_keys(prompt, extras)
        hits = probe(self._config, keys)
        return self._scheduling.matched(rid, computed, keys, hits, extras), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        self._scheduling.allocated(
            request.request_id, blocks.get_block_ids()[0], num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        counts = scheduler_output.num_scheduled_tokens
        scheduled: list[tuple[str, list[int] | None, bool, int, int]] = [
            (new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens, counts[new.req_id])
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[index]
            new_ids = None if blocks is None else list(blocks[0])
            resumed, computed = req_id in cached.resumed_req_ids, cached.num_computed_tokens[index]
            scheduled.append((req_id, new_ids, resumed, computed, counts[req_id]))
        known = [self._requests[req_id] for req_id, *_ in scheduled if req_id in self._requests]
        tokens = {request.request_id: list(request.all_token_ids) for request in known}
        # a streaming session's next input may bring multimodal items: the extras of now
        extras = {request.request_id: self._extras.of(request) for request in known}
        return LuciaStepMetadata(self._scheduling.step(scheduled, tokens, extras))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._extras.forget(request.request_id)
        self._scheduling.finished(request.request_id)
        return False, None  # saves copy the blocks out before the step ends

    # --- worker side ---------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Also count the requests the scheduler found unkeyable or told to skip reads: on
        rank 0, in its store."""
        super().bind_connector_metadata(connector_metadata)
        plan = self._plan()
        if plan is None or self._rank != 0 or self._store is None:
            return
        if plan.unkeyable:
            self._store.count("requests_unkeyable", plan.unkeyable)
        if plan.read_skipped:
            self._store.count("requests_read_skipped", plan.read_skipped)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        blocks = self._kv_cache_config.num_blocks
        layers = []
        for name in sorted(kv_caches):
            cache = kv_caches[name]
            try:
                layers.append(block_view(cache, blocks))
            except ValueError:
                raise ValueError(
                    f"KV cache {name} of shape {tuple(cache.shape)} has no block dim"
                ) from None
        self._blocks = Blocks(layers, buffer_bytes=self._config.buffer_bytes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or self._store is None or self._blocks is None:
            return
        for finished in plan.finished:
            self._unpin(finished)
        for load in plan.loads:
            keys = [key for _, key in load.blocks]
            self._store.pin(keys)
            self._pins.setdefault(load.request_id, []).extend(keys)
        size = self._blocks.block_bytes
        requests = [load.blocks for load in plan.loads]
        self._load_errors |= batches.load(self._blocks, requests, lambda k: self._load(k, size))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved whole in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self._store is None or self._blocks is None:
            return
        blocks: list[tuple[int, bytes]] = []
        for save in plan.saves:
            keys = [key for _, key in save.blocks]
            self._store.pin(keys)
            self._pins.setdefault(save.request_id, []).extend(keys)
            blocks.extend(save.blocks)
        batches.save(self._blocks, blocks, self._store.save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for request_id in finished_req_ids:
            self._unpin(request_id)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the store counted since the last step's report (vLLM calls it after each step;
        counts a background writer makes later go with a later step)."""
        if self._reporter is None:
            return None
        counts = self._reporter.take()
        return LuciaKVStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        try:
            return LuciaKVStats(data=report.parse(data or {}))
        except report.ReportError as exc:
            log.warning("a KV tier stats report was dropped: %s", exc)
            return LuciaKVStats(data={})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return LuciaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # --- helpers -------------------------------------------------------------------------------

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, LuciaStepMetadata) else None

    def _load(self, key: bytes, size: int) -> bytes | None:
        """A block from the store, or None: whatever a tier does is a miss, recomputed, never
        the model runner's end (the store switches a failing tier off itself)."""
        assert self._store is not None
        try:
            return self._store.load(key, size)
        except Exception:
            log.exception("a KV block load failed; it is recomputed")
            return None

    def _unpin(self, request_id: str) -> None:
        keys = self._pins.pop(request_id, None)
        if keys and self._store is not None:
            self._store.unpin(keys)
