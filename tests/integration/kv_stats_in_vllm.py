"""Run inside the tier image: the connector's stats through vLLM 0.32.0's own path.

Two workers' stores count; each worker's report goes into a ModelRunnerOutput, vLLM's
KVOutputAggregator sums them (what tensor parallelism does), the scheduler's dict of it crosses
vLLM's msgpack encoder and decoder in EngineCoreOutputs (engine core to API server), and vLLM's
KVConnectorProm and KVConnectorLogging record it (model name: argv[1]). Prints the pieces, as JSON.
"""

from __future__ import annotations

import json
import logging
import sys

from lucia_kv.connector import LuciaKVStats, LuciaTierConnector
from lucia_kv.metrics import Metrics
from lucia_kv.report import Reporter
from prometheus_client import REGISTRY, generate_latest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

EXTRA = {
    "namespace": "stats",
    "nvme_dir": "/tmp/nvme",
    "nvme_bytes": 1 << 20,
    "hdd_dir": "/tmp/hdd",
    "hdd_bytes": 1 << 22,
}


def worker_output(metrics: Metrics) -> ModelRunnerOutput:
    counts = Reporter(metrics).take()
    stats = LuciaKVStats(data=counts) if counts else None
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
    )


def main() -> None:
    rank0, rank1 = Metrics(), Metrics()
    rank0.add("hits", "nvme", 7)
    rank0.add("corrupt", "hdd", reason="auth")
    rank1.add("hits", "nvme", 5)
    rank1.add("read_bytes", "hdd", 4096)
    merged = KVOutputAggregator(2).aggregate([worker_output(rank0), worker_output(rank1)])
    assert merged is not None and merged.kv_connector_output is not None
    aggregated = merged.kv_connector_output.kv_connector_stats
    payload = SchedulerStats(kv_connector_stats=aggregated.to_dict())
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=payload))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.kv_connector_stats
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="LuciaTierConnector",
            kv_connector_module_path="lucia_kv.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=EXTRA,
        )
    )
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: [sys.argv[1], "0"]})
    prom.observe(decoded, 0)
    prom.observe(decoded, 0)  # a second step's report adds to the first
    lines: list[str] = []
    logging_ = KVConnectorLogging(config.kv_transfer_config)
    logging_.observe(decoded)
    logging_.observe(decoded)
    logging_.log(log_fn=lambda text, *args: lines.append(text % args))
    rebuilt = LuciaTierConnector.build_kv_connector_stats(decoded)
    print(
        json.dumps(
            {
                "aggregated": aggregated.data,
                "decoded": decoded,
                "rebuilt": type(rebuilt).__name__,
                "empty": LuciaKVStats().is_empty(),
                "metrics": generate_latest(REGISTRY).decode(),
                "log": lines,
            }
        )
    )


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    main()
