"""The memory plan counts the context cache's host memory: the tier plugin's staging buffer and
write queue, and the shm tier once, in the vLLM engine's need and its container's limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engines.loader import parse
from supervisor.engines.vllm import memory
from supervisor.engines.vllm.recipe import (
    PLUGIN_BUFFER_BYTES,
    PLUGIN_QUEUE_BYTES,
    Tiers,
    VllmRecipe,
)
from supervisor.memplan.fit import Budget
from supervisor.recipe.schema import RecipeError

MIB = 1024**2
GIB = 1024**3
KEY_FILE = "/etc/lucia/kv.key"
SHARE = "the context cache's host buffers"


def recipe(device: str, tiers: str, run: str = 'shm_size = "512m"\nmemory = "6g"') -> VllmRecipe:
    section = f'[tiers]\n{tiers}\n[secrets]\nLUCIA_KV_KEY = "{KEY_FILE}"\n' if tiers else ""
    found = parse(f"""
name = "c"
engine = "vllm"
model = "tiny"
[vllm]
device = "{device}"
served_name = "tiny"
max_model_len = 1024
[vllm.model.hf]
id = "org/tiny"
revision = "{"0" * 40}"
{section}
[run]
port = 8000
{run}
""")
    assert isinstance(found, VllmRecipe)
    return found


NVME = 'nvme = { path = "/var/lib/lucia/kv/nvme", max_bytes = "16g" }'
BUFFERS = PLUGIN_BUFFER_BYTES + PLUGIN_QUEUE_BYTES
GPU_RUN = 'shm_size = "10g"\nmemory = "26g"'


@pytest.mark.parametrize(
    ("device", "tiers", "run", "host", "need", "cache"),
    [
        # a CPU engine's need is its container's limit: run.memory plus the plugin's buffers
        ("cpu", "", 'shm_size = "512m"\nmemory = "6g"', True, 6 * GIB, 0),
        ("cpu", NVME, 'shm_size = "512m"\nmemory = "6g"', True, 6 * GIB + BUFFERS, BUFFERS),
        (
            "cpu",
            f'{NVME}\nbuffer_bytes = "1g"\nqueue_bytes = "64m"',
            'shm_size = "512m"\nmemory = "6g"',
            True,
            7 * GIB + 64 * MIB,
            GIB + 64 * MIB,
        ),
        # the shm tier lives in /dev/shm, which run.memory already holds: counted once
        (
            "cpu",
            'shm_bytes = "256m"',
            'shm_size = "512m"\nmemory = "6g"',
            True,
            6 * GIB + BUFFERS,
            BUFFERS,
        ),
        # a GPU engine's need is its share of the GPUs' memory, which holds neither
        ("gpu", "", GPU_RUN, True, 90 * GIB, 0),
        ("gpu", NVME, GPU_RUN, True, 90 * GIB + BUFFERS, BUFFERS),
        ("gpu", f'shm_bytes = "8g"\n{NVME}', GPU_RUN, True, 98 * GIB + BUFFERS, 8 * GIB + BUFFERS),
        # with limit = "gpu" the plan divides the GPUs' memory alone: host memory is not in it
        ("gpu", f'shm_bytes = "8g"\n{NVME}', GPU_RUN, False, 90 * GIB, 0),
    ],
)
def test_the_need_counts_the_context_caches_host_memory_once(
    device: str, tiers: str, run: str, host: bool, need: int, cache: int
) -> None:
    found = recipe(device, tiers, run)
    planned = (
        memory.cpu_need(found) if device == "cpu" else memory.gpu_need(found, 100 * GIB, host=host)
    )
    assert planned is not None
    assert planned.need == need
    assert dict(planned.shares).get(SHARE, 0) == cache


@pytest.mark.parametrize(
    ("tiers", "limit"),
    [("", 6 * GIB), (NVME, 6 * GIB + BUFFERS), ('shm_bytes = "256m"', 6 * GIB + BUFFERS)],
)
def test_the_containers_limit_is_what_the_cpu_plan_counts(tiers: str, limit: int) -> None:
    found = recipe("cpu", tiers)
    assert found.memory_limit == limit
    assert found.tier_plan().memory == limit
    planned = memory.cpu_need(found)
    assert planned is not None and planned.need == limit


def test_the_plan_of_a_gpu_server_leaves_host_memory_out_and_of_a_spark_counts_it() -> None:
    found = recipe("gpu", f'shm_bytes = "8g"\n{NVME}', GPU_RUN)
    server = memory.plan(found, Budget(80 * GIB, 2 * GIB, host=False), 2.0)
    assert server.verdict is not None and server.verdict.need.need == 72 * GIB and server.fits
    unified = memory.plan(found, Budget(80 * GIB, 2 * GIB), 2.0)
    assert unified.verdict is not None and unified.verdict.need.need == 80 * GIB + BUFFERS
    assert not unified.fits


def test_a_refusal_names_the_context_caches_share() -> None:
    why = memory.refused(memory.cpu_fit(recipe("cpu", NVME), 8 * GIB, 4 * GIB))
    assert why is not None
    assert f"needs 6.5 GiB (of which {SHARE} 512.0 MiB), 4.0 GiB left" in why
    assert "Lower run.memory" in why
    plain = memory.refused(memory.cpu_fit(recipe("cpu", ""), 8 * GIB, 4 * GIB))
    assert plain is not None and "needs 6.0 GiB, 4.0 GiB left" in plain and "of which" not in plain


def test_buffer_and_queue_bytes_are_read_as_byte_sizes() -> None:
    tiers = recipe("cpu", f'{NVME}\nbuffer_bytes = "128m"\nqueue_bytes = 4096').tiers
    assert (tiers.buffer_bytes, tiers.queue_bytes) == (128 * MIB, 4096)
    assert tiers.host_bytes == 128 * MIB + 4096
    assert Tiers().host_bytes == 0  # tiers off: the plugin is not loaded


@pytest.mark.parametrize("setting", ["buffer_bytes = 0", 'queue_bytes = "0"', "buffer_bytes = -1"])
def test_a_buffer_of_nothing_is_refused_naming_the_setting(setting: str) -> None:
    """The plugin refuses a buffer or queue of nothing at its start: the recipe says so first,
    and the running engine is never replaced by one that cannot start."""
    with pytest.raises(RecipeError) as refused:
        recipe("cpu", f"{NVME}\n{setting}")
    assert f"tiers.{setting.split(maxsplit=1)[0]}" in str(refused.value), refused.value


@pytest.mark.parametrize(
    ("name", "mirrored"),
    [("buffer_bytes", PLUGIN_BUFFER_BYTES), ("queue_bytes", PLUGIN_QUEUE_BYTES)],
)
def test_the_mirrored_defaults_are_the_plugins_own(
    name: str, mirrored: int, tmp_path: Path
) -> None:
    """What the plugin resolves with nothing set (kvplugin/lucia_kv/config.py) is what the
    supervisor counts and passes, so the two cannot drift apart."""
    from lucia_kv import config

    resolved = config.resolve(
        {"namespace": "n", "nvme_dir": str(tmp_path), "nvme_bytes": 1},
        {"LUCIA_KV_KEY": "ab" * 32},
    )
    assert getattr(resolved, name) == mirrored
    assert getattr(Tiers(), name) == mirrored
