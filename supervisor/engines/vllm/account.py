"""Who the vLLM engine runs as, and where it keeps its files inside the container.

The engine (and the model download) runs as the worker's own uid and gid, never as the image's
root: the KV tier plugin opens only tier directories owned by its own uid (the worker creates
them 0700), the files it writes there and into the Hugging Face cache stay the worker's, so the
worker can prune and remove them, and the engine is not root in its container. A uid the image
has no passwd entry for would get HOME=/; HOME is therefore set to /tmp, present and writable in
every image, where vLLM, torch, Triton and huggingface_hub keep their caches (~/.cache,
~/.config: the container's own, gone with it, as /root's were). The Hugging Face cache is a run
volume at a neutral path, HF_HOME, since a non-root process cannot enter /root (0700 in Debian
and Ubuntu images); a recipe that still mounts something under /root is refused with the fix.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Collection, Iterable, Mapping
from typing import Final

ENGINE_HOME: Final = "/tmp"  # HOME of the engine: present and writable by any uid
HF_HOME: Final = "/var/cache/huggingface"  # where a recipe mounts the Hugging Face cache
ROOT_HOME: Final = "/root"
HF_PATHS: Final = ("HF_HOME", "HF_HUB_CACHE")


def user() -> str:
    """The container's "uid:gid": the worker's own (0:0 when the worker runs as root)."""
    return f"{os.getuid()}:{os.getgid()}"


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def environment(settings: Mapping[str, str], leaving_out: Collection[str] = ()) -> dict[str, str]:
    """The recipe's settings with HOME, USER and LOGNAME (torch's cache names ask for a user
    name, which a uid without a passwd entry lacks) and HF_HOME by default; the recipe's own
    HF_HOME or HF_HUB_CACHE win. Settings named in leaving_out (secrets and tokens, which go in
    as files if at all) are left out."""
    name = _name(os.getuid())
    found = {"HOME": ENGINE_HOME, "USER": name, "LOGNAME": name, **settings}
    found.setdefault("HF_HOME", HF_HOME)
    return {key: value for key, value in found.items() if key not in leaving_out}


def under_root(path: str) -> bool:
    return path == ROOT_HOME or path.startswith(ROOT_HOME + "/")


def refused_paths(targets: Iterable[str], settings: Mapping[str, str]) -> str | None:
    """Pure: why a recipe's volume targets or HF paths cannot work for an engine that is not
    root (None when they can)."""
    found = [t for t in targets if under_root(t)]
    found += [f"{k}={settings[k]}" for k in HF_PATHS if under_root(str(settings.get(k, "")))]
    if not found:
        return None
    return (
        f"{', '.join(found)}: the vLLM engine runs as the service user, not root, and cannot "
        f"enter {ROOT_HOME}; mount the Hugging Face cache at {HF_HOME} instead "
        f'(volumes = [{{ source = "~/.cache/huggingface", target = "{HF_HOME}" }}])'
    )
