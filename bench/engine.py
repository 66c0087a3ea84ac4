"""One bench engine: its recipe file, data and state directories, and its worker process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.host import protocol as host
from tests.engine_dirs import EngineDirs

from .status import Doc, StatusWatch, Timeout, read_json

if TYPE_CHECKING:
    from .lab import Lab

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WORKER = [PYTHON, "-m", "supervisor.cli", "worker"]


@dataclass
class Engine(EngineDirs):
    """One engine: its recipe file, data and state directories, and its worker process."""

    lab: Lab
    name: str
    root: Path
    port: int
    image_tag: str
    settings: dict[str, str] = field(default_factory=dict)
    build_args: dict[str, str] = field(default_factory=dict)
    prepare: bool = True
    heartbeat: float | None = None  # None: the worker's default (15 s)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def environment(self) -> dict[str, str]:
        return {
            "PORT": str(self.port),
            "MODEL_ID": "bench/tiny-model",
            "SERVED_NAME": "tiny",
            "PARALLEL": "4",
            "CONTEXT": "200000",
            "TENSORFOLD_MEMORY_RESERVE_GIB": "4",
            "HF_CACHE": str(self.root / "hf-cache"),
            "READY_DELAY": "0",
            "PREPARE_SECONDS": "0",
            **self.settings,
        }

    def write_recipe(self) -> None:
        repo, commit = self.lab.repo()
        build_args = {"BASE": self.lab.base_image(), **self.build_args}
        lines = [
            f'name = "{self.name}"',
            'engine = "tensorfold"',
            'model = "bench/tiny-model"',
            "[source]",
            f'repository = "file://{repo}"',
            f'commit = "{commit}"',
            "[image]",
            f'tag = "{self.image_tag}"',
            "build_args = " + _inline(build_args),
            "[prepare]",
            'commands = [["sh", "scripts/prepare.sh"]]' if self.prepare else "commands = []",
            "[grammar]",
            'requirement = "xgrammar>=0.2.8,<0.3"',
            'modules = ["xgrammar", "tensorfold"]',
            "[settings]",
            *(f"{key} = {json.dumps(value)}" for key, value in self.environment.items()),
            "[run]",
            f'network = "{self.lab.network}"',
            f"port = {self.port}",
            'ready_path = "/v1/models"',
            'metrics_path = "/metrics"',
            "ready_timeout = 60",
            "stop_grace = 60",
        ]
        self.recipe_path.write_text("\n".join(lines) + "\n")

    def start_worker(self) -> subprocess.Popen[bytes]:
        self.write_recipe()
        self.starts += 1
        log = self.root / f"worker-{self.starts}.log"
        extra = ["--heartbeat", str(self.heartbeat)] if self.heartbeat else []
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    *WORKER,
                    self.name,
                    "--recipe",
                    str(self.recipe_path),
                    "--data-dir",
                    str(self.data_dir),
                    "--state-dir",
                    str(self.state_dir),
                    *extra,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches the bench, which then cleans up
            )
        return self.proc

    def stop_worker(self, timeout: float = 30) -> float:
        """SIGTERM the worker; the seconds until it exited."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return 0.0
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
        return time.perf_counter() - started

    def request(self, desired: str) -> int:
        return host.request(self.data_dir, self.name, desired)  # type: ignore[arg-type]

    def status(self) -> Doc | None:
        return read_json(self.status_path)

    def watch(self) -> StatusWatch:
        return StatusWatch(self.status_path)

    def wait(self, check: Callable[[Doc], bool], timeout: float, what: str) -> Doc:
        try:
            return self.watch().wait(check, timeout, interval=0.01)[0]
        except Timeout as exc:
            raise Timeout(f"{self.name}: {what}: {exc}\nworker log:\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted(self.root.glob("worker-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace")[-chars:] if logs else "(no log)"


def _inline(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
