"""The block store over the tiers: write-through, promotion on read, a writer per tier.

Tiers are ordered fastest first (shm, nvme, hdd). A save is queued for every tier that lacks the
block and written by that tier's own writers (lucia_kv.slot), each copy sealed under its own
nonce. A load reads the fastest tier that holds the block; one that does not open (damaged,
truncated, oversized, of the wrong length, gone, or sealed under another key) is removed,
counted, and the next tier is tried; a block read from a slower tier is queued for copying
into the faster ones. Lookups consult the in-memory index only, never the disk.

A tier is an optimisation: a fault on one (an I/O error, a read-only remount, its directory
gone) switches it off for this engine and it is tried again later (lucia_kv.health); a disk
that something else filled makes the tier fit itself to what the disk holds. Nothing a tier
does reaches the engine as an error: the block is a miss, and vLLM recomputes it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from . import blockfile, owner
from .config import StoreConfig
from .metrics import Metrics
from .sealing import HEADER_BYTES, TAG_BYTES, BlockSealer, Corrupt, Sealer, StaleKey
from .slot import Budget, Count, Job, Opening, Slot, Ticket, Write
from .tier import Tier, Written

log = logging.getLogger("lucia_kv")
METRICS_EVERY = 5.0  # seconds between metrics-file writes while writers are busy
SEAL_BYTES = HEADER_BYTES + TAG_BYTES  # what sealing adds to a block's bytes


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
        opening = Opening(
            config.rebuild_max_entries, config.rebuild_max_seconds, config.retry_seconds, fault
        )
        slots: list[Slot] = []
        try:  # one store per directory: a second would keep its own index and cap
            for spec in config.tiers:
                slots.append(Slot(spec, opening, self.metrics, config.queue_blocks))
        except owner.Taken:
            for slot in slots:
                slot.stop()
            raise
        self._slots = tuple(slots)
        self._queued = Budget(config.queue_bytes)  # the blocks waiting for a writer, in bytes
        self._metrics_at = 0.0
        self._metrics_lock = threading.Lock()
        self._file_lock = threading.Lock()  # one file write at a time: the last has the latest
        self._busy = 0  # jobs a writer took and has not finished
        self._closed = False
        self._count_queued = threading.Event()
        for slot in self._slots:
            slot.start(config.writers, self._write, self._taken, self._job_done)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers that are on now, fastest first."""
        found = []
        for slot in self._slots:
            with slot.using() as tier:
                if tier is not None:
                    found.append(tier)
        return tuple(found)

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Every configured tier's place, on or off, fastest first."""
        return self._slots

    # --- the scheduler's side: index only -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (index only; no disk I/O)."""
        count = 0
        for key in keys:
            if not self._held(block_name(key), on_disk=False):
                break
            count += 1
        return count

    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have a block file in some tier (a stat each), for a process
        that reads the tiers but does not own their index."""
        count = 0
        for key in keys:
            if not self._held(block_name(key), on_disk=True):
                break
            count += 1
        return count

    def _held(self, name: str, *, on_disk: bool) -> bool:
        for slot in self._slots:
            with slot.using() as tier:
                if tier is None:
                    continue
                try:
                    if tier.contains(name) or (on_disk and tier.on_disk(name)):
                        return True
                except OSError as exc:
                    slot.fault(exc, "looking a block up")
        return False

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep these blocks from eviction (an active request) until unpinned as often."""
        self._each_on(keys, Tier.pin)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._each_on(keys, Tier.unpin)

    def _each_on(self, keys: Iterable[bytes], step: Callable[[Tier, str], None]) -> None:
        """`step` for each block on each tier that is on."""
        names = [block_name(key) for key in keys]
        for slot in self._slots:
            with slot.using() as tier:
                if tier is not None:
                    for name in names:
                        step(tier, name)

    # --- the worker's side ---------------------------------------------------------------------

    def load(self, key: bytes, size: int | None = None) -> bytes | None:
        """The block's bytes from the fastest tier whose copy opens, or None (a miss). With
        `size`, a copy of any other length is damaged: removed, and the next tier tried."""
        name = block_name(key)
        limit = None if size is None else blockfile.disk_size(size + SEAL_BYTES)
        for position, slot in enumerate(self._slots):
            with slot.using() as tier:
                data = None
                if tier is not None and tier.contains(name):
                    tier.pin(name)
                    try:
                        data = self._open(slot, tier, key, name, size, limit)
                    finally:
                        tier.unpin(name)
            if data is None:
                self.metrics.add("misses", slot.name)
                continue
            self.metrics.add("hits", slot.name)
            self._queue_write(self._slots[:position], name, key, data, promotion=True)
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
            self._slots[0].queue.put_nowait(Count())
        except queue.Full:
            self._count_queued.clear()  # the writers are busy and will write it anyway

    def _open(  # noqa: PLR0917
        self, slot: Slot, tier: Tier, key: bytes, name: str, size: int | None, limit: int | None
    ) -> bytes | None:
        """The block's bytes from one tier, or None, the copy removed and counted, when it does
        not open; a fault of the tier itself switches it off."""
        try:
            data = tier.read_with(name, lambda record: self._opened(tier, key, record), limit)
        except blockfile.Missing:
            reason = "missing"
        except blockfile.Short:
            reason = "short"
        except blockfile.Oversize:
            reason = "size"
        except Corrupt:
            reason = "auth"
        except StaleKey:
            reason = "stale_key"
        except OSError as exc:
            slot.warn("read", "reading a block failed: %s", exc.strerror)
            reason = "error"
        else:
            if size is None or len(data) == size:
                try:
                    tier.touch(name)
                except OSError as exc:  # the block is good, the disk is not
                    slot.fault(exc, "stamping a block read")
                return data
            slot.warn("size", "a block of %d bytes, %d expected: removed", len(data), size)
            reason = "size"
        try:
            tier.discard(name)
        except OSError as exc:
            slot.fault(exc, "removing a block that did not open")
        if reason == "stale_key":
            self.metrics.add("stale_key", slot.name)
        else:
            self.metrics.add("corrupt", slot.name, reason=reason)
        return None

    def _opened(self, tier: Tier, key: bytes, record: memoryview) -> bytes:
        """The block's bytes, decrypted straight from the read buffer (no copy of the record
        is made); raises what the sealer raises when the record does not open."""
        self.metrics.add("read_bytes", tier.name, blockfile.disk_size(len(record)))
        return self._sealer.open(key, record)

    def save(self, key: bytes, data: bytes) -> bool:
        """Queue a block for every tier that lacks it; False when it is not queued for one of
        them (a full queue, the queued bytes at their bound, or the tier off: counted as
        skipped)."""
        return self._queue_write(self._slots, block_name(key), key, bytes(data), promotion=False)

    def _queue_write(
        self, slots: Sequence[Slot], name: str, key: bytes, data: bytes, promotion: bool
    ) -> bool:
        """Queue a write for each of these tiers that lacks the block; its bytes are held in
        the queue's byte bound until the last of them has written it."""
        if self._closed:
            return False
        wanted, ok = [], True
        for slot in slots:
            with slot.using() as tier:
                if tier is None:
                    self.metrics.add("skipped_writes", slot.name, reason="off")
                    ok = False
                elif not tier.contains(name):
                    wanted.append(slot)
        if not wanted:
            return ok
        if not self._queued.take(len(data)):
            for slot in wanted:
                self.metrics.add("skipped_writes", slot.name, reason="queue_full")
            return False
        ticket = Ticket(self._queued, len(data), len(wanted))
        job = Write(key, data, promotion, ticket)
        for slot in wanted:
            try:
                slot.queue.put_nowait(job)
            except queue.Full:
                self.metrics.add("skipped_writes", slot.name, reason="queue_full")
                ticket.done()
                ok = False
        return ok

    def flush(self) -> None:
        """Wait until every queued write is done."""
        for slot in self._slots:
            slot.queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writers, release the tiers and their locks."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            slot.stop()
        self._write_metrics()

    # --- the writers ---------------------------------------------------------------------------

    def _taken(self, job: Job) -> None:
        with self._metrics_lock:
            self._busy += 1
        if isinstance(job, Count):
            self._count_queued.clear()

    def _job_done(self) -> None:
        """Rewrite the metrics file when this was the last job running with none queued (so
        the writers' last counts are in it), or when it is METRICS_EVERY old."""
        with self._metrics_lock:
            self._busy -= 1
            now = time.monotonic()
            idle = self._busy == 0 and all(slot.queue.empty() for slot in self._slots)
            if not idle and now - self._metrics_at < METRICS_EVERY:
                return
            self._metrics_at = now
        self._write_metrics()

    def _write(self, slot: Slot, tier: Tier, job: Write) -> None:
        """One block into one tier (a writer's job); OSError for a fault of the tier."""
        name = block_name(job.key)
        record = self._sealer.seal(job.key, job.data)

        def evicted(count: int) -> None:
            self.metrics.add("evictions", slot.name, count)

        for attempt in (1, 2):
            try:
                result = tier.write(name, record, on_evict=evicted)
            except blockfile.Unsynced as exc:
                slot.warn(
                    "dirsync",
                    "a block is written but the directory's fsync failed: %s (a crash may lose it)",
                    exc.strerror,
                )
                result = Written.WRITTEN
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                gone = tier.fit_disk(blockfile.disk_size(len(record)))
                if gone:
                    self.metrics.add("evictions", slot.name, gone)
                if attempt == 1 and gone:
                    continue  # room was made: the block is written once more
                self.metrics.add("skipped_writes", slot.name, reason="no_space")
                slot.warn(
                    "space",
                    "the disk is full though the tier's cap left room (something "
                    "else fills it): the tier now holds at most %d bytes",
                    tier.disk_cap or 0,
                )
                return
            break
        if result is Written.WRITTEN:
            self.metrics.add("writes", slot.name)
            self.metrics.add("written_bytes", slot.name, blockfile.disk_size(len(record)))
            if job.promotion:
                self.metrics.add("promotions", slot.name)
        elif result is Written.SKIPPED:
            self.metrics.add("skipped_writes", slot.name, reason="pinned")
        elif result is Written.TOO_BIG:
            self.metrics.add("skipped_writes", slot.name, reason="too_big")

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
