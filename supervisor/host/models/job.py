"""One download from Queued to Ready, Failed, Canceled or Interrupted, every step in model.json.

Before: partials swept, files already there verified (kept when they pass, fetched again when
not), the free space checked against what is still to fetch. During: the hf child, its progress
written about once a second. After: every file's hash, then the format's checks.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from supervisor import logs, redaction
from supervisor.host.models import fetch
from supervisor.host.models import manifest as mf
from supervisor.host.models.control import (
    forget,
    free_bytes,
    remove_strays,
    space_during,
    space_problem,
    strays,
    sweep_partials,
)
from supervisor.host.models.streamhash import StreamHasher
from supervisor.host.models.verify import CheckFailed, check_file, inspect
from supervisor.library.models import ModelState

TOKENS_DIR: Final = ".hf-home/tokens"
HF_HOME_DIR: Final = ".hf-home/home"
WRITE_EVERY: Final = 1.0


@dataclass(frozen=True)
class QueueSettings:
    """The queue's settings: downloads at once, the stall time, the poll, the token file."""

    parallel: int = 2
    stall_after: float = 120.0
    poll: float = 0.5
    token_file: Path | None = None
    program: str = field(default_factory=fetch.hf_program)


@dataclass
class Job:
    """A download the queue runs: its thread, and how the queue stops it."""

    guid: str
    cancel: threading.Event = field(default_factory=threading.Event)
    interrupted: bool = False  # stopped by the queue's own stop, not by the operator
    remove: bool = False  # remove the model once the download has stopped
    thread: threading.Thread | None = None


def read_token(path: Path | None) -> str | None:
    """The hub token from its file (stripped), or None when there is no file or it is empty.
    A token read is registered for redaction: whatever text leaves this process (hf's last
    line in a message, the journal) shows it masked."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    if token:
        redaction.register([token])
    return token or None


def sweep_tokens(root: Path) -> list[str]:
    """Remove the token files a previous service left (a SIGKILL ends it before its downloads
    remove theirs); at startup, when no download of this library runs. Their names."""
    directory = root / TOKENS_DIR
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        (directory / name).unlink(missing_ok=True)
    return names


def _prepare(root: Path, model: mf.ModelManifest) -> mf.ModelManifest:
    """Sweep partials; check the files already there; the ones that fail are fetched again."""
    local = mf.files_dir(root, model.id)
    sweep_partials(local)
    files: list[mf.HubFile] = []
    for file in model.hub_files:
        ok = file.verified and (local / file.path).is_file()
        if not ok and (local / file.path).is_file():
            try:
                check_file(local, file)
                ok = True
            except CheckFailed:
                forget(local, file.path)
        files.append(file.model_copy(update={"verified": ok}))
    return model.model_copy(update={"hub_files": files})


def download(
    root: Path, model: mf.ModelManifest, job: Job, settings: QueueSettings
) -> mf.ModelManifest:
    """Run one download to its end; every transition saved; the final manifest returned."""
    log = logs.get("models").bind(model=model.id, name=model.name)
    local = mf.files_dir(root, model.id)
    local.mkdir(mode=0o750, parents=True, exist_ok=True)
    model = model.transition("Downloading", "checking the files already there")
    mf.save(root, model)
    model = _prepare(root, model)
    missing = sum(f.size for f in model.hub_files if not f.verified)
    problem = space_problem(missing, free_bytes(local))
    if problem:
        return _end(root, model, "Failed", problem, log)
    model = model.model_copy(update={"message": "starting hf download"})
    mf.save(root, model)
    log.info("download started", commit=model.source.commit, missing=missing)
    token = read_token(settings.token_file)
    token_file = fetch.write_token(root / TOKENS_DIR, model.id, token) if token else None
    hf_home = root / HF_HOME_DIR
    hf_home.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = fetch.child_env(os.environ, hf_home, token_file)
    argv = fetch.child_argv(
        settings.program, model.source.repo, model.source.commit, local, model.source.include
    )
    last_write = 0.0

    def progress(sample: fetch.Sample, pid: int) -> None:
        nonlocal model, last_write
        if time.monotonic() - last_write < WRITE_EVERY and model.pid == pid:
            return
        last_write = time.monotonic()
        model = model.model_copy(
            update={
                "bytes_done": sample.done,
                "speed": sample.speed,
                "seconds_left": sample.seconds_left,
                "pid": pid,
                "message": "downloading",
            }
        )
        mf.save(root, model)

    hasher = StreamHasher(local, model.hub_files)
    try:
        outcome = fetch.run(
            argv,
            env,
            local,
            model.bytes_total,
            stall_after=settings.stall_after,
            poll=settings.poll,
            cancel=job.cancel,
            progress=progress,
            space=lambda done: space_during(model.bytes_total, done, free_bytes(local)),
            tick=hasher.poll,
        )
        proven = hasher.finish() if outcome.ok else set()
    finally:
        hasher.close()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    if proven:
        log.info("hashed while downloading", files=len(proven))
    stray = _strays(local, model)
    if stray:
        log.warning("files the hub's list does not name arrived, removed", files=stray[:20])
    model = model.model_copy(
        update={
            "hub_files": [
                f.model_copy(update={"verified": True}) if f.path in proven else f
                for f in model.hub_files
            ]
        }
    )
    if outcome.canceled and job.interrupted:  # partials kept, as at startup; a retry sweeps them
        return _end(
            root,
            model,
            "Interrupted",
            "interrupted: the library's service stopped; partial files are kept, retry to continue",
            log,
        )
    if not outcome.ok:  # hf resumes no partial file in another process: nothing to keep
        sweep_partials(local)
    if outcome.canceled:
        return _end(root, model, "Canceled", "canceled; finished files are kept", log)
    if stray:
        shown = ", ".join(repr(path) for path in stray[:5])
        more = f" and {len(stray) - 5} more" if len(stray) > 5 else ""
        said = f"files arrived that the hub's list does not name, removed: {shown}{more}"
        return _end(root, model, "Failed", said if outcome.ok else f"{outcome.reason}; {said}", log)
    if not outcome.ok:
        return _end(root, model, "Failed", outcome.reason, log)
    return _check(root, model, job, log)


def _strays(local: Path, model: mf.ModelManifest) -> list[str]:
    """What hf wrote that the verified list does not name (hf takes its own list from the hub,
    and a mirror may answer it otherwise than ours): removed, and said."""
    expected = {f.path for f in model.hub_files} | {n.name for n in model.files}
    found = strays(local, expected)
    remove_strays(local, found)
    return found


def _check(root: Path, model: mf.ModelManifest, job: Job, log: Any) -> mf.ModelManifest:
    local = mf.files_dir(root, model.id)
    model = model.model_copy(
        update={
            "bytes_done": model.bytes_total,
            "pid": None,
            "message": "checking SHA-256 and headers",
        }
    )
    mf.save(root, model)
    files = list(model.hub_files)
    for index, file in enumerate(files):
        if file.verified:
            continue
        if job.cancel.is_set():  # between files: a stop or a cancel does not wait for them all
            model = model.model_copy(update={"hub_files": files})
            if job.interrupted:
                return _end(
                    root,
                    model,
                    "Interrupted",
                    "interrupted while checking; the files are kept, retry to check them",
                    log,
                )
            return _end(root, model, "Canceled", "canceled; finished files are kept", log)
        try:
            check_file(local, file)
        except CheckFailed as exc:
            forget(local, file.path)
            model = model.model_copy(update={"hub_files": files})
            return _end(root, model, "Failed", str(exc), log)
        files[index] = file.model_copy(update={"verified": True})
    model = model.model_copy(update={"hub_files": files})
    try:
        inspection = inspect(local, files)
    except CheckFailed as exc:
        return _end(root, model, "Failed", str(exc), log)
    model = model.model_copy(
        update={"inspection": inspection, "files": mf.link_nested(local, files)}
    )
    context = f", context {inspection.context}" if inspection.context else ""
    return _end(
        root, model, "Ready", f"ready: {inspection.format} {inspection.architecture}{context}", log
    )


def _end(
    root: Path, model: mf.ModelManifest, state: ModelState, message: str, log: Any
) -> mf.ModelManifest:
    model = model.transition(state, message)
    mf.save(root, model)
    log.info("download ended", state=state, message=message)
    return model
