"""The KV tier image: the vLLM image plus the tier plugin, proven to import beside vLLM.

`<vllm image>-tiers` is built FROM the engine image. The plugin (`kvplugin/`, distribution
`lucia-kv-tiers`) goes in as an installed distribution made here with the standard library (its
package files and a dist-info: METADATA, top_level.txt, RECORD), copied onto the image's Python
path, since the engine image has no pip. A build step imports `lucia_kv.connector`, `vllm` and
`cryptography` and checks the installed version. The image is labelled with the base image id,
the plugin's version and a digest of its files, and is rebuilt when any of them changes.

The plugin's source tree ships with this package as files (pyproject.toml, lucia_kv/), beside
`supervisor` in site-packages exactly as in a checkout, so `SOURCE` is the same relative path in
both. Its version is read from that pyproject.toml (the only place it is written), never by
importing the plugin. `build` writes a fresh context under the engine's state directory, builds
through the runtime and removes the context.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import shutil
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.docker.labels import TIERS_BASE, TIERS_DIGEST, TIERS_VERSION
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import BuildRequest, Image
from supervisor.engines.base import StepContext
from supervisor.errors import Blocked, BuildFailed

MESSAGE: Final = "Adding the KV cache tiers to the vLLM image"
DISTRIBUTION: Final = "lucia-kv-tiers"
PACKAGE: Final = "lucia_kv"
CONNECTOR: Final = "LuciaTierConnector"
CONNECTOR_MODULE: Final = "lucia_kv.connector"
CHECKED_MODULES: Final = (CONNECTOR_MODULE, "vllm", "cryptography")
# beside `supervisor`: the checkout's kvplugin/, or the copy installed with this package
SOURCE: Final = Path(__file__).resolve().parents[3] / "kvplugin"
SITE_PACKAGES: Final = "/opt/vllm/site-packages"  # the CPU image's PYTHONPATH
# vllm/vllm-openai: Python 3.12 with vLLM installed system-wide (uv pip install --system)
GPU_SITE_PACKAGES: Final = "/usr/local/lib/python3.12/dist-packages"
NEXT_STEP: Final = (
    "the running engine, if any, was left alone; fix the base image or the plugin "
    "(kvplugin/, installed beside the supervisor by install.sh) and request again, "
    "or remove [tiers] to run without the tiers"
)
PYTHON: Final = "/usr/bin/python3"
SUFFIX: Final = "-tiers"
CONTEXT_SITE: Final = "site-packages"  # the build context's folder copied onto the Python path
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")
_PATH = re.compile(r"/[A-Za-z0-9._/-]+")
# settings that are argv once in --kv-transfer-config; the key never is
_SETTINGS: Final = frozenset(
    {
        "namespace",
        "key_file",
        "metrics_file",
        "writers",
        "queue_blocks",
        "queue_bytes",
        "buffer_bytes",
        "rebuild_max_entries",
        "rebuild_max_seconds",
        "retry_seconds",
    }
    | {f"{tier}_{what}" for tier in ("shm", "nvme", "hdd") for what in ("dir", "bytes")}
)


class PluginUnreadable(Exception):
    """The plugin's source cannot be made into an image layer; str() says what and where."""


@dataclass(frozen=True)
class Plugin:
    """The plugin as it is installed: its version, requirements and package files."""

    version: str
    requires: tuple[str, ...]
    requires_python: str
    files: tuple[tuple[str, bytes], ...]  # (path under site-packages, content), sorted

    @property
    def dist_info(self) -> str:
        return f"{DISTRIBUTION.replace('-', '_')}-{self.version}.dist-info"


def read_plugin(source: Path = SOURCE) -> Plugin:
    """The plugin from its source tree (a checkout's or the installed copy):
    pyproject.toml's [project] and the package's files."""
    pyproject = source / "pyproject.toml"
    try:
        with pyproject.open("rb") as handle:
            project = tomllib.load(handle)["project"]
        name, version = project["name"], project["version"]
        requires = tuple(str(item) for item in project.get("dependencies", ()))
        requires_python = str(project.get("requires-python", ""))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise PluginUnreadable(f"{pyproject}: no [project] name and version ({exc})") from None
    if name != DISTRIBUTION:
        raise PluginUnreadable(f"{pyproject} names {name!r}, not {DISTRIBUTION!r}")
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise PluginUnreadable(f"{pyproject}: version {version!r} is not a version")
    package = source / PACKAGE
    paths = sorted(path for pattern in ("*.py", "py.typed") for path in package.rglob(pattern))
    if not any(path.name == "connector.py" for path in paths):
        raise PluginUnreadable(f"{package} holds no connector.py")
    try:
        files = tuple((str(path.relative_to(source)), path.read_bytes()) for path in paths)
    except OSError as exc:
        raise PluginUnreadable(f"{exc.filename}: {exc.strerror}") from None
    return Plugin(version, requires, requires_python, files)


def plugin() -> Plugin | None:
    """The plugin beside this supervisor, as its files are now; None while it cannot be read
    (the build then says why)."""
    try:
        return read_plugin()
    except PluginUnreadable:
        return None


class Current:
    """The plugin an engine compares its tier image with: read at the first ask, then again by
    each build, which installs what it read. An upgrade (install.sh) that changes the plugin's
    files under a running worker is read by the next build, and the image that build makes is
    current from then on: the files are not read at every observation, nor the image rebuilt
    at each."""

    def __init__(self) -> None:
        self._plugin: Plugin | None = None

    def get(self) -> Plugin | None:
        if self._plugin is None:
            self._plugin = plugin()
        return self._plugin

    def build(
        self,
        runtime: Runtime,
        base_ref: str,
        work: Path,
        ctx: StepContext,
        site: str = SITE_PACKAGES,
    ) -> Image:
        """build() with the plugin read afresh, kept as the current one."""
        self._plugin = plugin()
        return build(runtime, base_ref, work, ctx, site, plugin=self._plugin)


def note(image_labels: Mapping[str, str]) -> str:
    """Pure: the tier image's plugin as the status names it (its version and files), or ""
    for an image without one."""
    version, files = image_labels.get(TIERS_VERSION), image_labels.get(TIERS_DIGEST, "")
    if not version:
        return ""
    return f"KV-cache tier plugin {DISTRIBUTION} {version} (files {files[:19]})"


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def installed_files(plugin: Plugin) -> dict[str, bytes]:
    """Pure: what an installer would put in site-packages for this plugin (a pure wheel's files
    and its dist-info), by path under site-packages."""
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {DISTRIBUTION}",
        f"Version: {plugin.version}",
        *([f"Requires-Python: {plugin.requires_python}"] if plugin.requires_python else []),
        *(f"Requires-Dist: {requirement}" for requirement in plugin.requires),
    ]
    info = plugin.dist_info
    files = dict(plugin.files)
    files[f"{info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{info}/top_level.txt"] = f"{PACKAGE}\n".encode()
    files[f"{info}/INSTALLER"] = b"lucia-supervisor\n"
    record = [_record_line(path, data) for path, data in sorted(files.items())]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    return files


def tag(base_ref: str) -> str:
    """`<vllm image>-tiers`: the base's tag with a suffix (a digest reference gets a tag made of
    the digest's first 12 hex digits)."""
    name, at, digest = base_ref.partition("@")
    if at:
        return f"{name}:{digest.partition(':')[2][:12]}{SUFFIX}"
    slash = name.rfind("/")
    if ":" in name[slash + 1 :]:
        return name + SUFFIX
    return f"{name}:latest{SUFFIX}"


@functools.lru_cache(maxsize=4)  # asked at every observation of a recipe with tiers
def digest(plugin: Plugin) -> str:
    """A digest of every file the plugin installs: a changed file without a new version still
    makes another image."""
    hashed = hashlib.sha256()
    for path, data in sorted(installed_files(plugin).items()):
        hashed.update(f"{path}\0{len(data)}\0".encode())
        hashed.update(data)
    return "sha256:" + hashed.hexdigest()


def labels(plugin: Plugin, base_id: str) -> dict[str, str]:
    return {TIERS_BASE: base_id, TIERS_VERSION: plugin.version, TIERS_DIGEST: digest(plugin)}


def current(plugin: Plugin, base_id: str, image_labels: Mapping[str, str]) -> bool:
    """Pure: is an image with these labels the tier image of this base and these plugin files
    (their version and digest)?"""
    want = labels(plugin, base_id)
    return all(image_labels.get(key) == value for key, value in want.items())


def check_script(plugin: Plugin) -> str:
    """The Python the build runs in the image: the modules import, the version is the plugin's."""
    return (
        f"import importlib.metadata, {', '.join(CHECKED_MODULES)}\n"
        f"found = importlib.metadata.version({DISTRIBUTION!r})\n"
        f"if found != {plugin.version!r}:\n"
        f"    raise SystemExit(f'{DISTRIBUTION} is {{found}} in the image, not {plugin.version}')\n"
        f"print({DISTRIBUTION!r}, found, 'imports beside vllm', vllm.__version__)\n"
    )


def dockerfile(plugin: Plugin, base: str, site: str = SITE_PACKAGES) -> str:
    """FROM base (the base image's id); exec-form steps (JSON arrays): nothing is
    shell-interpreted."""
    if not _PATH.fullmatch(site):
        raise ValueError(f"site-packages path {site!r} is not a plain absolute path")
    copy = [f"{CONTEXT_SITE}/", site.rstrip("/") + "/"]
    check = [PYTHON, "-c", check_script(plugin)]
    return f"FROM {base}\nCOPY {json.dumps(copy)}\nRUN {json.dumps(check)}\n"


def write_context(plugin: Plugin, base_id: str, directory: Path, site: str = SITE_PACKAGES) -> Path:
    """Write the build context (Dockerfile FROM base_id, the installed files) into an empty
    directory. The copied files are 0644 and their directories 0755 whatever the umask says
    (the unit's is 0027): the engine, which runs as the service user, not root, reads them."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise ValueError(f"build context {directory} is not empty")
    copied = directory / CONTEXT_SITE
    for relative, data in installed_files(plugin).items():
        path = copied / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o644)
    for made in (copied, *(p for p in copied.rglob("*") if p.is_dir())):
        made.chmod(0o755)
    (directory / "Dockerfile").write_text(dockerfile(plugin, base_id, site))
    return directory


def build_request(
    plugin: Plugin, base_ref: str, base_id: str, context: Path, *, nocache: bool = False
) -> BuildRequest:
    """The build of `tag(base_ref)` from a context write_context made for base_id."""
    return BuildRequest(
        tag=tag(base_ref),
        labels=labels(plugin, base_id),
        context=str(context),
        nocache=nocache,
    )


def transfer_config(settings: Mapping[str, str | int] | None = None) -> str:
    """The `--kv-transfer-config` JSON that selects the connector, with settings (tier dirs and
    caps, namespace, metrics_file) in its extra config; the cache key is refused (argv)."""
    extra = dict(settings or {})
    unknown = sorted(set(extra) - _SETTINGS)
    if unknown:
        raise ValueError(f"not a tier setting for --kv-transfer-config: {', '.join(unknown)}")
    config = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    return json.dumps(config, sort_keys=True)


def build(
    runtime: Runtime,
    base_ref: str,
    work: Path,
    ctx: StepContext,
    site: str = SITE_PACKAGES,
    *,
    plugin: Plugin | None = None,
) -> Image:
    """Build `tag(base_ref)` FROM base_ref's image from a context written fresh under work
    (removed after), its output lines the heartbeat's message; with plugin, or the plugin read
    now. A plugin that cannot be read or a failed build is a BuildFailed that says what to do
    next."""
    target = tag(base_ref)
    what = f"adding the KV cache tiers to {base_ref} ({target})"
    base = runtime.image(base_ref)
    if base is None:
        raise Blocked(f"the engine image {base_ref} is missing; it is pulled again")
    try:
        plugin = plugin or read_plugin()
    except PluginUnreadable as exc:
        raise BuildFailed(what, [str(exc), NEXT_STEP]) from None
    ctx.progress(MESSAGE)
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    context = Path(tempfile.mkdtemp(prefix="tier-context-", dir=work))
    try:
        write_context(plugin, base.id, context, site)
        return runtime.build(
            build_request(plugin, base_ref, base.id, context),
            lambda line: ctx.progress(f"{MESSAGE}: {line}"),
            ctx.cancel,
        )
    except BuildFailed as exc:
        raise BuildFailed(what, [*exc.lines, NEXT_STEP]) from None
    finally:
        shutil.rmtree(context, ignore_errors=True)
