"""The queue: the lease, the startup rules, at most N downloads at once, the operator's requests.

At startup (the operators' guide): every download a previous queue had taken (Queued and
accepted, or Downloading) becomes Interrupted with its partial files kept; every Ready GGUF is
inspected again (headers only) and becomes Failed when it no longer passes; hub token files a
killed queue left behind are removed. Then the queue runs
the oldest Queued downloads, `parallel` at once, and applies each <guid>/control.json. On stop,
running downloads end as Interrupted.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.host.models import control
from supervisor.host.models import manifest as mf
from supervisor.host.models.job import Job, QueueSettings, download, sweep_tokens
from supervisor.host.models.lease import CatalogLease
from supervisor.host.models.verify import reinspect
from supervisor.protocol.files import remove_stale_temps

JOIN_TIMEOUT: Final = 10.0


class Runner:
    """The one process that runs a library's queue (it holds the lease)."""

    def __init__(self, root: Path, settings: QueueSettings) -> None:
        self.root = root
        self.settings = settings
        self.lease = CatalogLease(root)
        self.jobs: dict[str, Job] = {}
        self.log = logs.get("models")

    def start(self, wait: float = 0.0) -> list[str]:
        """Take the lease (CatalogHeld when another holds it); apply the startup rules."""
        self.lease.acquire(wait)
        return self.recover()

    def recover(self) -> list[str]:
        """Interrupt what a previous queue left running; re-inspect Ready GGUFs. Says what."""
        said: list[str] = []
        swept = sweep_tokens(self.root)
        if swept:
            said.append(f"removed {len(swept)} hub token files a stopped queue left")
        for model in mf.load_all(self.root):
            remove_stale_temps(mf.model_dir(self.root, model.id) / "model.json")
            if model.state == "Downloading" or (model.state == "Queued" and model.accepted):
                message = (
                    f"interrupted: the library's service stopped while it was "
                    f"{model.state}; partial files are kept, retry to continue"
                )
                mf.save(self.root, model.transition("Interrupted", message))
                said.append(f"{model.name}: {message}")
            elif model.state == "Ready":
                problem = reinspect(mf.files_dir(self.root, model.id), model.hub_files)
                if problem:
                    mf.save(self.root, model.transition("Failed", f"startup check: {problem}"))
                    said.append(f"{model.name}: Failed, {problem}")
        for line in said:
            self.log.warning("library startup", change=line)
        return said

    def tick(self) -> None:
        """One round: reap, apply requests, accept and start Queued downloads."""
        for guid, job in list(self.jobs.items()):
            if job.thread is not None and not job.thread.is_alive():
                del self.jobs[guid]
                if job.remove:
                    self._quietly(guid, "remove")
        models = mf.load_all(self.root)
        for model in models:
            action = control.take_request(self.root, model.id)
            if action is not None:
                self._request(model.id, action)
        models = mf.load_all(self.root)
        for model in models:
            if model.state == "Queued" and not model.accepted:
                mf.save(self.root, model.model_copy(update={"accepted": True}))
        for model in models:
            if len(self.jobs) >= self.settings.parallel:
                break
            if model.state == "Queued" and model.id not in self.jobs:
                self._start(model.model_copy(update={"accepted": True}))

    def _request(self, guid: str, action: control.Action) -> None:
        job = self.jobs.get(guid)
        if job is not None and action in ("cancel", "remove"):
            job.remove = action == "remove"
            job.cancel.set()
            return
        if job is not None:
            return  # a retry of a running download: nothing to do
        self._quietly(guid, action)

    def _quietly(self, guid: str, action: control.Action) -> None:
        try:
            control.apply(self.root, guid, action, limit_queue=True)
        except (control.RequestRefused, FileNotFoundError, ValueError) as exc:
            self.log.warning("request refused", model=guid, action=action, reason=str(exc))

    def _start(self, model: mf.ModelManifest) -> None:
        job = Job(model.id)
        job.thread = threading.Thread(
            target=self._run, args=(model, job), name=f"download-{model.id[:8]}", daemon=True
        )
        self.jobs[model.id] = job
        job.thread.start()

    def _run(self, model: mf.ModelManifest, job: Job) -> None:
        try:
            download(self.root, model, job, self.settings)
        except Exception as exc:  # the queue goes on; the model says why
            self.log.exception("download broke", model=model.id)
            with contextlib.suppress(OSError):
                mf.save(self.root, model.transition("Failed", f"the download broke: {exc}"))

    def run(self, stop: threading.Event, ready: threading.Event | None = None) -> None:
        """Tick until stop is set, then interrupt the running downloads."""
        if ready is not None:
            ready.set()
        try:
            while not stop.is_set():
                self.tick()
                stop.wait(self.settings.poll)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        for job in self.jobs.values():
            job.interrupted = True
            job.cancel.set()
        for job in self.jobs.values():
            if job.thread is not None:
                job.thread.join(JOIN_TIMEOUT)
        self.jobs.clear()
        self.lease.release()
