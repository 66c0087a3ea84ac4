"""What the CLI asks of the library: add a download, retry, cancel, remove; partials swept.

`add` resolves the revision, lists the commit's files and checks the names the router would
serve them under and the free space itself, so that a refusal is immediate and writes nothing,
then writes a Queued model.json into a new <guid>/. Retry, cancel and
remove are applied at once when no queue runs (the CLI takes the lease for that moment);
otherwise they are left as <guid>/control.json for the running queue, which owns every
model.json it has taken.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Final, Literal, get_args

from supervisor.host.models import manifest as mf
from supervisor.host.models.hub import Hub, HubRefused, check_repo, select
from supervisor.host.models.lease import CatalogLease
from supervisor.library import ggufcheck
from supervisor.protocol.files import FileLock, read_text, write_atomic
from supervisor.protocol.names import problem as name_problem

MAX_QUEUE: Final = 16
CONTROL: Final = "control.json"
ADD_LOCK: Final = ".lucia-model-catalog.lock"
HF_CACHE: Final = ".cache"
Action = Literal["retry", "cancel", "remove"]
ACTIONS: Final[tuple[Action, ...]] = get_args(Action)


class RequestRefused(Exception):
    """A request the library will not take; str() says why, for the operator."""


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def space_problem(needed: int, free: int) -> str | None:
    """Why a download of needed more bytes cannot fit in free bytes, or None (pure)."""
    if needed <= free:
        return None
    return f"not enough disk space: it needs {needed} bytes more and {free} bytes are free"


def space_during(total: int, done: int, free: int) -> str | None:
    """While hf writes: why the disk cannot hold the rest, or None (pure). `done` is every byte
    under files/ (files kept from before, hf's metadata, a mirror that sends more than it
    listed), so it may pass `total`: the rest is then none, but a disk with no byte free is
    still a problem (hf's next write fails), never silence."""
    if done >= total and free <= 0:
        return (
            f"not enough disk space: {done} bytes are written, as many as the {total} "
            "listed or more, and no byte is free"
        )
    return space_problem(max(total - done, 0), free)


def served_name_problem(files: list[mf.HubFile]) -> str | None:
    """Why a download would give the router a name outside the served-name rule (pure): a
    GGUF is served by its file name without `.gguf` (a split model by the prefix of its
    shards; a file in a sub-folder by its own name), an mmproj file by none. None when every
    name keeps it."""
    for file in files:
        base = file.path.rsplit("/", 1)[-1]
        if not base.endswith(ggufcheck.SUFFIX) or ggufcheck.is_mmproj(base):
            continue
        served = ggufcheck.unit_name(base)
        problem = name_problem(served)
        if problem is not None:
            return (
                f"{file.path!r} would be served as {served!r}, which is not a served name: "
                f"it {problem}"
            )
    return None


def queue_problem(models: list[mf.ModelManifest], limit: int = MAX_QUEUE) -> str | None:
    active = sum(1 for m in models if m.state in mf.ACTIVE)
    if active >= limit:
        return f"the queue holds {active} downloads (at most {limit}); wait or cancel one"
    return None


def default_name(repo: str, include: list[str]) -> str:
    """The repository's name, with the include globs' words when they pick one file set."""
    base = repo.rsplit("/", 1)[-1]
    picked = [p for p in include if not re.fullmatch(r"\*\.[A-Za-z0-9]+", p)]  # not "*.json"
    words = [p.strip("*?/").removesuffix(".gguf").strip("*?-_.") for p in picked]
    words = [w for w in words if w]
    return f"{base}:{'+'.join(words)}" if words else base


def add(
    root: Path,
    hub: Hub,
    repo: str,
    revision: str,
    *,
    include: list[str],
    name: str | None,
) -> mf.ModelManifest:
    """Check and queue one download; RequestRefused (or HubRefused) says why not."""
    check_repo(repo)
    commit = hub.resolve(repo, revision)
    files = select(hub.tree(repo, commit), include)
    if not files:
        shown = " ".join(include) or "(everything)"
        raise HubRefused(f"no file of {repo} at {commit} matches --include {shown}")
    problem = served_name_problem(files)
    if problem:
        raise RequestRefused(f"{repo}: {problem}")
    root.mkdir(mode=0o750, parents=True, exist_ok=True)
    total = sum(f.size for f in files)
    problem = space_problem(total, free_bytes(root))
    if problem:
        raise RequestRefused(f"{repo}: {problem}")
    name = name or default_name(repo, include)
    with FileLock(root / ADD_LOCK):
        models = mf.load_all(root)
        problem = queue_problem(models)
        if problem:
            raise RequestRefused(problem)
        if any(m.name == name for m in models):
            raise RequestRefused(f"a model named {name!r} is already in the library; give --name")
        stamp = mf.now()
        model = mf.ModelManifest(
            id=mf.new_guid(),
            name=name,
            state="Queued",
            since=stamp,
            created=stamp,
            source=mf.FileOrigin(repo=repo, revision=revision, commit=commit, include=include),
            bytesTotal=total,
            hubFiles=files,
            files=mf.plain_names(files),
            message=f"queued: {len(files)} files, {total} bytes",
        )
        mf.save(root, model)
    return model


def request(root: Path, guid: str, action: Action) -> bool:
    """Apply action now when no queue runs (True), else leave it for the queue (False)."""
    lease = CatalogLease(root)
    if lease.try_acquire():
        try:
            apply(root, guid, action, limit_queue=True)
        finally:
            lease.release()
        return True
    write_atomic(mf.model_dir(root, guid) / CONTROL, json.dumps({"action": action}).encode())
    return False


def take_request(root: Path, guid: str) -> Action | None:
    """The queue's side: the pending action for guid, consumed; None when there is none."""
    path = mf.model_dir(root, guid) / CONTROL
    try:
        text = read_text(path)
    except FileNotFoundError:
        return None
    except OSError:
        path.unlink(missing_ok=True)
        return None
    path.unlink(missing_ok=True)
    try:
        action = json.loads(text).get("action")
    except (ValueError, AttributeError):
        return None
    return action if action in ACTIONS else None


def apply(root: Path, guid: str, action: Action, *, limit_queue: bool) -> None:
    """An action on a model no download is running for (the caller holds the lease)."""
    if action == "remove":
        remove(root, guid)
        return
    model = mf.load(root, guid)
    if action == "cancel":
        if model.state not in mf.ACTIVE:
            raise RequestRefused(
                f"{model.name} is {model.state}: only a queued or running download can be canceled"
            )
        sweep_partials(mf.files_dir(root, guid))
        mf.save(root, model.transition("Canceled", "canceled; finished files are kept"))
        return
    if model.state not in mf.RETRYABLE:
        raise RequestRefused(
            f"{model.name} is {model.state}: only a Failed, Canceled or Interrupted "
            "download can be retried"
        )
    if limit_queue:
        problem = queue_problem(mf.load_all(root))
        if problem:
            raise RequestRefused(problem)
    sweep_partials(mf.files_dir(root, guid))
    queued = model.transition("Queued", "queued again; verified files are kept")
    mf.save(root, queued.model_copy(update={"accepted": False}))


def sweep_partials(local_dir: Path) -> list[Path]:
    """Remove hf's partial and lock files under local_dir; finished files and their metadata
    stay (so hf skips a finished file instead of hashing it again)."""
    swept: list[Path] = []
    cache = local_dir / HF_CACHE
    if not cache.is_dir() or cache.is_symlink():
        return swept
    for base, _dirs, names in os.walk(cache):
        for name in names:
            if name.endswith((".incomplete", ".lock")):
                path = Path(base) / name
                path.unlink(missing_ok=True)
                swept.append(path)
    return swept


def strays(local_dir: Path, expected: set[str]) -> list[str]:
    """What is under local_dir but is neither an expected path (a regular file) nor on the way
    to one, nor hf's own .cache/ directory: the top-most such paths, relative, sorted. A
    symlink is a stray wherever it is."""
    found: list[str] = []
    parents = {parent for path in expected for parent in _parents(path)}
    for base, dirs, names in os.walk(local_dir):
        here = Path(base).relative_to(local_dir)
        for name in list(dirs):
            path = (here / name).as_posix()
            if (path == HF_CACHE or path not in parents) or (Path(base) / name).is_symlink():
                dirs.remove(name)  # not walked into
                if path != HF_CACHE or (Path(base) / name).is_symlink():
                    found.append(path)
        for name in names:
            path = (here / name).as_posix()
            if path not in expected or not stat.S_ISREG((Path(base) / name).lstat().st_mode):
                found.append(path)
    return sorted(found)


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: n + 1]) for n in range(len(parts))]


def remove_strays(local_dir: Path, found: list[str]) -> None:
    """Remove what `strays` found (a directory with all in it; a symlink, never what it names)
    and hf's record of each."""
    for path in found:
        target = local_dir / path
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            forget(local_dir, path)


def forget(local_dir: Path, path: str) -> None:
    """Remove one downloaded file and hf's record of it, so the next run fetches it again."""
    (local_dir / path).unlink(missing_ok=True)
    metadata = local_dir / HF_CACHE / "huggingface" / "download" / f"{path}.metadata"
    metadata.unlink(missing_ok=True)


def remove(root: Path, guid: str) -> None:
    """Delete <root>/<guid> and nothing outside it (a symlink there is removed, not followed)."""
    directory = mf.model_dir(root, guid)
    if directory.is_symlink():
        directory.unlink()
        return
    if not directory.is_dir():
        raise RequestRefused(f"no model {guid} in {root}")
    shutil.rmtree(directory)
