"""KV-cache tiers: namespaces as tables, the container's share as a table, and the directories
on the real file system (modes, ownership, symlinks, a namespace change)."""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.engines.vllm import tiers as kv
from supervisor.engines.vllm.tiers import (
    CacheIdentity,
    DiskTier,
    KvLayout,
    Parallel,
    TierPlan,
    TierRefused,
)

GIB = 1024**3
KEY = "k" * 64

BASE = CacheIdentity(
    model_manifest=kv.hf_manifest("Qwen/Qwen3-8B", "a" * 40),
    image_digest="sha256:" + "1" * 64,
    plugin_version="0.3.1",
    key_id=kv.key_id(KEY),
    layout=KvLayout(dtype="auto", block_size=16, layers=36, kv_heads=8, head_dim=128),
    parallel=Parallel(tensor=1, pipeline=1),
    engine_args=("quantization=none",),
)

CHANGES = {
    "model revision": {"model_manifest": kv.hf_manifest("Qwen/Qwen3-8B", "b" * 40)},
    "model id": {"model_manifest": kv.hf_manifest("Qwen/Qwen3-4B", "a" * 40)},
    "library file digest": {"model_manifest": kv.library_manifest("g1", {"m.safetensors": "x"})},
    "image digest": {"image_digest": "sha256:" + "2" * 64},
    "plugin version": {"plugin_version": "0.3.2"},
    "key rotation": {"key_id": kv.key_id("j" * 64)},
    "kv dtype": {"layout": replace(BASE.layout, dtype="fp8")},
    "block size": {"layout": replace(BASE.layout, block_size=32)},
    "layers": {"layout": replace(BASE.layout, layers=None)},
    "tensor parallel": {"parallel": Parallel(tensor=2)},
    "pipeline parallel": {"parallel": Parallel(pipeline=2)},
    "data parallel": {"parallel": Parallel(data=2)},
    "quantization": {"engine_args": ("quantization=fp8",)},
    "extra arguments": {"engine_args": ("quantization=none", "--dtype", "float16")},
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_any_change_gives_another_namespace(change: str) -> None:
    changed = replace(BASE, **CHANGES[change])  # type: ignore[arg-type]
    assert kv.namespace(changed) != kv.namespace(BASE)


def test_the_namespace_is_stable_and_all_namespaces_differ() -> None:
    assert kv.namespace(BASE) == kv.namespace(replace(BASE))
    spaces = {kv.namespace(replace(BASE, **c)) for c in CHANGES.values()}  # type: ignore[arg-type]
    assert len(spaces) == len(CHANGES)
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in spaces)


def test_the_key_id_is_an_hmac_never_the_key() -> None:
    ident = kv.key_id(KEY)
    assert ident == kv.key_id(KEY.encode()) and len(ident) == 16
    assert KEY not in ident and KEY[:8] not in ident
    assert ident != kv.key_id(KEY + "x")
    assert KEY not in kv.namespace(BASE)


PLAN = TierPlan(
    shm_bytes=8 * GIB,
    shm_size=10 * GIB,
    memory=26 * GIB,
    disks=(
        DiskTier("nvme", Path("/srv/nvme/kv"), 16 * GIB),
        DiskTier("hdd", Path("/srv/hdd/kv"), 256 * GIB),
    ),
)


@pytest.mark.parametrize(
    ("key", "refused"),
    [
        ("0123456789abcdef" * 4, False),  # openssl rand -hex 32
        ("0123456789ABCDEF" * 4, False),
        ("0123456789abcdef" * 2, True),  # 16 bytes (a uuid4's hex)
        ("0123456789abcdef" * 4 + "0", True),
        ("k" * 64, True),  # 64 characters, not hex
        ("a passphrase long enough to pass a length check", True),
        ("", True),
    ],
)
def test_only_64_hex_digits_are_a_cache_key(key: str, refused: bool) -> None:
    why = kv.key_refused(key)
    assert (why is not None) == refused
    if why is not None:
        assert why == kv.KEY_RULE and "openssl rand -hex 32" in why
        assert not key or key not in why


def test_what_the_container_gets_in_the_prepared_configuration() -> None:
    space = kv.namespace(BASE)
    got = kv.container(PLAN, space, BASE.key_id)
    assert got.volumes == (
        (f"/srv/nvme/kv/{space}", "/kv/nvme"),
        (f"/srv/hdd/kv/{space}", "/kv/hdd"),
    )
    assert got.environment == {
        "LUCIA_KV_NAMESPACE": space,
        "LUCIA_KV_KEY_ID": BASE.key_id,
        "LUCIA_KV_SHM_DIR": f"/dev/shm/lucia-kv/{space}",
        "LUCIA_KV_SHM_BYTES": str(8 * GIB),
        "LUCIA_KV_NVME_DIR": "/kv/nvme",
        "LUCIA_KV_NVME_BYTES": str(16 * GIB),
        "LUCIA_KV_HDD_DIR": "/kv/hdd",
        "LUCIA_KV_HDD_BYTES": str(256 * GIB),
    }
    assert not any(name == "LUCIA_KV_KEY" for name in got.environment)  # a file, elsewhere
    assert KEY not in repr(got)
    assert (got.shm_size, got.memory) == (10 * GIB, 26 * GIB)


def test_a_data_parallel_engine_tells_the_plugin_its_size() -> None:
    got = kv.container(replace(PLAN, data_parallel=4), kv.namespace(BASE), BASE.key_id)
    assert got.environment["LUCIA_KV_DATA_PARALLEL_SIZE"] == "4"


@pytest.mark.parametrize(
    ("args", "size"),
    [
        ((), 1),
        (("--dtype", "float16"), 1),
        (("--data-parallel-size", "2"), 2),
        (("--data-parallel-size=4",), 4),
        (("-dp", "3", "--enforce-eager"), 3),
        (("--data_parallel_size", "2"), 2),
        (("-dp", "2", "--data-parallel-size", "8"), 8),  # the last wins, as in argparse
        (("--data-parallel-size",), 1),  # no value: vLLM refuses it itself
        (("--data-parallel-size", "two"), 1),
        (("--data-parallel-size-local", "2"), 1),  # another flag
        (("--data-parallel-rank", "1"), 1),
    ],
)
def test_the_data_parallel_size_from_the_extra_arguments(args: tuple[str, ...], size: int) -> None:
    assert kv.data_parallel(args) == size


def test_no_disk_tiers_means_no_mounts() -> None:
    got = kv.container(replace(PLAN, disks=()), kv.namespace(BASE), BASE.key_id)
    assert got.volumes == () and "LUCIA_KV_NVME_DIR" not in got.environment


# --- the real file system ----------------------------------------------------------------------

SPACE = kv.namespace(BASE)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_created_root_parents_and_namespace_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0)  # a permissive umask must not widen what is created
    try:
        directory = kv.prepare(tmp_path / "a" / "b" / "nvme", SPACE)
    finally:
        os.umask(old)
    assert directory == tmp_path / "a" / "b" / "nvme" / SPACE
    for path in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "nvme", directory):
        assert mode(path) == 0o700, path
        assert os.lstat(path).st_uid == os.geteuid()


def test_prepare_again_and_a_namespace_change(tmp_path: Path) -> None:
    root = tmp_path / "hdd"
    first = kv.prepare(root, SPACE)
    (first / "block").write_bytes(b"x")
    assert kv.prepare(root, SPACE) == first and (first / "block").exists()
    other = kv.namespace(replace(BASE, key_id=kv.key_id("rotated")))
    second = kv.prepare(root, other)
    assert second != first and not any(second.iterdir())
    assert kv.stale(root, other) == [first]
    assert kv.stale(root, SPACE) == [second]
    (root / "not-a-namespace").mkdir()
    assert kv.stale(root, other) == [first]


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(TierRefused, match="symbolic link"):
        kv.prepare(tmp_path / "link", SPACE)


def test_a_symlinked_namespace_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / SPACE).symlink_to(elsewhere)
    with pytest.raises(TierRefused, match="symbolic link"):
        kv.prepare(root, SPACE)


@pytest.mark.parametrize("too_open", [0o755, 0o750, 0o701, 0o777])
def test_a_root_open_to_others_is_refused(tmp_path: Path, too_open: int) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    root.chmod(too_open)
    with pytest.raises(TierRefused, match=f"mode {too_open:04o}.*chmod 700"):
        kv.prepare(root, SPACE)
    assert not (root / SPACE).exists()


def test_an_existing_namespace_open_to_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir(mode=0o700)
    (root / SPACE).mkdir()
    (root / SPACE).chmod(0o755)
    with pytest.raises(TierRefused, match="0755"):
        kv.prepare(root, SPACE)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(TierRefused, match="owned by uid 65534"):
        kv.prepare(root, SPACE)


def test_the_owner_is_the_workers_user(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with pytest.raises(TierRefused, match=f"owned by uid {os.geteuid()}, not 4242"):
        kv.prepare(root, SPACE, uid=4242)


@pytest.mark.parametrize(
    ("root", "space", "needle"),
    [
        (Path("relative/nvme"), SPACE, "absolute"),
        (Path("/tmp/x"), "../../etc", "not a namespace"),
        (Path("/tmp/x"), SPACE.upper(), "not a namespace"),
    ],
)
def test_bad_inputs(root: Path, space: str, needle: str) -> None:
    with pytest.raises(TierRefused, match=needle):
        kv.prepare(root, space)


# -- two workers making one root at once ---------------------------------------------------------


def _another_worker_first(
    monkeypatch: pytest.MonkeyPatch, mode: int = 0o700, kind: str = "directory"
) -> list[str]:
    """Each missing directory on the way to a root is made by another worker just before this
    one's mkdir (the interleaving two workers started together can run in): this one's mkdir
    then finds it there."""
    real = os.mkdir
    raced: list[str] = []

    def mkdir(path: str | Path, mode_: int = 0o777, *, dir_fd: int | None = None) -> None:
        if dir_fd is None and not os.path.lexists(path):
            raced.append(str(path))
            if kind == "directory":
                real(path, 0o700)
                os.chmod(path, mode)
            else:
                Path(path).write_bytes(b"")
        real(path, mode_, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return raced


def test_a_root_another_worker_makes_at_the_same_time_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raced = _another_worker_first(monkeypatch)
    directory = kv.prepare(tmp_path / "a" / "b" / "nvme", SPACE)
    assert raced == [
        str(tmp_path / "a"),
        str(tmp_path / "a" / "b"),
        str(tmp_path / "a" / "b" / "nvme"),
    ]
    assert directory == tmp_path / "a" / "b" / "nvme" / SPACE and directory.is_dir()
    assert all(mode(Path(path)) == 0o700 for path in raced)


@pytest.mark.parametrize(
    ("made", "needle"),
    [
        (
            {"mode": 0o755},
            "appeared with owner .* and mode 0755; it must be owned by uid .* with mode 0700",
        ),
        ({"kind": "file"}, "appeared and is not a directory"),
    ],
)
def test_a_root_that_appears_open_to_others_or_not_a_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: dict[str, object], needle: str
) -> None:
    _another_worker_first(monkeypatch, **made)  # type: ignore[arg-type]
    with pytest.raises(TierRefused, match=needle):
        kv.prepare(tmp_path / "nvme", SPACE)


def test_workers_making_one_root_at_once_all_take_it(tmp_path: Path) -> None:
    """A real race: threads released together make the same deep root, round after round."""
    for round_ in range(40):
        root = tmp_path / str(round_) / "x" / "y" / "nvme"
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def make(
            root: Path = root,
            start: threading.Barrier = start,
            errors: list[BaseException] = errors,
        ) -> None:
            start.wait()
            try:
                kv.prepare(root, SPACE)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=make) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], errors
        assert mode(root) == 0o700 and (root / SPACE).is_dir()
