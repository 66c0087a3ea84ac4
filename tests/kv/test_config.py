"""The plugin's configuration: extra config wins over the environment; bad input is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lucia_kv import version
from lucia_kv.config import ConfigError, for_rank, resolve

KEY = "00112233445566778899aabbccddeeff" * 2  # 64 hex digits: openssl rand -hex 32


def env(tmp_path: Path, **more: str) -> dict[str, str]:
    base = {
        "LUCIA_KV_NAMESPACE": "0123abcd",
        "LUCIA_KV_NVME_DIR": str(tmp_path / "nvme"),
        "LUCIA_KV_NVME_BYTES": "1048576",
        "LUCIA_KV_HDD_DIR": str(tmp_path / "hdd"),
        "LUCIA_KV_HDD_BYTES": "4194304",
        "LUCIA_KV_KEY": KEY,
    }
    base.update(more)
    return base


def test_environment_gives_tiers_fastest_first(tmp_path: Path) -> None:
    found = resolve({}, env(tmp_path, LUCIA_KV_SHM_DIR="/dev/shm/x", LUCIA_KV_SHM_BYTES="4096"))
    assert [t.name for t in found.tiers] == ["shm", "nvme", "hdd"]
    assert found.tiers[2].max_bytes == 4194304
    assert found.key == bytes.fromhex(KEY) and len(found.key) == 32
    assert found.plugin_version == version() == "0.1.0"


def test_extra_config_wins_over_environment(tmp_path: Path) -> None:
    found = resolve({"hdd_bytes": 8192, "namespace": "other", "writers": 3}, env(tmp_path))
    assert found.namespace == "other"
    assert found.tiers[-1].max_bytes == 8192
    assert found.writers == 3


def test_key_file_is_preferred_to_the_key_variable(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(b"ABCDEF" + b"0" * 58 + b"\n")  # `openssl rand -hex 32`'s line
    os.chmod(secret, 0o600)
    found = resolve({}, env(tmp_path, LUCIA_KV_KEY_FILE=str(secret)))
    assert found.key == bytes.fromhex("abcdef" + "0" * 58)


def test_key_never_shows_in_repr(tmp_path: Path) -> None:
    assert KEY not in repr(resolve({}, env(tmp_path)))


@pytest.mark.parametrize(
    ("extra", "more", "message"),
    [
        ({"key": KEY}, {}, "must not be in kv_connector_extra_config"),
        ({}, {"LUCIA_KV_KEY": "short"}, "exactly 64 hex digits"),
        ({}, {"LUCIA_KV_NAMESPACE": "../escape"}, "namespace"),
        ({}, {"LUCIA_KV_HDD_BYTES": "lots"}, "hdd_bytes must be a number"),
        ({}, {"LUCIA_KV_HDD_BYTES": "-1"}, "must not be negative"),
        ({}, {"LUCIA_KV_NVME_DIR": "relative/dir"}, "absolute path"),
        ({"nvme_bytes": 0, "hdd_bytes": 0}, {}, "no tier"),
        ({"writers": 0}, {}, "writers must be at least 1"),
        ({"buffer_bytes": 0}, {}, "buffer_bytes must be at least 1"),
        ({}, {"LUCIA_KV_BUFFER_BYTES": "big"}, "buffer_bytes must be a number"),
        ({}, {"LUCIA_KV_BUFFER_BYTES": "-4096"}, "buffer_bytes must not be negative"),
    ],
)
def test_bad_settings_are_refused_clearly(
    tmp_path: Path, extra: dict[str, object], more: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        resolve(extra, env(tmp_path, **more))
    assert KEY not in str(caught.value)


def test_key_file_open_to_others_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(KEY.encode())
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve({}, env(tmp_path, LUCIA_KV_KEY_FILE=str(secret)))


@pytest.mark.parametrize(
    "text",
    [
        b"",  # no key
        b"0123456789abcdef0123456789abcdef",  # 32 hex digits (a uuid4's 16 bytes)
        b"0123456789abcdef" * 4 + b"00",  # 66 hex digits
        b"the first cache key, 32 bytes ok",  # a passphrase
        b"g" + b"0" * 63,  # 64 characters, one not hex
        b"0" * 32 + b" " + b"0" * 31,  # space inside
        b"0x" + b"0" * 62,
    ],
)
def test_only_64_hex_digits_are_a_key(tmp_path: Path, text: bytes) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(text + b"\n")
    os.chmod(secret, 0o600)
    with pytest.raises(ConfigError, match=r"exactly 64 hex digits \(32 random bytes") as caught:
        resolve({}, env(tmp_path, LUCIA_KV_KEY_FILE=str(secret)))
    if text:
        assert text.decode() not in str(caught.value)


def test_missing_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key file"):
        resolve({}, env(tmp_path, LUCIA_KV_KEY_FILE=str(tmp_path / "absent")))


def test_each_parallel_rank_owns_a_share(tmp_path: Path) -> None:
    whole = resolve({}, env(tmp_path))
    assert for_rank(whole, 0, 1) == whole
    share = for_rank(whole, 1, 2)
    assert share.rank == "rank1"
    assert [t.directory for t in share.tiers] == [
        tmp_path / "nvme" / "rank1",
        tmp_path / "hdd" / "rank1",
    ]
    assert [t.max_bytes for t in share.tiers] == [524288, 2097152]


@pytest.mark.parametrize(
    ("rank", "ranks", "dp_rank", "dp_size", "configured", "below", "share"),
    [
        (0, 1, 0, 1, 1, "", 1),  # one engine, one rank: the namespace directory itself
        (1, 2, 0, 1, 1, "rank1", 2),
        (0, 1, 1, 2, 1, "dp1", 2),  # a MoE model's data-parallel rank reports its size
        (1, 2, 1, 2, 1, "dp1/rank1", 4),
        (0, 1, 0, 1, 2, "dp0", 2),  # a dense model's ranks report size 1: the setting says 2
        (0, 1, 1, 1, 2, "dp1", 2),
        (0, 1, 3, 1, 1, "dp3", 4),  # an index without a size still gets its own directory
    ],
)
def test_each_parallel_and_data_parallel_rank_owns_a_share(
    tmp_path: Path,
    rank: int,
    ranks: int,
    dp_rank: int,
    dp_size: int,
    configured: int,
    below: str,
    share: int,
) -> None:
    whole = resolve({"data_parallel_size": configured}, env(tmp_path))
    found = for_rank(whole, rank, ranks, dp_rank, dp_size)
    assert found.rank == below
    assert [t.directory for t in found.tiers] == [
        tmp_path / "nvme" / below if below else tmp_path / "nvme",
        tmp_path / "hdd" / below if below else tmp_path / "hdd",
    ]
    assert [t.max_bytes for t in found.tiers] == [1048576 // share, 4194304 // share]


@pytest.mark.parametrize(("dp_size", "ranks"), [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("reported", ["moe", "dense"])
def test_no_two_ranks_share_or_nest_a_directory(
    tmp_path: Path, dp_size: int, ranks: int, reported: str
) -> None:
    """Every rank of every data-parallel engine: its own directory, none inside another's,
    and the shares add up to no more than the cap."""
    whole = resolve({"data_parallel_size": dp_size}, env(tmp_path))
    shares = [
        for_rank(whole, rank, ranks, dp, dp_size if reported == "moe" else 1)
        for dp in range(dp_size)
        for rank in range(ranks)
    ]
    directories = [share.tiers[0].directory for share in shares]
    assert len(set(directories)) == dp_size * ranks
    for one in directories:
        assert not any(one != other and one.is_relative_to(other) for other in directories)
    assert len({share.rank for share in shares}) == dp_size * ranks
    assert sum(share.tiers[0].max_bytes for share in shares) <= whole.tiers[0].max_bytes


def test_the_data_parallel_size_comes_from_the_environment(tmp_path: Path) -> None:
    assert resolve({}, env(tmp_path)).data_parallel_size == 1
    found = resolve({}, env(tmp_path, LUCIA_KV_DATA_PARALLEL_SIZE="4"))
    assert found.data_parallel_size == 4
    with pytest.raises(ConfigError, match="data_parallel_size must be at least 1"):
        resolve({}, env(tmp_path, LUCIA_KV_DATA_PARALLEL_SIZE="0"))


@pytest.mark.parametrize(
    ("extra", "more", "expected"),
    [
        ({}, {}, 256 * 1024 * 1024),
        ({}, {"LUCIA_KV_BUFFER_BYTES": "1048576"}, 1048576),
        ({"buffer_bytes": 65536}, {"LUCIA_KV_BUFFER_BYTES": "1048576"}, 65536),
    ],
    ids=["default", "environment", "extra config wins"],
)
def test_the_host_buffer_is_a_setting(
    tmp_path: Path, extra: dict[str, object], more: dict[str, str], expected: int
) -> None:
    assert resolve(extra, env(tmp_path, **more)).buffer_bytes == expected
