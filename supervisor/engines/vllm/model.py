"""The vLLM model's prepare step: a pinned Hugging Face download, and its KV layout.

The download runs in a short-lived container of the engine image; the KV layout comes from the
model's `config.json`. The hf CLI is the engine image's own (`python3 -m
huggingface_hub.cli.hf`, what the `hf` console script runs), so the host needs nothing but
Docker, and the download lands in the Hugging Face cache exactly where `vllm serve` looks for
it: the same run volumes are mounted. Its layout is huggingface_hub's:
`<hub cache>/models--<owner>--<name>/snapshots/<commit>/`. A library model is already on the
host: it is mounted read-only and needs no step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Mount
from supervisor.engines.base import StepContext
from supervisor.engines.vllm import account, secretfiles, tasks
from supervisor.errors import BuildFailed, Permanent
from supervisor.protocol import files

PYTHON: Final = "python3"
HF_CLI: Final = ("-m", "huggingface_hub.cli.hf")  # the `hf` console script's module
TOKEN_NAMES: Final = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
NO_TOKEN: Final = {"HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}


@dataclass(frozen=True)
class Where:
    """Where the download runs: the engine image, its network, the run volumes, and the
    snapshot's directory on the host (None: no volume keeps the cache)."""

    image_id: str
    network: str
    volumes: tuple[Mount, ...]
    snapshot: Path | None


@dataclass(frozen=True)
class ModelDownload:
    """The pinned Hugging Face model, downloaded into the cache the engine mounts."""

    repo_id: str
    revision: str

    @property
    def description(self) -> str:
        return f"downloading {self.repo_id} at {self.revision[:12]}"


def command(repo_id: str, revision: str) -> list[str]:
    """The hf CLI's arguments after `python3` (no token: that comes as a file)."""
    return [*HF_CLI, "download", repo_id, "--revision", revision]


def hub_cache(settings: Mapping[str, str]) -> PurePosixPath:
    """Where huggingface_hub keeps its cache inside the container (its own rules: HF_HUB_CACHE,
    else HF_HOME/hub; HF_HOME is the recipe's, else account.HF_HOME, which the engine is given)."""
    if settings.get("HF_HUB_CACHE"):
        return PurePosixPath(settings["HF_HUB_CACHE"])
    return PurePosixPath(settings.get("HF_HOME") or account.HF_HOME) / "hub"


def snapshot(settings: Mapping[str, str], repo_id: str, revision: str) -> PurePosixPath:
    owner, name = repo_id.split("/", 1)
    return hub_cache(settings) / f"models--{owner}--{name}" / "snapshots" / revision


def on_host(path: PurePosixPath, mounts: tuple[Mount, ...]) -> Path | None:
    """The host path behind a container path: the writable mount that holds it, the deepest
    one first; None when no mount keeps it (it would be lost with the container)."""
    best: tuple[int, Path] | None = None
    for mount in mounts:
        target = PurePosixPath(mount.target)
        if mount.read_only or not (path == target or target in path.parents):
            continue
        depth = len(target.parts)
        if best is None or depth > best[0]:
            best = (depth, Path(mount.source) / path.relative_to(target))
    return best[1] if best else None


def layout_fields(config: Mapping[str, object]) -> dict[str, int | None]:
    """Layers, KV heads and head_dim from a transformers config.json (a multimodal model's
    `text_config` when there is one): num_key_value_heads defaults to num_attention_heads,
    head_dim to hidden_size / num_attention_heads. None where the config does not say."""
    text = config.get("text_config")
    found: Mapping[str, object] = text if isinstance(text, dict) else config

    def number(key: str) -> int | None:
        value = found.get(key)
        counted = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if counted else None  # type: ignore[return-value]

    heads = number("num_attention_heads")
    hidden = number("hidden_size")
    head_dim = number("head_dim") or (hidden // heads if hidden and heads else None)
    return {
        "layers": number("num_hidden_layers"),
        "kv_heads": number("num_key_value_heads") or heads,
        "head_dim": head_dim,
    }


def file_stats(directory: Path) -> dict[str, str]:
    """Each file's size and change time, by name: a re-downloaded file is another manifest."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            info = entry.stat()
            found[entry.name] = f"{info.st_size}:{info.st_mtime_ns}"
    return found


def read_layout(directory: Path | None) -> dict[str, int | None]:
    """layout_fields of directory/config.json; all None when it is missing or unreadable."""
    empty: dict[str, int | None] = {"layers": None, "kv_heads": None, "head_dim": None}
    if directory is None:
        return empty
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return empty
    return layout_fields(config) if isinstance(config, dict) else empty


def read_tasks(directory: Path | None) -> tuple[tuple[str, ...] | None, bool]:
    """What vLLM resolves its runner from, in the model's files: config.json's architectures
    (None when it is missing or unreadable) and whether modules.json has a Sentence
    Transformers Pooling."""
    if directory is None:
        return None, False
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None, False
    try:
        modules = json.loads((directory / "modules.json").read_text())
    except (OSError, ValueError):
        modules = None
    return tasks.architectures(config), tasks.pooling_config(modules)


def download(
    runtime: Runtime,
    what: ModelDownload,
    where: Where,
    *,
    settings: Mapping[str, str],
    secrets: Mapping[str, str],
    secrets_root: Path,
    labels: dict[str, str],
    ctx: StepContext,
) -> None:
    """The hf CLI of the engine image in a short-lived container on the engine's network, as the
    engine's user (account.py: the files it leaves are the worker's), with the run volumes (the
    HF cache) and the recipe's settings (account.environment) as its whole environment; the
    token, only when the recipe gives one, as a read-only 0400 file named by HF_TOKEN_PATH,
    else HF_HUB_DISABLE_IMPLICIT_TOKEN=1. Its output is the progress, and the snapshot it
    left is the last line; a cancel kills it."""
    if where.snapshot is None:
        raise Permanent(
            f"no writable [run] volume holds the Hugging Face cache {hub_cache(settings)}, so "
            "the download would be lost with its container; add volumes = [{ source = "
            f'"~/.cache/huggingface", target = "{account.HF_HOME}" }}]'
        )
    env = account.environment(settings, leaving_out=TOKEN_NAMES)
    mounts = where.volumes
    token = next((n for n in TOKEN_NAMES if n in secrets), None)
    if token is None:
        env.update(NO_TOKEN)
    else:
        secretfiles.write(secrets_root, {token: secrets[token]})
        given = secretfiles.plan(secrets_root, {token: secretfiles.TOKEN_PATH})
        env.update(given.environment)
        mounts += given.mounts
    ctx.progress(f"{what.description} into the Hugging Face cache")
    code, tail = runtime.run_streamed(
        where.image_id,
        command(what.repo_id, what.revision),
        entrypoint=PYTHON,
        environment=env,
        mounts=mounts,
        network=where.network,
        labels=labels,
        progress=ctx.progress,
        cancel=ctx.cancel,
        user=account.user(),
    )
    if code != 0:
        raise BuildFailed(f"download of {what.repo_id} (exit {code})", tail)
    if not (where.snapshot / "config.json").is_file():
        raise Permanent(f"the download of {what.repo_id} left no config.json in {where.snapshot}")
    # The CLI's own last line is no message: its progress bar (stderr) may be redrawn after
    # the path it prints (stdout), and it shortens that path to the terminal's width.
    ctx.progress(f"downloaded {what.repo_id} at {what.revision[:12]} into {where.snapshot}")


def file_secrets(secrets: Mapping[str, object], key_secret: str) -> dict[str, str]:
    """The recipe's secrets the engine reads from a file: name -> its path variable."""
    names = {n: secretfiles.TOKEN_PATH for n in TOKEN_NAMES if n in secrets}
    if key_secret in secrets:
        names[key_secret] = secretfiles.KEY_FILE
    return names


def download_key(repo_id: str, revision: str, snapshot: Path | None) -> str:
    """What a finished download is recorded under: the id, the revision and where it went."""
    return hashlib.sha256(json.dumps([repo_id, revision, str(snapshot)]).encode()).hexdigest()


def downloaded(stamp: Path, key: str, snapshot: Path | None) -> bool:
    """The download recorded under key ended well (stamp says so), and is still there."""
    try:
        data = json.loads(files.read_text(stamp))
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("key") == key
        and snapshot is not None
        and (snapshot / "config.json").is_file()
    )


def record_download(stamp: Path, key: str) -> None:
    """Record a download that ended well, atomically, readable by this worker only."""
    files.write_atomic(stamp, json.dumps({"key": key}).encode(), 0o600)
