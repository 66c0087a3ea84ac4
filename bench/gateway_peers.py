"""The peers bench/gateway_bench.py measures the gateway against, each in a process of its own.

- LiteLLM's proxy (`litellm[proxy]` from PyPI, 1.108.7 measured): never a dependency of this
  project. Install it into a virtual environment of its own (`python3 -m venv /work/litellm-venv
  && /work/litellm-venv/bin/pip install 'litellm[proxy]==1.108.7'`) and name that
  environment's `litellm` (or its directory) with `--litellm` or `LUCIA_BENCH_LITELLM`. It
  serves as its documentation says: one model from a config file, a master key, one uvicorn
  worker, and `LITELLM_LOCAL_MODEL_COST_MAP=True` (no fetch of the cost map at start).
- the gateway of another revision (`--baseline REV`): this repository's tree at REV, exported
  with `git archive` into a temporary directory, run by bench/gateway_parts.py's `gateway`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_parts import MODEL, free_port, wait_answering  # noqa: E402

LITELLM_ENV: Final = "LUCIA_BENCH_LITELLM"
LITELLM_KEY: Final = "sk-bench-master-" + "m" * 32  # LiteLLM's master keys start with sk-


def find_litellm(given: str | None) -> tuple[Path | None, str]:
    """Pure but for the file system: LiteLLM's `litellm` command from `given` (the command, or
    a virtual environment's directory) or LUCIA_BENCH_LITELLM, and a line saying what was
    found, or why its rows are left out."""
    where = given or os.environ.get(LITELLM_ENV)
    if not where:
        return None, (
            f"LiteLLM: not measured (name its virtual environment with --litellm or "
            f"{LITELLM_ENV}; see bench/README.md)"
        )
    path = Path(where)
    for candidate in (path, path / "bin" / "litellm"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate, f"LiteLLM: {candidate}"
    return None, f"LiteLLM: not measured ({where} has no litellm command)"


def litellm_config(upstream: str) -> str:
    """Pure: LiteLLM's config: MODEL at `upstream`'s OpenAI-compatible /v1, the master key."""
    return f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {upstream}/v1
      api_key: none
general_settings:
  master_key: {LITELLM_KEY}
"""


@contextmanager
def litellm_proxy(command: Path, upstream: str) -> Iterator[tuple[str, int]]:
    """LiteLLM's proxy in front of `upstream`, one uvicorn worker; its url and pid."""
    with tempfile.TemporaryDirectory(prefix="lucia-bench-litellm-") as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(litellm_config(upstream))
        port = free_port()
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "HOME": tmp,
        }
        env.pop("PYTHONPATH", None)
        child = subprocess.Popen(
            [
                str(command),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            cwd=tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_answering(url + "/health/liveliness", timeout=120)
            yield url, child.pid
        finally:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@contextmanager
def revision_tree(revision: str) -> Iterator[Path]:
    """This repository's files at `revision`, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lucia-bench-baseline-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", revision],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)
