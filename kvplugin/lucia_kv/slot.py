"""One tier's place in the store: the tier while it opens, its health, and its own writers.

Each tier has its own queue, bounded on its own, and its own writer threads: the HDD's fsyncs
never hold the shared-memory or NVMe writes, and a full queue drops a block for that tier only.
A fault switches the tier off (lucia_kv.health): reads and saves skip it, the writers drop
what is queued for it, and one of them opens it again after the back-off. Opening it again
replaces the Tier whole (its directory, its owner lock, its index rebuilt from the disk); the
replacement waits until no reader is inside the old one, so no thread ever uses a descriptor
that was closed under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import blockfile, health, owner
from .config import TierSpec
from .health import Health, Said
from .metrics import Metrics
from .tier import Tier, TierError

log = logging.getLogger("lucia_kv")


class Budget:
    """The bytes of the blocks queued for writing, at most `limit` (each block counted once,
    however many tiers' queues hold it); thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Hold `size` more bytes, or False when that would pass the limit (a block larger
        than the whole limit is held only while nothing else is)."""
        with self._lock:
            if self.used and self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.used -= size


class Ticket:
    """One block's bytes held in a Budget until every tier's writer is done with it."""

    __slots__ = ("_budget", "_left", "_lock", "_size")

    def __init__(self, budget: Budget, size: int, holders: int) -> None:
        self._budget, self._size, self._left = budget, size, holders
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._budget.give(self._size)


@dataclass(frozen=True)
class Write:
    key: bytes
    data: bytes
    promotion: bool
    ticket: Ticket | None = None


@dataclass(frozen=True)
class Remove:
    names: tuple[str, ...]


@dataclass(frozen=True)
class Count:
    """Rewrite the metrics file (queued after reads, which write nothing else)."""


@dataclass(frozen=True)
class Finish:
    """Index the rest of a rebuild that ran out of time."""


@dataclass(frozen=True)
class Wake:
    """Nothing to do: a writer waiting for work is woken to wait for the retry instead."""


Job = Write | Remove | Count | Finish | Wake | None
Work = Callable[["Slot", Tier, Write], None]  # the store's write of one block into one tier


@dataclass(frozen=True)
class Opening:
    """How a tier is opened: its rebuild's bounds, and the first back-off after a fault."""

    max_entries: int
    max_seconds: float
    retry_seconds: float
    fault: blockfile.Fault | None = None


class Slot:
    """A tier, on or off, with its queue and writers; thread-safe."""

    def __init__(self, spec: TierSpec, opening: Opening, metrics: Metrics, bound: int) -> None:
        """Open the tier (a tier that does not open starts off, and says so); raises
        owner.Taken when another store holds its directory."""
        self.spec = spec
        self.name = spec.name
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max(1, bound))
        self._opening = opening
        self._metrics = metrics
        self._gate = threading.Condition()
        self._readers = 0
        self._tier: Tier | None = None
        self._owner: owner.Owner | None = None
        self._health = Health()
        self._said: dict[str, Said] = {}
        self._retrying = threading.Lock()
        self._threads: list[threading.Thread] = []
        try:
            self._tier, self._owner = self._open(opening.max_seconds)
        except owner.Taken:
            raise
        except (OSError, TierError, owner.OwnerError) as exc:
            self.fault(exc, "opening it")

    # --- the readers' side ---------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self) -> Iterator[Tier | None]:
        """The tier while it is on (None while off); it is not replaced while in use."""
        with self._gate:
            tier = self._tier if self._health.on else None
            if tier is not None:
                self._readers += 1
        try:
            yield tier
        finally:
            if tier is not None:
                with self._gate:
                    self._readers -= 1
                    if not self._readers:
                        self._gate.notify_all()

    @property
    def on(self) -> bool:
        with self._gate:
            return self._health.on and self._tier is not None

    @property
    def health(self) -> Health:
        with self._gate:
            return self._health

    def fault(self, error: BaseException, doing: str) -> None:
        """Switch the tier off after a fault (said once; a fault while off changes nothing)."""
        label = health.reason(error)
        now = time.monotonic()
        with self._gate:
            if not self._health.on:
                return
            self._health = health.failed(self._health, label, now, self._opening.retry_seconds)
            retry = self._health.backoff
        for _ in self._threads:  # a writer blocked on the queue would never retry
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(Wake())
        self._metrics.add("tier_off", self.name, reason=label)
        log.warning(
            "tier %s off: %s (%s: %s); the engine serves on without it, and it is tried again "
            "in %.0f s",
            self.name,
            health.words(label),
            doing,
            getattr(error, "strerror", None) or error,
            retry,
        )

    def warn(self, kind: str, message: str, *args: object) -> None:
        """A warning of one kind about this tier, said at most once per health.WARN_EVERY."""
        with self._gate:
            said, held = health.warn(self._said.get(kind, Said()), time.monotonic())
            self._said[kind] = said
        if held is not None:
            suffix = f" ({held} more since the last such warning)" if held else ""
            log.warning("tier %s: " + message + suffix, self.name, *args)

    # --- the writers ---------------------------------------------------------------------------

    def start(
        self, writers: int, work: Work, taken: Callable[[Job], None], done: Callable[[], None]
    ) -> None:
        """Start the writers: `taken` is told of each job as a writer takes it, `done` once
        it is done."""
        for number in range(writers):
            thread = threading.Thread(
                target=self._run,
                args=(work, taken, done),
                name=f"lucia-kv-{self.name}-{number}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """Stop the writers once what is queued is done; close the tier, release its lock."""
        self.queue.join()
        for _ in self._threads:
            self.queue.put(None)
        for thread in self._threads:
            thread.join()
        with self._gate:
            self._gate.wait_for(lambda: not self._readers)
            self._close_locked()

    def _run(self, work: Work, taken: Callable[[Job], None], done: Callable[[], None]) -> None:
        while True:
            wait = self._until_retry()
            try:
                job = self.queue.get(timeout=wait)
            except queue.Empty:
                self._retry()
                continue
            if job is None:
                self.queue.task_done()
                return
            taken(job)
            try:
                self._do(job, work)
            except Exception:
                log.exception("a KV-cache writer job for tier %s failed", self.name)
            finally:
                if isinstance(job, Write) and job.ticket is not None:
                    job.ticket.done()
                done()
                self.queue.task_done()

    def _do(self, job: Job, work: Work) -> None:
        if isinstance(job, Count | Wake):
            return
        with self.using() as tier:
            if tier is None:  # off: the tier is rebuilt from its disk when it opens again
                if isinstance(job, Write):
                    self._metrics.add("skipped_writes", self.name, reason="off")
                return
            try:
                if isinstance(job, Write):
                    work(self, tier, job)
                elif isinstance(job, Remove):
                    for name in job.names:
                        tier.discard(name)
                elif isinstance(job, Finish):
                    rebuilt = tier.finish_rebuild()
                    if rebuilt.evicted:
                        self._metrics.add("evictions", self.name, rebuilt.evicted)
                    log.info("tier %s: %d more blocks indexed", self.name, rebuilt.indexed)
            except OSError as exc:
                self.fault(exc, "writing" if isinstance(job, Write) else "removing blocks")

    def _until_retry(self) -> float | None:
        with self._gate:
            if self._health.on:
                return None
            return max(0.0, self._health.retry_at - time.monotonic())

    def _retry(self) -> None:
        """Open an off tier again, when due (one writer at a time)."""
        with self._retrying:  # the other writers wait here, and find it done
            if not self.health.due(time.monotonic()):
                return
            with self._gate:  # the old tier goes first: its lock is this process's own
                self._gate.wait_for(lambda: not self._readers)
                self._close_locked()
            try:
                tier, owned = self._open(float("inf"))
            except (OSError, TierError, owner.OwnerError) as exc:
                label = health.reason(exc)
                with self._gate:
                    self._health = health.failed(
                        self._health, label, time.monotonic(), self._opening.retry_seconds
                    )
                log.debug("tier %s: still off: %s", self.name, exc)
                return
            with self._gate:
                self._tier, self._owner = tier, owned
                self._health = health.recovered()
            self._metrics.add("tier_on", self.name)
            log.warning("tier %s on again: %d blocks indexed", self.name, len(tier.index()))

    # --- opening and closing -------------------------------------------------------------------

    def _open(self, max_seconds: float) -> tuple[Tier, owner.Owner]:
        """The tier opened, owned, proven writable and indexed (the rest of the index is queued
        when time runs out); raises what stops any of it."""
        tier = Tier(self.spec, self._opening.fault)
        try:
            owned = owner.claim(self.spec.directory)
        except BaseException:
            tier.close()
            raise
        try:
            _prove_writable(self.spec.directory)
            rebuilt = tier.rebuild(self._opening.max_entries, max_seconds)
        except BaseException:
            tier.close()
            owned.release()
            raise
        if rebuilt.evicted:
            self._metrics.add("evictions", self.name, rebuilt.evicted)
        rest = ", the rest is indexed while the engine serves" if rebuilt.pending else ""
        log.info("tier %s: %d blocks indexed%s", self.name, rebuilt.indexed, rest)
        if rebuilt.pending:
            self.queue.put(Finish())
        return tier, owned

    def _close_locked(self) -> None:
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        if self._owner is not None:
            self._owner.release()
            self._owner = None


def _prove_writable(directory: os.PathLike[str]) -> None:
    """Write, sync and remove a small temp file in the directory (a leftover of a crash here is
    a temp file the next rebuild removes); raises OSError when the disk refuses."""
    path = os.path.join(directory, f"{blockfile.TEMP_PREFIX}probe-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"\0")
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
