"""The watch on desired.json: what the kernel's events mean (a table), the real inotify queue
under the loop's wait (a rename, a write in place, the worker's own writes, a directory removed
and made again or replaced, its parent too, an overflow of the queue), and a worker that can
only be woken by its watch acknowledging through each of them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from inotify_simple import flags

from supervisor.engines.base import Observed
from supervisor.worker import loop
from supervisor.worker.wakeup import Wakeup
from supervisor.worker.watch import DesiredWatch, Event, Verdict, judge
from tests.unit.test_worker_failures import (
    SPEC,
    FakeEngine,
    FakeRuntime,
    _container,
    _drive,
    _request,
    _until,
    _worker,
)

D, P = 1, 2  # the directory's watch and its parent's
CHANGED = Verdict(changed=True)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], Verdict()),
        ([Event(D, flags.MOVED_TO, "desired.json")], CHANGED),
        ([Event(D, flags.CLOSE_WRITE, "desired.json")], CHANGED),
        ([Event(D, flags.DELETE, "desired.json")], CHANGED),
        ([Event(D, flags.MOVED_FROM, "desired.json")], CHANGED),
        # an editor's new file is empty until it is written and closed
        ([Event(D, flags.CREATE, "desired.json")], Verdict()),
        ([Event(D, flags.MODIFY, "desired.json")], Verdict()),
        # the worker's own writes, and other names
        (
            [
                Event(D, flags.CLOSE_WRITE, "status.json.tmp"),
                Event(D, flags.MOVED_TO, "status.json"),
            ],
            Verdict(),
        ),
        ([Event(D, flags.MOVED_TO, "desired.json.tmp")], Verdict()),
        # the queue overflowed (wd -1): a full look
        ([Event(-1, flags.Q_OVERFLOW)], Verdict(full_look=True)),
        (
            [Event(D, flags.MOVED_TO, "desired.json"), Event(-1, flags.Q_OVERFLOW)],
            Verdict(changed=True, full_look=True),
        ),
        # the directory removed, or renamed away
        ([Event(D, flags.DELETE_SELF), Event(D, flags.IGNORED)], Verdict(lost=True)),
        ([Event(D, flags.MOVE_SELF)], Verdict(lost=True)),
        ([Event(D, flags.IGNORED)], Verdict(lost=True)),
        # its name back in the parent, made or renamed in
        ([Event(P, flags.CREATE | flags.ISDIR, "x")], Verdict(returned=True)),
        ([Event(P, flags.MOVED_TO | flags.ISDIR, "x")], Verdict(returned=True)),
        ([Event(P, flags.CREATE | flags.ISDIR, "y")], Verdict()),
        ([Event(P, flags.DELETE_SELF), Event(P, flags.IGNORED)], Verdict(parent_lost=True)),
        # a watch this one no longer holds (an old one's last IGNORED)
        ([Event(7, flags.IGNORED), Event(7, flags.MOVED_TO, "desired.json")], Verdict()),
    ],
)
def test_what_the_events_mean(events: list[Event], expected: Verdict) -> None:
    assert judge(events, D, P, "x") == expected


def test_with_no_watch_held_only_an_overflow_counts() -> None:
    events = [Event(D, flags.MOVED_TO, "desired.json"), Event(P, flags.CREATE, "x")]
    assert judge(events, None, None, "x") == Verdict()
    assert judge([*events, Event(-1, flags.Q_OVERFLOW)], None, None, "x").full_look


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    path = tmp_path / "engines" / "x"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def wake(directory: Path) -> Iterator[Wakeup]:
    wake = Wakeup()
    wake.attach(DesiredWatch(directory))
    yield wake
    wake.close()


def _write(path: Path, text: str = "{}") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_request_renamed_in_wakes_the_wait(directory: Path, wake: Wakeup) -> None:
    _write(directory / "desired.json")
    assert wake.wait(30)
    assert not wake.full_look_due()


def test_a_request_written_in_place_wakes_the_wait(directory: Path, wake: Wakeup) -> None:
    (directory / "desired.json").write_text("{}")
    assert wake.wait(30)


def test_the_workers_own_writes_do_not_wake_it(directory: Path, wake: Wakeup) -> None:
    for _ in range(3):
        _write(directory / "status.json")
    assert not wake.wait(0.2)  # read and waited past
    _write(directory / "desired.json")
    assert wake.wait(30)  # and the watch still answers


def test_a_directory_removed_and_made_again_is_watched_again(directory: Path, wake: Wakeup) -> None:
    shutil.rmtree(directory)
    assert wake.wait(30)
    assert wake.full_look_due()  # what happened while it was gone was not seen
    made = threading.Timer(0.1, directory.mkdir)  # made while the wait waits
    made.start()
    assert wake.wait(30)  # its name is back in the parent, and the directory is watched
    made.join()
    assert wake.full_look_due()
    _write(directory / "desired.json")
    assert wake.wait(30)
    assert not wake.full_look_due()


def test_a_directory_replaced_by_a_rename_is_watched_at_its_path(
    directory: Path, wake: Wakeup
) -> None:
    new = directory.with_name("x.new")
    new.mkdir()
    _write(new / "desired.json")
    directory.rename(directory.with_name("x.old"))
    new.rename(directory)
    while wake.wait(1):  # the move away, and the new directory's arrival
        pass
    assert wake.full_look_due()
    _write(directory.with_name("x.old") / "desired.json")  # the old one is not watched
    assert not wake.wait(0.2)
    _write(directory / "desired.json")
    assert wake.wait(30)


def test_a_parent_removed_and_made_again_leads_back_to_the_directory(
    directory: Path, wake: Wakeup
) -> None:
    shutil.rmtree(directory.parent)
    assert wake.wait(30)
    directory.mkdir(parents=True)  # the parent's return is not watched: the next wait looks
    assert wake.wait(0)
    assert wake.full_look_due()
    _write(directory / "desired.json")
    assert wake.wait(30)


def _queue_limit() -> int:
    return int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())


def test_an_overflow_of_the_kernels_queue_is_a_full_look(directory: Path, wake: Wakeup) -> None:
    limit = _queue_limit()
    if limit > 200_000:
        pytest.skip(f"max_queued_events is {limit}: too many files to make for an overflow")
    for i in range(limit + 10):  # each a CLOSE_WRITE of its own name, none read yet
        (directory / f"f{i}").touch()
    assert wake.wait(30)
    assert wake.full_look_due()
    _write(directory / "desired.json")  # the watch still holds, at the same path
    assert wake.wait(30)
    assert not wake.full_look_due()


class Hold:
    """The loop's wait, for a worker only its watch can wake: no heartbeat, safety net or poll
    (an hour), and a hold that keeps the loop from reading its queue while a test fills it."""

    def __init__(self, worker: loop.Worker, monkeypatch: pytest.MonkeyPatch) -> None:
        self.worker = worker
        self._asked = threading.Event()
        self._held = threading.Event()
        self._release = threading.Event()
        monkeypatch.setattr(worker, "_next_wait", self._next_wait)

    def _next_wait(self) -> float:
        if self._asked.is_set():
            self._asked.clear()
            self._held.set()
            self._release.wait()
        return 3600.0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._release.clear()
        self._asked.set()
        self.worker._wake.set()
        assert self._held.wait(30), "the loop never came round to its wait"
        try:
            yield
        finally:
            self._held.clear()
            self._release.set()


def _generation(worker: loop.Worker) -> int | None:
    try:
        return int(json.loads(worker.heartbeat.path.read_text())["generation"])
    except (OSError, ValueError, KeyError):
        return None


def test_a_worker_woken_only_by_its_watch_acknowledges_a_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = FakeRuntime(container=_container("c1", SPEC))
    worker, shown = _worker(tmp_path, FakeEngine(runtime), monkeypatch)
    Hold(worker, monkeypatch)

    def script() -> None:
        _until("the first status", lambda: bool(shown))
        for generation in (1, 2, 3):
            _request(worker, generation, "running")
            _until(f"generation {generation}", lambda g=generation: _generation(worker) == g)

    _drive(worker, script)


def test_after_an_overflow_a_worker_observes_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = _queue_limit()
    if limit > 200_000:
        pytest.skip(f"max_queued_events is {limit}: too many files to make for an overflow")
    runtime = FakeRuntime(container=_container("c1", SPEC))
    engine = FakeEngine(runtime)
    looks: list[int] = []
    observe = engine.observe

    def counted() -> Observed:
        looks.append(1)
        return observe()

    monkeypatch.setattr(engine, "observe", counted)
    worker, _ = _worker(tmp_path, engine, monkeypatch)
    hold = Hold(worker, monkeypatch)

    def script() -> None:
        _request(worker, 1, "running")
        _until("generation 1", lambda: _generation(worker) == 1)
        _until("settled", lambda: worker.job is None and not worker._pending)
        before = len(looks)
        with hold.held():  # the loop reads none of these until the queue has overflowed
            for i in range(limit + 10):
                (worker.directory / f"f{i}").touch()
        _until("a look after the overflow", lambda: len(looks) > before)

    _drive(worker, script)


def test_a_worker_that_cannot_watch_reads_its_request_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(directory: Path) -> DesiredWatch:
        raise OSError(24, "Too many open files")  # the user's inotify instances all taken

    monkeypatch.setattr(loop, "DesiredWatch", refused)
    monkeypatch.setattr(loop, "SAFETY_NET", 0.2)
    runtime = FakeRuntime(container=_container("c1", SPEC))
    worker, _ = _worker(tmp_path, FakeEngine(runtime), monkeypatch)

    def script() -> None:
        _request(worker, 1, "running")
        _until("generation 1", lambda: _generation(worker) == 1)

    _drive(worker, script)
