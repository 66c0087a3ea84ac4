"""KV tiers' time-to-first-token benchmark: `.venv/bin/python bench/kv_ttft_bench.py [--rounds N]`.

Time to first token of a 2,000-token prompt (token ids, temperature 0, streamed) on the real vLLM
0.32.0 CPU server with the lucia_kv tier connector, vLLM's own prefix caching off so that only
the tiers can answer; and the same prompt on the plain server (no connector) in the same run.
Two servers, started once each; the rows' rounds run interleaved, so drift hits each alike:

- cold: a fresh prompt each round, so no tier holds a block of it (the connector looks up,
  misses, computes and queues the blocks for its writers);
- warm from NVMe: the prompt whose blocks are on the NVMe tier (and the HDD pool);
- warm from HDD: the same prompt after its NVMe copies were deleted, so the HDD pool serves it
  (the read then copies the blocks back to NVMe: the bench waits for that before going on);
- baseline: the same prompt on the plain server.

The shared-memory tier is off, so the NVMe tier is the fastest one. "NVMe" is a directory on
the root disk. "HDD" is ext4 on a loop device made for the run (direct I/O to a file on the
root disk), with the server container's I/O to it capped by the blkio cgroup (docker's
--device-read-iops and friends): this kernel has no device-mapper, so no dm-delay. The default
cap, 150 IOPS, is a 7200 rpm disk's random reads; blkio lets a 100 ms slice's share pass at once
and holds the rest, and a 68 KiB block file costs more than one IO (about 2.5 with the open,
by the 75-IOPS figures). What the device alone costs is measured too: an O_DIRECT read of the
warm prompt's block files from inside the container, on each tier. With --hdd-same-disk, HDD
is a directory on the root disk as well.

Each row gives the median and spread of --rounds, the prompt tokens vLLM counted from
external_kv_transfer (its /metrics) and the store's hits per tier, per round, so each row shows
what served it. Asserts nothing about timings. Needs root (the loop device) and the vLLM CPU
image (scripts/machine.sh builds it).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import docker.errors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kv_servers import (  # noqa: E402
    RUN_ID,
    BenchError,
    Completion,
    KvLab,
    Server,
    blkio_setting,
    by_source,
    prompt_tokens,
    raw_read_ms,
    tier_counters,
)
from bench.standalone import filesystem, machine, table  # noqa: E402
from supervisor.engines.vllm import tier_image  # noqa: E402
from tests.vllm_cpu import DEFAULT_IMAGE, MODEL_SEED  # noqa: E402
from tests.vllm_model import write_tiny_llama  # noqa: E402

BLOCK_TOKENS = 128  # the CPU backend's KV block
PROMPT_TOKENS = 2000
FULL_BLOCKS = PROMPT_TOKENS // BLOCK_TOKENS  # 15 blocks, 1,920 tokens the tiers can hold
VOCAB = 512  # tests/vllm_model.py's; ids 0-2 are its special tokens
NAMESPACE = "ttft-bench"
WAIT = 120.0  # the longest wait for the writers or a counter; a limit, never a measurement
SETTLE = 10.0  # how long a round waits for the store's metrics file to change
ROWS = ("cold", "warm from NVMe", "warm from HDD", "baseline: no connector")


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]


def wait_for(condition: Callable[[], bool], what: str) -> None:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > WAIT:
            raise BenchError(f"gave up waiting for {what} after {WAIT:.0f} s")
        time.sleep(0.05)


def written_all(tiers: Tiers, listed: tuple[set[str], set[str]], what: str) -> None:
    """Wait until a prompt's blocks are on both tiers: FULL_BLOCKS more than `listed` each."""
    for directory, earlier in zip((tiers.nvme, tiers.hdd), listed, strict=True):

        def grown(directory: Path = directory, earlier: set[str] = earlier) -> bool:
            return len(block_names(directory) - earlier) >= FULL_BLOCKS

        wait_for(grown, f"{what} on {directory.parent.name}")


def block_names(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {entry.name for entry in os.scandir(directory) if not entry.name.startswith(".")}


@dataclass
class Row:
    name: str
    served_by: str
    seconds: list[float] = field(default_factory=list)
    external: list[float] = field(default_factory=list)  # prompt tokens per round
    hits: list[dict[str, float]] = field(default_factory=list)  # tier -> store hits per round
    texts: set[str] = field(default_factory=set)


@dataclass
class Tiers:
    """The tier server's directories, as the bench sees them, and its metrics file."""

    nvme: Path
    hdd: Path
    metrics: Path

    def counters(self) -> dict[tuple[str, str], float]:
        try:
            return tier_counters(self.metrics.read_text())
        except FileNotFoundError:
            return {}


def measured(server: Server, tokens: list[int], max_tokens: int) -> tuple[Completion, float]:
    """The completion and its prompt tokens from external_kv_transfer, once vLLM counted the
    request's prompt (vllm:prompt_tokens_total rose by its length)."""
    text = server.metrics()
    before, total = by_source(text), prompt_tokens(text)
    done = server.complete(tokens, max_tokens)
    after: dict[str, float] = {}

    def counted() -> bool:
        nonlocal after
        text = server.metrics()
        after = by_source(text)
        return prompt_tokens(text) - total >= len(tokens)

    wait_for(counted, "vLLM to count the prompt's tokens")
    external = after.get("external_kv_transfer", 0.0) - before.get("external_kv_transfer", 0.0)
    return done, external


def settled_hits(tiers: Tiers, before: dict[tuple[str, str], float]) -> dict[str, float]:
    """Store hits per tier since `before`, once the metrics file changed (the writers rewrite
    it when their queue empties; SETTLE at most) and then held still for half a second."""
    seen: list[dict[tuple[str, str], float]] = []
    began = time.monotonic()

    def still() -> bool:
        seen.append(tiers.counters())
        recent = seen[-10:]
        changed = recent[0] != before or time.monotonic() - began > SETTLE
        return len(recent) == 10 and changed and all(c == recent[0] for c in recent)

    wait_for(still, "the store's metrics file to settle")
    now = seen[-1]
    return {
        tier: now.get(("hits", tier), 0.0) - before.get(("hits", tier), 0.0)
        for tier in ("nvme", "hdd")
    }


def run_rounds(
    tier: Server, plain: Server, tiers: Tiers, rounds: int, max_tokens: int
) -> tuple[list[Row], str, dict[str, float]]:
    rows = {
        name: Row(name, served)
        for name, served in zip(
            ROWS,
            (
                "a fresh prompt each round: no block of it in any tier",
                "its 15 blocks on the NVMe tier",
                "its 15 blocks on HDD only (NVMe copies deleted)",
                "the plain server, prefix caching off",
            ),
            strict=True,
        )
    }
    warm = prompt(22)
    for server in (tier, plain):  # first requests pay one-time costs; not counted
        server.complete(prompt(999), max_tokens)
    written_all(tiers, (set(), set()), "the first prompt's blocks")
    earlier = (block_names(tiers.nvme), block_names(tiers.hdd))
    before = tiers.counters()
    reference, _ = measured(tier, warm, max_tokens)  # the warm prompt's own cold run
    written_all(tiers, earlier, "the warm prompt's blocks")
    settled_hits(tiers, before)
    warm_names = block_names(tiers.nvme) - earlier[0]
    for number in range(rounds):
        fresh = prompt(1000 + number)
        listed = (block_names(tiers.nvme), block_names(tiers.hdd))
        before = tiers.counters()
        done, external = measured(tier, fresh, max_tokens)
        written_all(tiers, listed, "the cold prompt's blocks")
        add(rows["cold"], done, external, settled_hits(tiers, before))

        before = tiers.counters()
        done, external = measured(tier, warm, max_tokens)
        add(rows["warm from NVMe"], done, external, settled_hits(tiers, before))

        for name in warm_names:
            (tiers.nvme / name).unlink(missing_ok=True)
        before = tiers.counters()
        done, external = measured(tier, warm, max_tokens)
        wait_for(lambda: warm_names <= block_names(tiers.nvme), "the HDD read's copy on NVMe")
        add(rows["warm from HDD"], done, external, settled_hits(tiers, before))

        done, external = measured(plain, warm, max_tokens)
        add(rows["baseline: no connector"], done, external, {})
    names = sorted(warm_names)
    raw = {
        tier_dir: raw_read_ms(tier.container, f"/kv/{tier_dir}/{NAMESPACE}", names)
        for tier_dir in ("nvme", "hdd")
    }
    return list(rows.values()), reference.text, raw


def add(row: Row, done: Completion, external: float, hits: dict[str, float]) -> None:
    row.seconds.append(done.first_token)
    row.external.append(external)
    row.hits.append(hits)
    row.texts.add(done.text)


def per_round(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    cold = statistics.median(rows[0].seconds)
    lines: list[tuple[str, ...]] = []
    for row in rows:
        median = statistics.median(row.seconds)
        hits = (
            ", ".join(f"{t} {per_round([h[t] for h in row.hits])}" for t in ("nvme", "hdd"))
            if row.hits and row.hits[0]
            else "-"
        )
        lines.append(
            (
                row.name,
                f"{median * 1000:.1f} ms",
                f"{min(row.seconds) * 1000:.1f}-{max(row.seconds) * 1000:.1f} ms",
                f"{statistics.pstdev(row.seconds) * 1000:.1f} ms",
                per_round(row.external),
                hits,
                f"{median / cold:.2f}x",
            )
        )
    return lines


def tier_server_args(hdd_bytes: int, nvme_bytes: int) -> list[str]:
    transfer = tier_image.transfer_config(
        {
            "namespace": NAMESPACE,
            "key_file": "/kv/key",
            "nvme_dir": f"/kv/nvme/{NAMESPACE}",
            "nvme_bytes": nvme_bytes,
            "hdd_dir": f"/kv/hdd/{NAMESPACE}",
            "hdd_bytes": hdd_bytes,
            "metrics_file": "/kv/metrics/lucia-kv.prom",
        }
    )
    return ["--kv-transfer-config", transfer]


def run(args: argparse.Namespace, lab: KvLab) -> None:
    base = os.environ.get("LUCIA_VLLM_CPU_IMAGE", DEFAULT_IMAGE)
    began = time.monotonic()
    model = write_tiny_llama(lab.tmp / "model", seed=MODEL_SEED)
    work = lab.tmp / "kv"
    for name in ("nvme", "metrics"):
        (work / name).mkdir(mode=0o700, parents=True)
    key = work / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    options: dict[str, object] = {}
    if args.hdd_same_disk:
        (work / "hdd").mkdir(mode=0o700)
        hdd_how = f"a directory on the root disk ({filesystem(work)}), the same disk as NVMe"
    else:
        disk = lab.slow_disk("kv/hdd", args.hdd_iops, args.hdd_mbps)
        options = dict(disk.throttle())
        hdd_how = disk.describe()
    image = lab.tier_image(base)
    print(
        f"tier image {image.ref}: "
        + (f"built for this run in {image.seconds:.1f} s" if image.built else "current, reused")
    )
    common = ["--max-model-len", "2048", "--no-enable-prefix-caching"]
    volumes = {
        str(work / "nvme"): {"bind": "/kv/nvme", "mode": "rw"},
        str(work / "hdd"): {"bind": "/kv/hdd", "mode": "rw"},
        str(work / "metrics"): {"bind": "/kv/metrics", "mode": "rw"},
        str(key): {"bind": "/kv/key", "mode": "ro"},
    }
    tier = lab.start(
        "tiers",
        image.ref,
        model,
        [*common, *tier_server_args(512 << 20, 256 << 20)],
        volumes,
        **options,
    )
    print(f"tier server: /health in {tier.seconds_to_health:.0f} s")
    if options:
        print(f"  its blkio read_iops_device: {blkio_setting(tier.container, 'read_iops_device')}")
    plain = lab.start("plain", base, model, common)
    print(f"plain server: /health in {plain.seconds_to_health:.0f} s")
    tiers = Tiers(
        work / "nvme" / NAMESPACE, work / "hdd" / NAMESPACE, work / "metrics" / "lucia-kv.prom"
    )
    measuring = time.monotonic()
    rows, reference, raw = run_rounds(tier, plain, tiers, args.rounds, args.max_tokens)
    seconds = time.monotonic() - measuring
    print(
        f"\n{PROMPT_TOKENS}-token prompt ({FULL_BLOCKS} full blocks of {BLOCK_TOKENS} = "
        f"{FULL_BLOCKS * BLOCK_TOKENS} tokens the tiers can hold), {args.max_tokens} tokens "
        f"asked, temperature 0, {args.rounds} rounds interleaved ({seconds:.0f} s)\n"
        f"NVMe: a directory on the root disk ({filesystem(work)}); HDD: {hdd_how}\n"
    )
    table(
        table_rows(rows),
        (
            "row",
            "median TTFT",
            "min-max",
            "stdev",
            "external_kv_transfer tokens/round",
            "store hits/round",
            "vs cold",
        ),
    )
    for row in rows:
        print(f"- {row.name}: {row.served_by}")
    print(
        f"the devices alone: an O_DIRECT read of the warm prompt's {FULL_BLOCKS} block files "
        f"from inside the tier server's container, median of 5: NVMe directory "
        f"{raw['nvme']:.1f} ms, HDD {raw['hdd']:.1f} ms"
    )
    same = all(row.texts == {reference} for row in rows[1:])
    print(
        f"answers of the warm prompt (NVMe, HDD, baseline) equal its cold run's: "
        f"{'yes' if same else 'NO: ' + repr([sorted(r.texts) for r in rows[1:]])}"
    )
    print(f"whole run {time.monotonic() - began:.0f} s, load at end {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens asked per completion")
    parser.add_argument(
        "--hdd-iops", type=int, default=150, help="the HDD stand-in's IOPS cap (see the docstring)"
    )
    parser.add_argument("--hdd-mbps", type=int, default=150, help="its MB/s cap")
    parser.add_argument(
        "--hdd-same-disk", action="store_true", help="no slow device: HDD on the root disk too"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"{machine()}, load {os.getloadavg()[0]:.2f}, run {RUN_ID}")
    lab = KvLab()
    status = 0
    try:
        run(args, lab)
    except BenchError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        status = 1
    except (docker.errors.DockerException, OSError) as exc:  # requests' errors are OSErrors
        print(f"ERROR: dockerd or a server stopped answering: {exc!r}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        status = 130
    finally:
        for line in lab.cleanup():
            print(f"left behind: {line}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
