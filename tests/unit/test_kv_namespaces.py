"""Old KV-cache namespaces: which a prune removes (a table), and, on real directories, that it
never removes one a container names, one a worker is starting an engine on (held by another
process), or any while it cannot list the containers; the locks taken in an order that leaves
no window between the three."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from supervisor.engines.vllm import namespaces as ns
from supervisor.engines.vllm.namespaces import Old, chosen
from supervisor.errors import Transient

GIB = 1024**3
ROOT = Path(__file__).resolve().parents[2]


def old(name: str, changed: int, size: int = 10, **held: bool) -> Old:
    return Old(Path("/t") / (name * 32), changed, size, **held)


# -- the decision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "cap", "reserve", "removed"),
    [
        # room for the current namespace's cap and every old byte: nothing goes
        ([old("a", 1), old("b", 2)], 100, 80, []),
        # oldest first, until the rest fits beside the reserve
        ([old("b", 2), old("a", 1), old("c", 3)], 100, 85, ["a", "b"]),
        # the same time: by name
        ([old("b", 1), old("a", 1)], 100, 90, ["a"]),
        # every byte wanted: all the free ones go
        ([old("a", 1), old("b", 2)], 100, 100, ["a", "b"]),
        # a held namespace stays and counts: the next oldest goes in its place
        ([old("a", 1, named=True), old("b", 2), old("c", 3)], 100, 85, ["b", "c"]),
        ([old("a", 1, starting=True), old("b", 2), old("c", 3)], 100, 85, ["b", "c"]),
        ([old("a", 1, owned=True), old("b", 2), old("c", 3)], 100, 85, ["b", "c"]),
        # nothing free: nothing goes, however far over the cap
        (
            [old("a", 1, named=True), old("b", 2, starting=True), old("c", 3, owned=True)],
            10,
            10,
            [],
        ),
        ([], 10, 100, []),
    ],
)
def test_which_old_namespaces_go(
    found: list[Old], cap: int, reserve: int, removed: list[str]
) -> None:
    assert [path.name[0] for path in chosen(found, cap, reserve)] == removed


def test_held_is_any_of_the_three() -> None:
    assert not old("a", 1).held
    assert all(old("a", 1, **{why: True}).held for why in ("named", "starting", "owned"))


# -- real directories --------------------------------------------------------------------------


def _namespace(root: Path, name: str, size: int, age: int) -> Path:
    """A namespace directory holding one file of size bytes, last changed age seconds ago."""
    directory = root / name
    directory.mkdir(mode=0o700)
    (directory / "block").write_bytes(os.urandom(size))
    when = 1_700_000_000 - age
    os.utime(directory, (when, when))
    return directory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    made = tmp_path / "tier"
    made.mkdir(mode=0o700)
    return made


def nothing() -> frozenset[str]:
    return frozenset()


def test_old_namespaces_are_removed_oldest_first_once_the_cap_needs_their_room(
    root: Path,
) -> None:
    current = _namespace(root, "c" * 32, 64 * 1024, 0)
    oldest = _namespace(root, "a" * 32, 64 * 1024, 300)
    older = _namespace(root, "b" * 32, 64 * 1024, 200)
    newer = _namespace(root, "d" * 32, 64 * 1024, 100)
    (root / "not-a-namespace").mkdir()
    held = sum(ns.size(p) for p in (oldest, older, newer))
    one = ns.size(oldest)
    # room for the current namespace's cap and all the others: nothing goes
    assert ns.prune(root, current.name, 10 * held, 9 * held, nothing) == []
    # room for one old namespace beside the current cap: the two oldest go, the newest stays
    removed = ns.prune(root, current.name, GIB, GIB - one, nothing)
    assert removed == [oldest, older]
    assert sorted(os.listdir(root)) == sorted([current.name, newer.name, "not-a-namespace"])
    assert (current / "block").exists()


def test_a_namespace_any_container_names_is_kept(root: Path) -> None:
    current = _namespace(root, "c" * 32, 4096, 0)
    named = _namespace(root, "a" * 32, 4096, 500)  # another engine's, its container created
    old_one = _namespace(root, "b" * 32, 4096, 100)
    removed = ns.prune(root, current.name, GIB, GIB, lambda: {named.name, "f" * 32})
    assert removed == [old_one] and (named / "block").exists()


def test_the_containers_are_listed_once_every_start_is_locked_out(root: Path) -> None:
    """The listing comes after the prune holds the root (no start is marked meanwhile) and
    each old namespace (a start that let go of it made its container before)."""
    current = _namespace(root, "c" * 32, 4096, 0)
    other = _namespace(root, "a" * 32, 4096, 100)
    seen: list[tuple[bool, bool]] = []

    def named() -> frozenset[str]:
        seen.append((_locked(root), _locked(other)))
        return frozenset()

    assert ns.prune(root, current.name, GIB, GIB, named) == [other]
    assert seen == [(True, True)]
    assert not _locked(root)  # let go once it is done


def _locked(directory: Path) -> bool:
    """Whether another open file description holds a lock on the directory (of either kind)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_listing_that_fails_removes_nothing(root: Path) -> None:
    current = _namespace(root, "c" * 32, 4096, 0)
    other = _namespace(root, "a" * 32, 4096, 100)

    def named() -> frozenset[str]:
        raise Transient("listing containers labelled lucia.vllm.kv-namespace: docker is down")

    with pytest.raises(Transient):
        ns.prune(root, current.name, GIB, GIB, named)
    assert (other / "block").exists()


# -- a start under way, held by another process -------------------------------------------------

_CHILD = """
import sys
from pathlib import Path
from supervisor.engines.vllm.namespaces import Starting
starting = Starting()
made = starting.hold(Path(sys.argv[1]), sys.argv[2])
print("held", made, flush=True)
sys.stdin.read()
starting.release()
print("released", flush=True)
"""


@contextmanager
def starting_elsewhere(root: Path, space: str) -> Iterator[subprocess.Popen[str]]:
    """Another process (another engine's worker) starting an engine on space, until its input
    closes."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), space],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == f"held {root / space}"
        yield child
    finally:
        child.stdin.close()
        assert child.stdout.readline().strip() == "released"
        child.wait()
        child.stdout.close()


def test_a_namespace_another_worker_is_starting_on_is_kept_until_it_lets_go(root: Path) -> None:
    current = _namespace(root, "c" * 32, 4096, 0)
    starting = _namespace(root, "a" * 32, 4096, 300)  # the oldest: the first to go, were it free
    old_one = _namespace(root, "b" * 32, 4096, 100)
    with starting_elsewhere(root, starting.name):
        assert ns.prune(root, current.name, GIB, GIB, nothing) == [old_one]
        assert (starting / "block").exists()
    # its start is done or abandoned: an old namespace like any other (no container names it)
    assert ns.prune(root, current.name, GIB, GIB, nothing) == [starting]
    assert os.listdir(root) == [current.name]


def test_a_start_made_while_a_prune_runs_waits_and_makes_its_directory_again(
    root: Path,
) -> None:
    """A worker whose namespace a prune is removing waits for the prune, then makes the
    directory again and holds it: never a start on a directory being removed."""
    current = _namespace(root, "c" * 32, 4096, 0)
    other = _namespace(root, "a" * 32, 4096, 100)
    holder = ns.Starting()
    done = threading.Event()
    waited: list[bool] = []

    def start() -> None:
        holder.hold(root, other.name)
        done.set()

    def named() -> frozenset[str]:  # called while the prune holds the root
        thread.start()
        waited.append(not done.wait(0.3))
        return frozenset()

    thread = threading.Thread(target=start)
    assert ns.prune(root, current.name, GIB, GIB, named) == [other]
    thread.join(10)
    assert waited == [True] and done.is_set()
    assert other.is_dir() and os.listdir(other) == []  # made again, empty
    assert holder.held() == (other,)
    (other / "block").write_bytes(os.urandom(4096))  # its engine's first block
    assert ns.prune(root, current.name, GIB, GIB, nothing) == []  # held: kept
    holder.release()
    assert ns.prune(root, current.name, GIB, GIB, nothing) == [other]


def test_holding_makes_the_directory_owner_only_and_two_holders_share_it(root: Path) -> None:
    space = "e" * 32
    first, second = ns.Starting(), ns.Starting()
    made = first.hold(root / "deeper", space)
    assert second.hold(root / "deeper", space) == made  # another worker of one namespace
    assert os.stat(made).st_mode & 0o777 == 0o700
    first.release()
    assert _locked(made)  # the second still holds it
    second.release()
    assert not _locked(made)
    second.release()  # nothing held: nothing to do
