"""The block store over the tiers: write-through, promotion on read, background writers.

Tiers are ordered fastest first (shm, nvme, hdd). A save is queued and written by background
threads to every tier (the HDD pool and the NVMe hot copy, and shared memory where there is
one), each copy sealed under its own nonce. A load reads the fastest tier that holds the block;
one that does not open (damaged, truncated, gone, or sealed under another key) is removed,
counted, and the next tier is tried; a block read from a slower tier is queued for copying into
the faster ones. Lookups consult the in-memory index only, never the disk.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import blockfile, owner
from .config import StoreConfig
from .metrics import Metrics
from .sealing import BlockSealer, Corrupt, Sealer, StaleKey
from .tier import Tier, Written

log = logging.getLogger("lucia_kv")
METRICS_EVERY = 5.0  # seconds between metrics-file writes while writers are busy


@dataclass(frozen=True)
class _Write:
    key: bytes
    data: bytes
    tiers: tuple[Tier, ...]
    promotion: bool


@dataclass(frozen=True)
class _Remove:
    tier: Tier
    names: tuple[str, ...]


@dataclass(frozen=True)
class _Count:
    """Rewrite the metrics file (queued after reads, which write nothing else)."""


_Job = _Write | _Remove | _Count | None


def block_name(key: bytes) -> str:
    """The file name of a block: its 32-byte hash in hex."""
    if len(key) != 32:
        raise ValueError(f"a block key is 32 bytes, got {len(key)}")
    return key.hex()


class Store:
    """Blocks by key over byte-capped tiers; thread-safe."""

    def __init__(
        self,
        config: StoreConfig,
        sealer: BlockSealer | None = None,
        fault: blockfile.Fault | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        self._sealer = sealer or Sealer(
            config.key, config.namespace, config.plugin_version, config.rank
        )
        self.tiers = tuple(Tier(spec, fault) for spec in config.tiers)
        try:  # one store per directory: a second would keep its own index and cap
            self._owners = owner.claim_all(spec.directory for spec in config.tiers)
        except owner.OwnerError:
            for tier in self.tiers:
                tier.close()
            raise
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=max(1, config.queue_blocks))
        self._metrics_at = 0.0
        self._metrics_lock = threading.Lock()
        self._file_lock = threading.Lock()  # one file write at a time: the last has the latest
        self._busy = 0  # jobs a writer took and has not finished
        self._closed = False
        self._count_queued = threading.Event()
        leftovers = []
        for tier in self.tiers:
            rebuilt = tier.rebuild(config.rebuild_max_entries, config.rebuild_max_seconds)
            if rebuilt.evicted:
                self.metrics.add("evictions", tier.name, rebuilt.evicted)
            if rebuilt.leftovers:
                log.warning(
                    "tier %s: %d blocks past the index bound (%d entries, %.0f s) are removed",
                    tier.name,
                    len(rebuilt.leftovers),
                    config.rebuild_max_entries,
                    config.rebuild_max_seconds,
                )
                leftovers.append(_Remove(tier, rebuilt.leftovers))
            log.info("tier %s: %d blocks indexed", tier.name, rebuilt.indexed)
        self._threads = [
            threading.Thread(target=self._work, name=f"lucia-kv-writer-{n}", daemon=True)
            for n in range(config.writers)
        ]
        for thread in self._threads:
            thread.start()
        for job in leftovers:
            self._queue.put(job)

    # --- the scheduler's side: index only -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (index only; no disk I/O)."""
        count = 0
        for key in keys:
            name = block_name(key)
            if not any(tier.contains(name) for tier in self.tiers):
                break
            count += 1
        return count

    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have a block file in some tier (a stat each), for a process
        that reads the tiers but does not own their index."""
        count = 0
        for key in keys:
            name = block_name(key)
            if not any(tier.contains(name) or tier.on_disk(name) for tier in self.tiers):
                break
            count += 1
        return count

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep these blocks from eviction (an active request) until unpinned as often."""
        for key in keys:
            for tier in self.tiers:
                tier.pin(block_name(key))

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            for tier in self.tiers:
                tier.unpin(block_name(key))

    # --- the worker's side ---------------------------------------------------------------------

    def load(self, key: bytes) -> bytes | None:
        """The block's bytes from the fastest tier whose copy opens, or None (a miss)."""
        name = block_name(key)
        for position, tier in enumerate(self.tiers):
            if not tier.contains(name):
                self.metrics.add("misses", tier.name)
                continue
            tier.pin(name)
            try:
                data = self._open(tier, key, name)
            finally:
                tier.unpin(name)
            if data is None:
                self.metrics.add("misses", tier.name)
                continue
            self.metrics.add("hits", tier.name)
            faster = tuple(t for t in self.tiers[:position] if not t.contains(name))
            if faster:
                self._enqueue(_Write(key, data, faster, promotion=True))
            self._count_later()
            return data
        self._count_later()
        return None

    def count(self, name: str, amount: int = 1) -> None:
        """Count an engine-wide event (lucia_kv.metrics' UNTIERED: a request the tiers
        skipped), reported and in the metrics file like the store's own counts."""
        self.metrics.add(name, None, amount)
        self._count_later()

    def _count_later(self) -> None:
        """Have a writer rewrite the metrics file; never on the caller's thread."""
        if self.config.metrics_file is None or self._closed or self._count_queued.is_set():
            return
        self._count_queued.set()
        try:
            self._queue.put_nowait(_Count())
        except queue.Full:
            self._count_queued.clear()  # the writers are busy and will write it anyway

    def _open(self, tier: Tier, key: bytes, name: str) -> bytes | None:
        try:
            return tier.read_with(name, lambda record: self._opened(tier, key, record))
        except blockfile.Missing:
            reason = "missing"
        except blockfile.Short:
            reason = "short"
        except Corrupt:
            reason = "auth"
        except StaleKey:
            tier.discard(name)
            self.metrics.add("stale_key", tier.name)
            return None
        except OSError as exc:
            log.warning("tier %s: reading a block failed: %s", tier.name, exc.strerror)
            reason = "error"
        tier.discard(name)
        self.metrics.add("corrupt", tier.name, reason=reason)
        return None

    def _opened(self, tier: Tier, key: bytes, record: memoryview) -> bytes:
        """The block's bytes, decrypted straight from the read buffer (no copy of the record
        is made); raises what the sealer raises when the record does not open."""
        self.metrics.add("read_bytes", tier.name, blockfile.disk_size(len(record)))
        return self._sealer.open(key, record)

    def save(self, key: bytes, data: bytes) -> bool:
        """Queue a block for every tier that lacks it; False when the queue is full (the
        block is not cached, counted as skipped)."""
        missing = tuple(tier for tier in self.tiers if not tier.contains(block_name(key)))
        if not missing:
            return True
        return self._enqueue(_Write(key, bytes(data), missing, promotion=False))

    def _enqueue(self, job: _Write) -> bool:
        if self._closed:
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            for tier in job.tiers:
                self.metrics.add("skipped_writes", tier.name, reason="queue_full")
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writers, release the tiers and their locks."""
        if self._closed:
            return
        self._closed = True
        self._queue.join()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._write_metrics()
        for tier in self.tiers:
            tier.close()
        for owned in self._owners:
            owned.release()

    # --- the writers ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            with self._metrics_lock:
                self._busy += 1
            try:
                if job is None:
                    return
                if isinstance(job, _Count):
                    self._count_queued.clear()
                elif isinstance(job, _Remove):
                    for name in job.names:
                        job.tier.discard(name)
                else:
                    self._write(job)
            except Exception:
                log.exception("a KV-cache writer job failed")
            finally:
                self._job_done()
                self._queue.task_done()

    def _job_done(self) -> None:
        """Rewrite the metrics file when this was the last job running with none queued (so
        the writers' last counts are in it), or when it is METRICS_EVERY old."""
        with self._metrics_lock:
            self._busy -= 1
            now = time.monotonic()
            idle = self._busy == 0 and self._queue.empty()
            if not idle and now - self._metrics_at < METRICS_EVERY:
                return
            self._metrics_at = now
        self._write_metrics()

    def _write(self, job: _Write) -> None:
        name = block_name(job.key)
        for tier in job.tiers:
            record = self._sealer.seal(job.key, job.data)

            def evicted(count: int, tier: Tier = tier) -> None:
                self.metrics.add("evictions", tier.name, count)

            try:
                result = tier.write(name, record, on_evict=evicted)
            except blockfile.Unsynced as exc:
                log.warning(
                    "tier %s: a block is written but the directory's fsync failed: %s "
                    "(a crash may lose it)",
                    tier.name,
                    exc.strerror,
                )
                result = Written.WRITTEN
            except OSError as exc:
                log.warning("tier %s: writing a block failed: %s", tier.name, exc.strerror)
                self.metrics.add("skipped_writes", tier.name, reason="error")
                continue
            if result is Written.WRITTEN:
                self.metrics.add("writes", tier.name)
                self.metrics.add("written_bytes", tier.name, blockfile.disk_size(len(record)))
                if job.promotion:
                    self.metrics.add("promotions", tier.name)
            elif result is Written.SKIPPED:
                self.metrics.add("skipped_writes", tier.name, reason="pinned")
            elif result is Written.TOO_BIG:
                self.metrics.add("skipped_writes", tier.name, reason="too_big")

    def _write_metrics(self) -> None:
        path = self.config.metrics_file
        if path is None:
            return
        try:
            with self._file_lock:
                self.metrics.write(path)
        except OSError as exc:
            log.warning("the KV-cache metrics file %s: %s", path, exc.strerror)


def probe(config: StoreConfig, keys: Sequence[bytes]) -> int:
    """How many leading keys have a block file in some tier: a stat each, no index and no
    reads, for the scheduler's process, which reads the tiers but owns none of them."""
    count = 0
    for key in keys:
        name = block_name(key)
        if not any(os.path.exists(tier.directory / name) for tier in config.tiers):
            break
        count += 1
    return count
