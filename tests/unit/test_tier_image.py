"""The KV tier image as a description: plugin, installed files, Dockerfile, labels, config."""

from __future__ import annotations

import base64
import dataclasses
import email.parser
import hashlib
import json
import os
import shutil
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from supervisor.docker.labels import TIERS_BASE, TIERS_DIGEST, TIERS_VERSION
from supervisor.engines.vllm import tier_image
from supervisor.engines.vllm.tier_image import Plugin, PluginUnreadable

BASE = "sha256:" + "ab" * 32


@pytest.fixture
def plugin() -> Plugin:
    return tier_image.read_plugin()


def _copy(tmp_path: Path) -> Path:
    source = tmp_path / "kvplugin"
    shutil.copytree(tier_image.SOURCE, source, ignore=shutil.ignore_patterns("__pycache__"))
    return source


def test_the_version_is_the_plugins_own_metadata(plugin: Plugin) -> None:
    assert plugin.version == "0.1.0"
    assert plugin.requires == ("cryptography>=42",)
    paths = [path for path, _ in plugin.files]
    assert paths == sorted(paths)
    assert {"lucia_kv/__init__.py", "lucia_kv/connector.py", "lucia_kv/py.typed"} <= set(paths)
    assert not any("__pycache__" in path for path in paths)


def _project(tmp_path: Path) -> Path:
    """The project's tracked (and new) files, as a user's copy: pip builds there, never here."""
    import subprocess

    root = tier_image.SOURCE.parent
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    project = tmp_path / "project"
    for name in filter(None, listed):
        relative = Path(name.decode())
        if (root / relative).is_file():
            (project / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / relative, project / relative)
    return project


def test_the_installed_package_ships_the_plugin_with_the_source_trees_version_and_digest(
    plugin: Plugin, tmp_path: Path
) -> None:
    """pip installs the project (not editable) into a directory of its own; its supervisor,
    run isolated (the checkout off its path), reads the plugin installed beside it."""
    import subprocess
    import sys

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "-q",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(_project(tmp_path)),
        ],
        check=True,
    )
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "from supervisor.engines.vllm import tier_image as t\n"
        "p = t.read_plugin()\n"
        "print(json.dumps([t.__file__, str(t.SOURCE), p.version, t.digest(p)]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    module, source, version, digest = json.loads(run.stdout)
    assert Path(module).is_relative_to(site) and Path(source) == site / "kvplugin"
    assert (version, digest) == (plugin.version, tier_image.digest(plugin))


def test_the_plugins_own_version_is_its_pyprojects_whatever_else_is_installed(
    plugin: Plugin, tmp_path: Path
) -> None:
    """lucia_kv.version() (the namespace binding in the container) and the supervisor's
    read_plugin() (its labels and namespaces) read the same file: another copy's metadata
    earlier on the path does not change it."""
    import subprocess
    import sys

    import lucia_kv

    assert lucia_kv.version() == plugin.version
    stale = tmp_path / "stale"
    info = stale / "lucia_kv_tiers-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lucia-kv-tiers\nVersion: 0.0.1\n")
    plugin_root = tier_image.SOURCE
    script = "import lucia_kv; print(lucia_kv.version())"
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": f"{stale}:{plugin_root}"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == plugin.version
    # inside the image no pyproject.toml is beside the package: the metadata installed with it
    site = tmp_path / "site"
    for relative, data in tier_image.installed_files(plugin).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == plugin.version


def test_a_version_bump_in_pyproject_is_seen_without_importing_the_plugin(tmp_path: Path) -> None:
    source = _copy(tmp_path)
    pyproject = source / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.2.0"'))
    assert tier_image.read_plugin(source).version == "0.2.0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('name = "lucia-kv-tiers"', 'name = "other"'), "names 'other', not 'lucia-kv-tiers'"),
        (('version = "0.1.0"', 'version = "0.1.0 ; rm"'), "is not a version"),
        (('version = "0.1.0"', ""), "no \\[project\\] name and version"),
        (("[project]", "[project"), "no \\[project\\] name and version"),
    ],
)
def test_a_bad_pyproject_is_one_clear_error(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    source = _copy(tmp_path)
    pyproject = source / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(*change))
    with pytest.raises(PluginUnreadable, match=message):
        tier_image.read_plugin(source)


def test_a_source_without_the_connector_is_refused(tmp_path: Path) -> None:
    source = _copy(tmp_path)
    (source / "lucia_kv" / "connector.py").unlink()
    with pytest.raises(PluginUnreadable, match=r"holds no connector\.py"):
        tier_image.read_plugin(source)
    with pytest.raises(PluginUnreadable, match=r"pyproject\.toml"):
        tier_image.read_plugin(tmp_path / "nowhere")


def test_the_installed_files_are_a_distribution_importlib_reads(
    plugin: Plugin, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    for relative, data in tier_image.installed_files(plugin).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    found = next(iter(metadata.distributions(path=[str(site)])))
    assert found.metadata["Name"] == "lucia-kv-tiers"
    assert found.version == plugin.version
    assert found.requires == ["cryptography>=42"]
    record = found.read_text("RECORD") or ""
    rows = [line.split(",") for line in record.splitlines()]
    assert [path for path, _, _ in rows][-1] == f"{plugin.dist_info}/RECORD"
    for path, digest, size in rows[:-1]:
        data = (site / path).read_bytes()
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={want}", len(data)), path


def test_the_installed_files_are_what_pip_wheel_would_install(
    plugin: Plugin, tmp_path: Path
) -> None:
    """The same package files and metadata fields as the wheel setuptools builds."""
    import subprocess
    import sys

    out = tmp_path / "wheel"
    source = _copy(tmp_path)  # pip builds in the tree: never in kvplugin/ itself
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
    )
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        built = {name: archive.read(name) for name in names if name.startswith("lucia_kv/")}
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        fields = email.parser.BytesParser().parsebytes(archive.read(info))
    ours = tier_image.installed_files(plugin)
    assert {path: ours[path] for path in built} == built
    assert set(path for path in ours if path.startswith("lucia_kv/")) == set(built)
    assert info.split("/")[0] == plugin.dist_info
    mine = email.parser.BytesParser().parsebytes(ours[f"{plugin.dist_info}/METADATA"])
    for key in ("Name", "Version", "Requires-Python", "Requires-Dist"):
        assert mine.get_all(key) == fields.get_all(key), key


def test_labels_and_current(plugin: Plugin) -> None:
    labels = tier_image.labels(plugin, BASE)
    assert labels == {
        TIERS_BASE: BASE,
        TIERS_VERSION: "0.1.0",
        TIERS_DIGEST: tier_image.digest(plugin),
    }
    assert tier_image.current(plugin, BASE, {**labels, "other": "x"})
    assert not tier_image.current(plugin, "sha256:" + "cd" * 32, labels), "a new base"
    assert not tier_image.current(plugin, BASE, {**labels, TIERS_VERSION: "0.0.9"}), "a new plugin"
    assert not tier_image.current(plugin, BASE, {})


def test_a_changed_plugin_file_without_a_new_version_is_another_image(plugin: Plugin) -> None:
    labels = tier_image.labels(plugin, BASE)
    path, data = plugin.files[0]
    edited = dataclasses.replace(plugin, files=((path, data + b"# fixed\n"), *plugin.files[1:]))
    assert edited.version == plugin.version
    assert tier_image.digest(edited) != tier_image.digest(plugin)
    assert not tier_image.current(edited, BASE, labels), "the old files' image is not current"
    assert tier_image.current(edited, BASE, tier_image.labels(edited, BASE))


@pytest.mark.parametrize(
    ("base", "tag"),
    [
        ("lucia-vllm-cpu:0.32.0-torch2.13.0", "lucia-vllm-cpu:0.32.0-torch2.13.0-tiers"),
        ("vllm/vllm-openai:v0.32.0-cu129", "vllm/vllm-openai:v0.32.0-cu129-tiers"),
        ("localhost:5000/vllm", "localhost:5000/vllm:latest-tiers"),
        ("vllm@sha256:" + "0123456789ab" + "f" * 52, "vllm:0123456789ab-tiers"),
    ],
)
def test_the_tag_is_the_base_with_tiers(base: str, tag: str) -> None:
    assert tier_image.tag(base) == tag


def test_the_dockerfile_copies_onto_the_python_path_and_checks_in_exec_form(
    plugin: Plugin,
) -> None:
    lines = tier_image.dockerfile(plugin, BASE).splitlines()
    assert lines[0] == f"FROM {BASE}"
    assert json.loads(lines[1].removeprefix("COPY ")) == [
        "site-packages/",
        "/opt/vllm/site-packages/",
    ]
    check = json.loads(lines[2].removeprefix("RUN "))
    assert check[:2] == ["/usr/bin/python3", "-c"]
    assert check[2] == tier_image.check_script(plugin)
    assert "import importlib.metadata, lucia_kv.connector, vllm, cryptography" in check[2]
    with pytest.raises(ValueError, match="not a plain absolute path"):
        tier_image.dockerfile(plugin, BASE, site="/opt/x; rm -rf /")


def test_the_check_script_refuses_another_version(plugin: Plugin, tmp_path: Path) -> None:
    """Run the check beside fake modules: the wrong installed version fails it."""
    import subprocess
    import sys

    site = tmp_path / "site"
    for relative, data in tier_image.installed_files(plugin).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    (site / "vllm.py").write_text("__version__ = 'fake'\n")
    (site / "lucia_kv" / "connector.py").write_text("")
    env = {"PYTHONPATH": str(site)}

    def check(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
        )

    good = check(tier_image.check_script(plugin))
    assert (good.returncode, good.stdout) == (0, "lucia-kv-tiers 0.1.0 imports beside vllm fake\n")
    newer = Plugin("0.2.0", plugin.requires, plugin.requires_python, plugin.files)
    bad = check(tier_image.check_script(newer))
    assert bad.returncode == 1
    assert bad.stderr.strip() == "lucia-kv-tiers is 0.1.0 in the image, not 0.2.0"


def test_the_context_holds_the_dockerfile_and_the_files(plugin: Plugin, tmp_path: Path) -> None:
    before = os.umask(0o027)  # the unit's UMask
    try:
        context = tier_image.write_context(plugin, BASE, tmp_path / "context")
    finally:
        os.umask(before)
    assert (context / "Dockerfile").read_text() == tier_image.dockerfile(plugin, BASE)
    connector = context / "site-packages" / "lucia_kv" / "connector.py"
    assert connector.read_bytes() == (tier_image.SOURCE / "lucia_kv" / "connector.py").read_bytes()
    assert (connector.stat().st_mode & 0o777) == 0o644
    site = context / "site-packages"
    for path in (site, *site.rglob("*")):  # what the engine, not root, must read
        assert (path.stat().st_mode & 0o777) == (0o755 if path.is_dir() else 0o644), path
    with pytest.raises(ValueError, match="is not empty"):
        tier_image.write_context(plugin, BASE, context)
    request = tier_image.build_request(plugin, "lucia-vllm-cpu:1", BASE, context, nocache=True)
    assert (request.tag, request.context, request.nocache) == (
        "lucia-vllm-cpu:1-tiers",
        str(context),
        True,
    )
    assert request.labels == tier_image.labels(plugin, BASE)


def test_the_transfer_config_selects_the_connector_with_recompute() -> None:
    config = json.loads(tier_image.transfer_config({"nvme_dir": "/kv/nvme", "nvme_bytes": 5}))
    assert config == {
        "kv_connector": "LuciaTierConnector",
        "kv_connector_module_path": "lucia_kv.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"nvme_dir": "/kv/nvme", "nvme_bytes": 5},
    }
    assert json.loads(tier_image.transfer_config())["kv_connector_extra_config"] == {}


@pytest.mark.parametrize("name", ["key", "nvme_path", "LUCIA_KV_KEY"])
def test_the_transfer_config_refuses_what_is_no_setting(name: str) -> None:
    with pytest.raises(ValueError, match=f"not a tier setting for --kv-transfer-config: {name}"):
        tier_image.transfer_config({name: "x"})


@pytest.mark.parametrize(
    "settings", [{"buffer_bytes": 64 << 20}, {"queue_bytes": 1 << 30, "buffer_bytes": 1 << 20}]
)
def test_the_transfer_config_passes_the_plugins_byte_bounds(settings: dict[str, int]) -> None:
    extra = json.loads(tier_image.transfer_config(settings))["kv_connector_extra_config"]
    assert extra == settings
