"""The KV tier plugin as an image layer, in the real vLLM 0.32.0 CPU server.

`<cpu image>-tiers` is built cold (no build cache) under a private tag through the project's own
`Runtime.build`, from supervisor.engines.vllm.tier_image's context. Servers run from it on
the tiny model, with the NVMe and HDD tiers bind-mounted from a tmp dir: one with the tiers and
no prefix cache, asked the prompt twice (cold, then from the tiers), then under two cache salts
(each its own blocks); one with vLLM's own ExampleConnector (which writes the plaintext KV of
the same prompt) for the encryption check; and the tiered one again, a restart, asked the prompt
under the first salt. Before that first server stops, the prompt with prompt logprobs under a
salt of its own, twice (cold, then with its blocks in the tiers), then without them (from the
tiers): vLLM has such a request skip reading cached KV, so the tiers give it nothing. The
store's counters are read from vLLM's own /metrics and compared with the metrics file.
Reuse after a restart and damaged blocks are proven through the worker
(test_kv_tiers_worker.py); vLLM's aggregation of every counter, corrupt included, in the image
by kv_stats_in_vllm.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker.labels import TIERS_BASE, TIERS_VERSION
from supervisor.docker.runtime import Runtime
from supervisor.engines.vllm import tier_image
from tests.fixtures import RUN_ID, TEST_LABEL
from tests.vllm_cpu import BLOCK_TOKENS, PROMPT_SOURCE, SERVED_NAME, VllmServer, wait_for

pytestmark = pytest.mark.docker

PROMPT = [random.Random(22).randrange(3, 512) for _ in range(2000)]  # token ids, no specials
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS  # 15 blocks, 1920 tokens
MAX_TOKENS = 32
NAMESPACE = "tiers-test"
LUCIA = re.compile(r"^(lucia_kv_\w+_total)(?:\{([^}]*)\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')
TIERS = ("shm", "nvme", "hdd")
# counted on the model step's own thread (the connector's loads): in the step's stats report
READ_SIDE = frozenset(
    f"lucia_kv_{name}_total" for name in ("hits", "misses", "read_bytes", "corrupt", "stale_key")
)
TRANSFER_LOG = re.compile(r"KV Transfer metrics: (.*)$", re.M)  # vLLM's log, every 10 s
SHORT_PROMPT = [5, 6, 7, 8]  # under one block: nothing for the store to load or save
SALTS = ("tenant-a", "tenant-b")
LOGPROBS_SALT = "prompt-logprobs"  # blocks of its own: the first ask is cold
EXTERNAL = "external_kv_transfer"  # vLLM's source of the prompt tokens a connector gave


@dataclass(frozen=True)
class TierImage:
    ref: str
    id: str
    base_id: str
    seconds: float
    lines: tuple[str, ...]


Series = tuple[str, tuple[tuple[str, str], ...]]  # name, labels but model_name and engine


@dataclass
class Counted:
    """The store's counters in vLLM's /metrics and in the metrics file, once the file had
    every count of the prompt; then both again after one more request (a model step)."""

    served: dict[Series, float]
    filed: dict[Series, float]
    served_next: dict[Series, float]
    filed_next: dict[Series, float]


@dataclass
class Run:
    """One server's answer to the prompt, where its prompt tokens came from, its start time."""

    token_ids: tuple[int, ...]
    text: str
    by_source: dict[str, float]
    seconds_to_health: float
    metrics: str = ""  # the /metrics text right after the answer
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # where they were asked for
    counted: Counted | None = None
    logs: str = ""


@dataclass
class Runs:
    work: Path
    key: bytes
    cold: Run
    repeated: Run
    example: Run
    salted: tuple[Run, ...] = ()  # the prompt under SALTS, after `repeated`, on its server
    restarted: Run | None = None  # the prompt under SALTS[0], on the tiered server started again
    block_files: list[Path] = field(default_factory=list)  # the unsalted prompt's
    # under LOGPROBS_SALT: with prompt logprobs cold, again with the blocks stored, without
    logprobs: tuple[Run, ...] = ()


def _build(runtime: Runtime, request: Any) -> tuple[Any, list[str], float]:
    lines: list[str] = []
    started = time.monotonic()
    image = runtime.build(request, lines.append, threading.Event())
    return image, lines, time.monotonic() - started


@pytest.fixture(scope="module")
def tier_image_built(
    client: docker.DockerClient, vllm_cpu_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TierImage]:
    base = client.images.get(vllm_cpu_image)
    repository = f"lucia-test-{RUN_ID}-vllm-cpu"
    base.tag(repository, "base")
    base_ref, base_id = f"{repository}:base", str(base.id)
    plugin = tier_image.read_plugin()
    context = tier_image.write_context(plugin, base_id, tmp_path_factory.mktemp("tier-context"))
    request = tier_image.build_request(plugin, base_ref, base_id, context, nocache=True)
    assert request.tag == f"{repository}:base-tiers"
    runtime = Runtime()
    built: list[str] = []  # removed by id too: a rebuild under the tag leaves it untagged
    try:
        image, lines, seconds = _build(runtime, request)
        built.append(image.id)
        print(f"\ntier image: cold build of {request.tag} in {seconds:.1f} s")
        yield TierImage(request.tag, image.id, base_id, seconds, tuple(lines))
    finally:
        for ref in (request.tag, *built, base_ref):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(ref)


def test_the_cold_build_ran_every_step_and_checked_the_plugin_beside_vllm(
    tier_image_built: TierImage, client: docker.DockerClient
) -> None:
    assert not any("Using cache" in line for line in tier_image_built.lines)
    assert any(
        line.strip() == "lucia-kv-tiers 0.1.0 imports beside vllm 0.32.0"
        for line in tier_image_built.lines
    ), tier_image_built.lines[-20:]
    labels = client.images.get(tier_image_built.ref).labels
    plugin = tier_image.read_plugin()
    assert labels[TIERS_BASE] == tier_image_built.base_id
    assert labels[TIERS_VERSION] == plugin.version == "0.1.0"
    assert tier_image.current(plugin, tier_image_built.base_id, labels)
    assert not tier_image.current(plugin, "sha256:" + "0" * 64, labels), "another base: rebuild"


def test_nocache_runs_again_the_steps_a_build_would_take_from_the_cache(
    tier_image_built: TierImage, tmp_path: Path
) -> None:
    """The same build again takes its steps from the cache (`Using cache`, the same image);
    with nocache, none: every step runs, a new image."""
    plugin = tier_image.read_plugin()
    context = tier_image.write_context(plugin, tier_image_built.base_id, tmp_path / "context")
    base_ref = tier_image_built.ref.removesuffix(tier_image.SUFFIX)
    request = tier_image.build_request(plugin, base_ref, tier_image_built.base_id, context)
    runtime = Runtime()
    cached, lines, _ = _build(runtime, request)
    assert any("Using cache" in line for line in lines), lines
    assert cached.labels[TIERS_VERSION] == plugin.version
    cold, lines, _ = _build(runtime, dataclasses.replace(request, nocache=True))
    assert not any("Using cache" in line for line in lines), lines
    assert cold.id != cached.id


def test_vllms_own_aggregator_serializer_and_prometheus_carry_the_reports(
    tier_image_built: TierImage, client: docker.DockerClient
) -> None:
    """Two workers' reports through vLLM's KVOutputAggregator, its msgpack between engine core
    and API server, its KVConnectorProm and its KVConnectorLogging (tests/integration/
    kv_stats_in_vllm.py, run in the tier image): summed, intact, on /metrics, in the log."""
    here = Path(__file__).parent
    output = client.containers.run(
        tier_image_built.ref,
        ["/checks/kv_stats_in_vllm.py", SERVED_NAME],
        entrypoint="python3",
        name=f"lucia-t{RUN_ID}-kv-stats",
        labels={TEST_LABEL: RUN_ID},
        volumes={str(here): {"bind": "/checks", "mode": "ro"}},
        network_mode="none",
        remove=True,
    )
    found = json.loads(bytes(output).decode().strip().splitlines()[-1])
    expected = {
        "corrupt": {"hdd": {"auth": 1}},
        "hits": {"nvme": {"": 12}},  # 7 + 5: the two ranks' reads
        "read_bytes": {"hdd": {"": 4096}},
    }
    assert found["aggregated"] == expected
    assert found["decoded"] == expected, "msgpack carries the report unchanged"
    assert found["rebuilt"] == "LuciaKVStats"
    assert found["empty"] is True
    served = _lucia(found["metrics"])
    assert _nonzero(served) == {  # two steps' reports, added
        ("lucia_kv_hits_total", (("tier", "nvme"),)): 24.0,
        ("lucia_kv_read_bytes_total", (("tier", "hdd"),)): 8192.0,
        ("lucia_kv_corrupt_total", (("reason", "auth"), ("tier", "hdd"))): 2.0,
    }
    assert served[("lucia_kv_writes_total", (("tier", "nvme"),))] == 0.0, "at 0 from the start"
    assert found["log"] == [
        "KV Transfer metrics: corrupt.hdd.auth=2, hits.nvme=24, read_bytes.hdd=8192"
    ]


def _metric(pattern: re.Pattern[str], text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for match in pattern.finditer(text):
        key = match.group(1) if pattern.groups > 1 else ""
        found[key] = found.get(key, 0.0) + float(match.groups()[-1])
    return found


def _block_files(work: Path) -> list[Path]:
    return sorted(
        path
        for tier in ("nvme", "hdd")
        for path in (work / tier).rglob("*")
        if path.is_file() and re.fullmatch(r"[0-9a-f]{64}", path.name)
    )


def _lucia(text: str) -> dict[Series, float]:
    """The lucia_kv_*_total series of a Prometheus text, by name and tier (and reason); vLLM's
    own labels are checked and left out, so the file's series and /metrics' compare."""
    found: dict[Series, float] = {}
    for name, inner, value in LUCIA.findall(text):
        labels = dict(LABEL.findall(inner))
        if "model_name" in labels:
            assert labels.pop("model_name") == SERVED_NAME, inner
            assert labels.pop("engine") == "0", inner
        key = (name, tuple(sorted(labels.items())))
        found[key] = found.get(key, 0.0) + float(value)
    return found


def _nonzero(series: dict[Series, float]) -> dict[Series, float]:
    return {key: value for key, value in series.items() if value}


def _read_side(series: dict[Series, float]) -> dict[Series, float]:
    """The nonzero counts made on the model step's own thread (in that step's stats report)."""
    return {key: value for key, value in _nonzero(series).items() if key[0] in READ_SIDE}


def _total(series: dict[Series, float], name: str, **labels: str) -> float:
    return sum(
        value
        for (key, found), value in series.items()
        if key == name and set(labels.items()) <= set(found)
    )


def _transfer_log(logs: str) -> dict[str, float]:
    """The sums of vLLM's periodic `KV Transfer metrics: name.tier=n, ...` lines (each line is
    the connector's reports of one interval, aggregated and reduced by the connector's stats)."""
    found: dict[str, float] = {}
    for line in TRANSFER_LOG.findall(logs):
        for item in line.split(", "):
            key, _, value = item.partition("=")
            found[key] = found.get(key, 0.0) + float(value)
    return found


def _count(
    server: VllmServer, work: Path, done: Callable[[dict[Series, float]], bool], what: str
) -> Counted:
    """/metrics and the metrics file once the file shows `done` (the writers finished), then
    both after a short prompt. vLLM ships a connector's stats only with a model step: what the
    background writers counted after the prompt's last step (the blocks they wrote, copied or
    evicted) is missing from /metrics until the next step, which the short prompt gives."""
    path = work / "metrics" / "lucia-kv.prom"

    def filed() -> dict[Series, float]:
        return _lucia(path.read_text()) if path.exists() else {}

    def served() -> dict[Series, float]:
        return _lucia(server.get("/metrics").body.decode())

    wait_for(lambda: done(filed()), what, lambda: str(_nonzero(filed())))
    served_now, filed_now = served(), filed()
    answer = server.post(
        "/v1/completions",
        {"model": SERVED_NAME, "prompt": SHORT_PROMPT, "max_tokens": 1, "temperature": 0},
        timeout=600,
    )
    assert answer.status == 200, answer.body[-2000:]
    # the step's report reaches vLLM's Prometheus logger beside the answer, not before it
    wait_for(
        lambda: _nonzero(served()) == _nonzero(filed()),
        "/metrics to show the metrics file's counts after one more step",
        lambda: f"(served {_nonzero(served())}, filed {_nonzero(filed())})",
    )
    return Counted(served_now, filed_now, served(), filed())


def _serve(
    start: Callable[..., VllmServer], image: str, work: Path, key: bytes, transfer: str
) -> VllmServer:
    volumes = {
        str(work / name): {"bind": f"/kv/{name}", "mode": "rw"}
        for name in ("nvme", "hdd", "metrics", "example")
    }
    return start(
        args=[
            "--max-model-len",
            "2048",  # after the fixture's 1024: argparse keeps the last
            "--enable-prompt-tokens-details",
            "--no-enable-prefix-caching",  # a repeat of the prompt goes to the connector
            "--enforce-eager",  # no torch.compile warm-up (test_vllm_cpu_image.py compiles)
            "--kv-transfer-config",
            transfer,
        ],
        image=image,
        volumes=volumes,
        environment={"LUCIA_KV_KEY": key.hex()},
    )


def _ask(server: VllmServer, salt: str | None = None, prompt_logprobs: int | None = None) -> Run:
    """The server's answer to the prompt (under a cache salt, with prompt logprobs), and where
    its prompt tokens came from so far."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    answer = server.post("/v1/completions", body, timeout=600)
    assert answer.status == 200, answer.body[-2000:]
    choice = answer.json()["choices"][0]
    assert answer.json()["usage"]["prompt_tokens"] == len(PROMPT)
    metrics = server.get("/metrics").body.decode()
    by_source = _metric(PROMPT_SOURCE, metrics)
    run = Run(
        tuple(choice["token_ids"]), choice["text"], by_source, server.seconds_to_health, metrics
    )
    if prompt_logprobs is not None:
        run.prompt_logprobs = choice["prompt_logprobs"]
    print(f"\n/health in {run.seconds_to_health:.1f} s; prompt tokens by source {by_source}")
    return run


def _stop(server: VllmServer) -> None:
    server.container.kill(signal="SIGTERM")
    server.container.wait(timeout=120)


@pytest.fixture(scope="module")
def runs(
    tier_image_built: TierImage,
    start_vllm_cpu: Callable[..., VllmServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Runs:
    work = tmp_path_factory.mktemp("tiers")
    for name in ("nvme", "hdd", "metrics", "example"):
        (work / name).mkdir(mode=0o700)
    key = os.urandom(32)
    settings: dict[str, str | int] = {
        "namespace": NAMESPACE,
        "shm_dir": f"/dev/shm/lucia-kv/{NAMESPACE}",
        "shm_bytes": 8 << 20,
        "nvme_dir": f"/kv/nvme/{NAMESPACE}",
        "nvme_bytes": 64 << 20,
        "hdd_dir": f"/kv/hdd/{NAMESPACE}",
        "hdd_bytes": 256 << 20,
        "metrics_file": "/kv/metrics/lucia-kv.prom",
    }
    transfer = tier_image.transfer_config(settings)
    image = tier_image_built.ref

    def blocks_written() -> bool:
        return len(_block_files(work)) >= 2 * FULL_BLOCKS

    server = _serve(start_vllm_cpu, image, work, key, transfer)
    cold = _ask(server)
    wait_for(blocks_written, "every block on NVMe and HDD")
    repeated = _ask(server)  # no prefix cache: every full block is read from the shm tier
    repeated.counted = _count(
        server,
        work,
        lambda f: _total(f, "lucia_kv_hits_total", tier="shm") >= FULL_BLOCKS,
        "the metrics file to count the shm tier's reads",
    )
    wait_for(lambda: "hits.shm" in _transfer_log(server.logs()), "vLLM's KV transfer log line")
    repeated.logs = server.logs()
    block_files = _block_files(work)
    salted = [_ask(server, SALTS[0])]
    if salted[0].by_source.get(EXTERNAL, 0.0) == repeated.by_source.get(EXTERNAL, 0.0):
        # computed, not loaded: its blocks are new, the restart below reads them
        wait_for(
            lambda: len(_block_files(work)) >= 2 * 2 * FULL_BLOCKS,
            "every block of the salted prompt on NVMe and HDD",
        )
    salted.append(_ask(server, SALTS[1]))
    took = [repeated, *salted]
    computed = sum(  # the salted prompts computed, not loaded: blocks of their own
        after.by_source.get(EXTERNAL, 0.0) == before.by_source.get(EXTERNAL, 0.0)
        for before, after in itertools.pairwise(took)
    )
    stored = 2 * FULL_BLOCKS * (1 + computed)
    wait_for(lambda: len(_block_files(work)) >= stored, "every salted block on NVMe and HDD")
    logprobs = [_ask(server, LOGPROBS_SALT, prompt_logprobs=1)]
    wait_for(
        lambda: len(_block_files(work)) >= stored + 2 * FULL_BLOCKS,
        "every block of the prompt-logprobs prompt on NVMe and HDD",
    )
    logprobs.append(_ask(server, LOGPROBS_SALT, prompt_logprobs=1))
    logprobs.append(_ask(server, LOGPROBS_SALT))
    _stop(server)

    example_config = (
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"shared_storage_path": "/kv/example"}}'
    )
    server = _serve(start_vllm_cpu, image, work, key, example_config)
    example = _ask(server)
    wait_for(lambda: any((work / "example").rglob("*.safetensors")), "ExampleConnector's files")
    _stop(server)

    server = _serve(start_vllm_cpu, image, work, key, transfer)  # the tiered server again
    restarted = _ask(server, SALTS[0])
    _stop(server)
    return Runs(
        work, key, cold, repeated, example, tuple(salted), restarted, block_files, tuple(logprobs)
    )


def test_a_repeat_of_the_prompt_comes_from_the_tiers_with_the_same_answer(runs: Runs) -> None:
    assert len(runs.cold.token_ids) == MAX_TOKENS
    assert runs.cold.by_source.get("external_kv_transfer", 0.0) == 0.0
    external = runs.repeated.by_source.get("external_kv_transfer", 0.0)  # counted since the start
    print(f"\nrepeated: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external == FULL_BLOCKS * BLOCK_TOKENS >= 0.9 * len(PROMPT)
    assert runs.repeated.token_ids == runs.cold.token_ids
    assert runs.repeated.text == runs.cold.text


def test_another_cache_salt_takes_nothing_from_the_tiers_the_same_one_after_a_restart_does(
    runs: Runs,
) -> None:
    """vLLM salts its own prefix cache's keys per tenant; the tiers' keys take the salt too:
    the same prompt under another salt (or none) is computed again, under the same salt it is
    read back, after a restart too (the salt's keys do not depend on the process)."""
    tenant_a, tenant_b = runs.salted
    before = runs.repeated.by_source.get(EXTERNAL, 0.0)  # the short prompt in between: none
    took_a = tenant_a.by_source.get(EXTERNAL, 0.0) - before
    took_b = tenant_b.by_source.get(EXTERNAL, 0.0) - tenant_a.by_source.get(EXTERNAL, 0.0)
    assert runs.restarted is not None
    took_again = runs.restarted.by_source.get(EXTERNAL, 0.0)  # a new server counts from 0
    print(
        f"\nfrom the tiers: {took_a:.0f} tokens under {SALTS[0]} after the unsalted prompt, "
        f"{took_b:.0f} under {SALTS[1]} after {SALTS[0]}, {took_again:.0f} under {SALTS[0]} "
        "after a restart"
    )
    assert took_a == 0.0, "the unsalted prompt's blocks went to a salted request"
    assert took_b == 0.0, f"{SALTS[0]}'s blocks went to {SALTS[1]}"
    assert took_again == FULL_BLOCKS * BLOCK_TOKENS >= 0.9 * len(PROMPT)
    assert tenant_a.token_ids == tenant_b.token_ids == runs.cold.token_ids
    assert runs.restarted.token_ids == runs.cold.token_ids


def _logprob_of_each_token(run: Run) -> list[float]:
    """The logprob of each prompt token after the first (the first has none), all present."""
    assert run.prompt_logprobs is not None
    assert len(run.prompt_logprobs) == len(PROMPT)
    assert run.prompt_logprobs[0] is None
    found = []
    for position, (token, entry) in enumerate(zip(PROMPT, run.prompt_logprobs, strict=True)):
        if position == 0:
            continue
        assert entry is not None and str(token) in entry, f"position {position}: {entry}"
        found.append(float(entry[str(token)]["logprob"]))
    return found


def test_prompt_logprobs_are_computed_whole_when_the_tiers_hold_the_prompt(runs: Runs) -> None:
    """vLLM has a prompt-logprobs request skip reading cached KV (a prompt token whose KV was
    loaded gets no logprob): with the prompt's blocks in the tiers, such a request takes
    nothing from them, and its logprobs are the cold ones, every one there; a request without
    them takes the blocks, which proves they were there to take."""
    cold, warm, plain = runs.logprobs
    before = runs.salted[-1].by_source.get(EXTERNAL, 0.0)
    took_cold = cold.by_source.get(EXTERNAL, 0.0) - before
    took_warm = warm.by_source.get(EXTERNAL, 0.0) - cold.by_source.get(EXTERNAL, 0.0)
    took_plain = plain.by_source.get(EXTERNAL, 0.0) - warm.by_source.get(EXTERNAL, 0.0)
    print(
        f"\nfrom the tiers under {LOGPROBS_SALT}: {took_cold:.0f} tokens cold with prompt "
        f"logprobs, {took_warm:.0f} again with them, {took_plain:.0f} without them"
    )
    assert took_plain == FULL_BLOCKS * BLOCK_TOKENS, "the tiers held the prompt's blocks"
    assert took_cold == took_warm == 0.0
    cold_logprobs, warm_logprobs = _logprob_of_each_token(cold), _logprob_of_each_token(warm)
    assert warm_logprobs == pytest.approx(cold_logprobs, abs=1e-4)
    assert warm.prompt_logprobs == cold.prompt_logprobs
    assert cold.token_ids == warm.token_ids == plain.token_ids == runs.cold.token_ids
    skipped = _total(_lucia(warm.metrics), "lucia_kv_requests_read_skipped_total")
    assert skipped == 2.0, "each prompt-logprobs request counted once"


def test_block_files_are_0600_and_tier_directories_0700(runs: Runs) -> None:
    assert len(runs.block_files) == 2 * FULL_BLOCKS
    for path in runs.block_files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for tier in ("nvme", "hdd"):  # the owner lock names the vLLM worker that held the tier
        lock = runs.work / tier / NAMESPACE / ".lucia-kv-owner"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        assert re.fullmatch(r"pid \d+ on host \S+ in container [0-9a-f]{12}\n", lock.read_text())
    directories = [
        p for tier in ("nvme", "hdd") for p in (runs.work / tier).rglob("*") if p.is_dir()
    ]
    assert {p.name for p in directories} == {NAMESPACE}
    for path in directories:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def _plaintext_pieces(work: Path, count: int = 256) -> list[bytes]:
    """Pieces of the KV ExampleConnector wrote (32 bytes at 64-byte steps of the tensor data:
    half a head's row of bf16, contiguous in any layout), evenly spread, none of one byte only."""
    data = b""
    for path in sorted((work / "example").rglob("*.safetensors")):
        raw = path.read_bytes()
        header = int.from_bytes(raw[:8], "little")
        data += raw[8 + header :]
    pieces = [data[i : i + 32] for i in range(0, len(data) - 32, 64)]
    varied = [piece for piece in pieces if len(set(piece)) > 4]
    step = max(1, len(varied) // count)
    return varied[::step][:count]


def test_no_block_file_holds_the_plaintext_kv(runs: Runs) -> None:
    assert runs.example.token_ids == runs.cold.token_ids, "the same prompt, the same KV"
    pieces = _plaintext_pieces(runs.work)
    assert len(pieces) >= 200
    example_bytes = b"".join(p.read_bytes() for p in (runs.work / "example").rglob("*.safetensors"))
    assert all(piece in example_bytes for piece in pieces), "the control: found where it is"
    for path in runs.block_files:
        data = path.read_bytes()
        found = [piece for piece in pieces if piece in data]
        assert not found, f"{path} holds plaintext KV"


def test_vllms_metrics_has_the_stores_counters_from_the_start_on_every_tier(runs: Runs) -> None:
    served = _lucia(runs.cold.metrics)
    for name in ("hits", "misses", "read_bytes", "written_bytes", "writes", "evictions"):
        for tier in TIERS:
            assert (f"lucia_kv_{name}_total", (("tier", tier),)) in served, (name, tier)
    assert served[("lucia_kv_requests_unkeyable_total", ())] == 0.0, "untiered, at 0 too"
    assert served[("lucia_kv_requests_read_skipped_total", ())] == 0.0
    assert "# TYPE lucia_kv_corrupt_total counter" in runs.cold.metrics
    assert "# HELP lucia_kv_hits_total Block reads served by this tier." in runs.cold.metrics
    assert _total(served, "lucia_kv_hits_total") == 0.0, "a cold server read no block"


def test_vllms_metrics_counts_the_tier_reads_as_the_metrics_file_does(runs: Runs) -> None:
    counted = runs.repeated.counted
    assert counted is not None
    served = counted.served
    print(f"\nafter the repeat, /metrics: {_nonzero(served)}")
    assert _total(served, "lucia_kv_hits_total", tier="shm") == FULL_BLOCKS
    assert _total(served, "lucia_kv_read_bytes_total", tier="shm") > 0
    assert _total(served, "lucia_kv_hits_total", tier="nvme") == 0.0, "shm is asked first"
    assert _read_side(served) == _read_side(counted.filed)
    # the writers' counts (the blocks written, on every tier) are made after the step that
    # read: in /metrics once a later step (the short prompt) reported them
    assert _total(counted.served_next, "lucia_kv_writes_total", tier="hdd") == FULL_BLOCKS
    assert _nonzero(counted.served_next) == _nonzero(counted.filed_next)
    logged = _transfer_log(runs.repeated.logs)
    print(f"vLLM's log of the connector's stats: {logged}")
    assert logged["hits.shm"] == FULL_BLOCKS
