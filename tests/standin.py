"""What every real-dockerd suite (and the bench) builds its stand-in engines from: the busybox
base image, git copies of a recipe repository, and recipe files written from tables.

The base image is FROM scratch with Debian's static busybox: no registry is needed, and the
stand-in recipe's Dockerfile builds on it through its BASE build argument.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker

ROOT = Path(__file__).resolve().parents[1]
DEMO_REPO = ROOT / "demo" / "recipe-repo"  # a recipe with a Dockerfile: image.from = dockerfile


def busybox_context(context: Path, labels: Mapping[str, str] | None = None) -> Path:
    """The base image's build context in context (a new directory): Debian's static busybox
    and a Dockerfile FROM scratch; labels are set from the first instruction on, so that even a
    failed build's layers can be found and removed."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox-static is needed (apt-get install busybox-static)")
    context.mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, context / "busybox")
    marks = "".join(f"LABEL {key}={json.dumps(value)}\n" for key, value in (labels or {}).items())
    (context / "Dockerfile").write_text(
        f"FROM scratch\n{marks}COPY busybox /bin/busybox\n"
        'RUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
        "RUN mkdir -p /tmp /usr/local/bin /site && chmod 1777 /tmp\n"
    )
    return context


def busybox_image(
    client: docker.DockerClient, context: Path, tag: str, labels: Mapping[str, str] | None = None
) -> str:
    """Build the base image as tag in context (a new directory)."""
    client.images.build(path=str(busybox_context(context, labels)), tag=tag, rm=True, forcerm=True)
    return tag


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def git(cwd: Path, *args: str) -> str:
    """git with a fixed identity; its output, stripped."""
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@lucia.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@lucia.invalid",
    }
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def recipe_repository(path: Path, template: Path = DEMO_REPO, message: str = "recipe") -> str:
    """A git repository at path holding a copy of template, in one commit; that commit."""
    shutil.copytree(template, path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "--allow-empty", "-m", message)
    return git(path, "rev-parse", "HEAD")


def toml_value(value: Any) -> str:
    """A TOML value: inline tables and arrays of them, else JSON's spelling (the same in TOML
    for strings, numbers, booleans and flat arrays)."""
    if isinstance(value, dict):
        return inline_table(value)
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value)


def inline_table(table: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in table.items()) + "}"


def toml_text(data: Mapping[str, Any]) -> str:
    """A recipe file from its tables: top-level keys first, then one [table] per dict."""
    top = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [
        f"[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
        for k, v in data.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top + tables) + "\n"


def demo_recipe(
    name: str,
    repository: Path,
    commit: str,
    tag: str,
    base: str,
    port: int,
    network: str,
    **tables: Mapping[str, Any],
) -> str:
    """The recipe that runs demo/recipe-repo's engine; tables' keys are added to (or replace)
    its own, table by table ({"run": {"stop_grace": 5}, "secrets": {...}})."""
    data: dict[str, Any] = {
        "name": name,
        "engine": "tensorfold",
        "model": "test/tiny-model",
        "source": {"repository": f"file://{repository}", "commit": commit},
        "image": {"tag": tag, "build_args": {"BASE": base}},
        "grammar": {"requirement": "xgrammar>=0.2.8,<0.3", "modules": ["xgrammar", "tensorfold"]},
        "settings": {"PORT": str(port), "MODEL_ID": "test/tiny-model", "SERVED_NAME": "tiny"},
        "run": {
            "network": network,
            "port": port,
            "ready_path": "/v1/models",
            "ready_timeout": 60,
            "stop_grace": 10,
        },
    }
    for table, values in tables.items():
        data[table] = {**data.get(table, {}), **values}
    return toml_text(data)
