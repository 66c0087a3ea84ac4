"""The watch on desired.json: the kernel's inotify queue, read by the loop's own wait.

Nothing polls: the queue's descriptor is one of those the loop's `select` waits on, so a request
is seen as soon as its rename lands, and an idle worker is woken by nothing but its own heartbeat
writes. What the kernel says is judged by `judge` (pure); `DesiredWatch` carries it out.

The rules, each the kernel's own event:
- desired.json written in place (closed after a write), renamed in, or removed: read it again;
- the kernel's queue overflowed (events were lost): a full look, as after a restart;
- the directory removed, or renamed away (a directory replaced by a rename over it): the watch
  is lost with it. The parent is watched for the name to come back, and the directory is
  watched again as soon as it is there, with a full look, since what happened in between was
  not seen.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from inotify_simple import INotify, flags

from supervisor import logs
from supervisor.protocol.layout import DESIRED

log = logs.get("worker")

# desired.json is read again when it was closed after a write, renamed in, or removed; a
# creation alone is not enough (an editor's file is empty until written and closed)
CHANGES: Final = flags.CLOSE_WRITE | flags.MOVED_TO | flags.DELETE | flags.MOVED_FROM
# the directory itself went: removed, or renamed away
GONE: Final = flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED | flags.UNMOUNT
DIRECTORY_MASK: Final = CHANGES | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR
# in the parent: the directory's name made or renamed in again
RETURNS: Final = flags.CREATE | flags.MOVED_TO
PARENT_MASK: Final = RETURNS | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR


@dataclass(frozen=True, slots=True)
class Event:
    """One event as the kernel queued it: its watch, what happened, and the name in the
    watched directory it happened to ('' for the directory itself)."""

    wd: int
    mask: int
    name: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a batch of events means to the loop."""

    changed: bool = False  # desired.json may have changed: read it again
    full_look: bool = False  # events were lost: read and observe as after a restart
    lost: bool = False  # the directory's watch is gone: watch it again when it is back
    returned: bool = False  # the directory's name is back in its parent: watch it again
    parent_lost: bool = False  # the parent's watch is gone: watch it again when it is back

    @property
    def wakes(self) -> bool:
        return self.changed or self.full_look or self.lost or self.returned


def judge(
    events: Iterable[Event], directory_wd: int | None, parent_wd: int | None, name: str
) -> Verdict:
    """What the events mean, for the directory's watch and its parent's (None: not held),
    where name is the directory's own name in its parent."""
    changed = full_look = lost = returned = parent_lost = False
    for event in events:
        if event.mask & flags.Q_OVERFLOW:
            full_look = True
        elif directory_wd is not None and event.wd == directory_wd:
            if event.mask & GONE:
                lost = True
            elif event.mask & CHANGES and event.name == DESIRED:
                changed = True
        elif parent_wd is not None and event.wd == parent_wd:
            if event.mask & GONE:
                parent_lost = True
            elif event.mask & RETURNS and event.name == name:
                returned = True
    return Verdict(changed, full_look, lost, returned, parent_lost)


class DesiredWatch:
    """The inotify watch of one engine directory for its desired.json, and of its parent for
    the directory's return. Read by one thread only: the loop's."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inotify = INotify(nonblocking=True)
        self._directory_wd: int | None = None
        self._parent_wd: int | None = None
        self._watch()

    def fileno(self) -> int:
        return int(self._inotify.fileno())

    @property
    def watching(self) -> bool:
        """Whether the directory itself is watched now."""
        return self._directory_wd is not None

    def take(self) -> Verdict:
        """Read what the kernel queued and judge it. A lost watch is replaced at once when the
        directory is there again, and after an overflow (which may have dropped the loss) the
        watch is checked against the path; either asks for a full look."""
        events: list[Event] = []
        with contextlib.suppress(BlockingIOError):
            events = [Event(e.wd, e.mask, e.name) for e in self._inotify.read(timeout=0)]
        verdict = judge(events, self._directory_wd, self._parent_wd, self.directory.name)
        if verdict.parent_lost:
            self._parent_wd = None
        if verdict.lost:
            log.warning("the engine directory's watch was lost", directory=str(self.directory))
            self._drop(self._directory_wd)
            self._directory_wd = None
        elif verdict.full_look:
            self._drop(self._directory_wd)  # a watch of a directory no longer at the path
            self._directory_wd = None
        if not self.watching and self._watch():
            if not verdict.full_look:
                log.info("the engine directory is watched again", directory=str(self.directory))
            return Verdict(changed=True, full_look=True)
        return verdict

    def retry(self) -> bool:
        """Watch the directory again if its watch is lost and it is back; True when it is
        watched now after it was not (the caller then takes a full look)."""
        if self.watching:
            return False
        return self._watch()

    def close(self) -> None:
        self._inotify.close()

    def _drop(self, wd: int | None) -> None:
        if wd is not None:
            with contextlib.suppress(OSError):  # already gone with its directory
                self._inotify.rm_watch(wd)

    def _watch(self) -> bool:
        """Watch the parent and the directory where they are not watched and are there; True
        when the directory is watched by this call."""
        if self._parent_wd is None:
            with contextlib.suppress(OSError):  # the parent is gone too: retried on each wait
                self._parent_wd = self._inotify.add_watch(self.directory.parent, PARENT_MASK)
        if self._directory_wd is not None:
            return False
        try:
            self._directory_wd = self._inotify.add_watch(self.directory, DIRECTORY_MASK)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                log.error("cannot watch the engine directory", error=str(exc))
            return False
        return True
