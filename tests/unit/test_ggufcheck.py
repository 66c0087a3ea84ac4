"""GGUF checks: the 8-byte header on real files, and grouping files into servable units."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.library import ggufcheck
from supervisor.library.ggufcheck import (
    Rejected,
    Unit,
    check_header,
    group,
    header_problem,
    is_mmproj,
    name_problem,
    split_part,
    unit_name,
)
from tests.gguf_fixtures import break_magic, set_version, write_gguf, write_mmproj, write_split

# --- the header ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        (b"GGUF\x03\x00\x00\x00", None),
        (b"GGUF\x02\x00\x00\x00", None),
        (b"GGUF\x01\x00\x00\x00", "GGUF version 1 (only versions 2 and 3 are supported)"),
        (b"GGUF\x04\x00\x00\x00", "GGUF version 4 (only versions 2 and 3 are supported)"),
        (b"GGUF\x00\x00\x00\x03", "GGUF version 50331648 (only versions 2 and 3 are supported)"),
        (b"GGML\x03\x00\x00\x00", "not a GGUF file (does not start with GGUF)"),
        (b"<htm", "not a GGUF file (does not start with GGUF)"),
        (b"", "not a GGUF file (does not start with GGUF)"),
        (b"GGUF\x03", "truncated GGUF header (5 bytes)"),
    ],
)
def test_header_problem(head: bytes, problem: str | None) -> None:
    assert header_problem(head) == problem


def test_real_files_pass_and_patched_ones_are_refused(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf")
    assert good.read_bytes()[:8] == b"GGUF\x03\x00\x00\x00"  # the real writer's header
    assert check_header(good) is None
    assert check_header(set_version(write_gguf(tmp_path / "v2.gguf"), 2)) is None
    for version in (1, 4):
        path = set_version(write_gguf(tmp_path / f"v{version}.gguf"), version)
        assert check_header(path) == f"GGUF version {version} (only versions 2 and 3 are supported)"
    assert check_header(break_magic(write_gguf(tmp_path / "bad.gguf"))) == (
        "not a GGUF file (does not start with GGUF)"
    )
    for shard in write_split(tmp_path / "split", "s", 3):
        assert check_header(shard) is None
    assert check_header(write_mmproj(tmp_path / "mmproj-F16.gguf")) is None


def test_check_header_reads_eight_bytes_and_refuses_what_is_not_a_plain_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = write_gguf(tmp_path / "good.gguf", elements=4096)
    reads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    assert check_header(good) is None
    assert reads == [8]
    monkeypatch.undo()

    (tmp_path / "link.gguf").symlink_to(good)
    assert check_header(tmp_path / "link.gguf") == "is a symlink"
    assert check_header(tmp_path / "absent.gguf") == "cannot be opened: No such file or directory"
    (tmp_path / "dir.gguf").mkdir()
    assert check_header(tmp_path / "dir.gguf") == "not a regular file"
    os.mkfifo(tmp_path / "fifo.gguf")
    assert check_header(tmp_path / "fifo.gguf") == "not a regular file"  # and does not block


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "split", "unit"),
    [
        ("Qwen3-8B-Q4_K_M.gguf", None, "Qwen3-8B-Q4_K_M"),
        ("Kimi-K2-UD-IQ1_S-00001-of-00006.gguf", ("Kimi-K2-UD-IQ1_S", 1, 6), "Kimi-K2-UD-IQ1_S"),
        ("Kimi-K2-UD-IQ1_S-00006-of-00006.gguf", ("Kimi-K2-UD-IQ1_S", 6, 6), "Kimi-K2-UD-IQ1_S"),
        ("m-0001-of-0003.gguf", None, "m-0001-of-0003"),  # four digits: not the split pattern
        ("m-00001-of-00003.gguf.part", None, "m-00001-of-00003.gguf.part"),
    ],
)
def test_split_names(name: str, split: tuple[str, int, int] | None, unit: str) -> None:
    assert split_part(name) == split
    assert unit_name(name) == unit


def test_mmproj_is_recognised_case_insensitively() -> None:
    assert is_mmproj("mmproj-F16.gguf")
    assert is_mmproj("gemma-3-4b-it-MMPROJ-bf16.gguf")
    assert not is_mmproj("gemma-3-4b-it-Q8_0.gguf")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("Qwen3-8B-Q4_K_M", True),
        ("Llama 3.1 8B (instruct)+v2@x", True),
        ("", False),
        (".hidden", False),
        (" padded", False),
        ("padded ", False),
        ("a/b", False),
        ("a\\b", False),
        ("[x]", False),
        ("semi;colon", False),
        ("hash#tag", False),
        ("new\nline", False),
    ],
)
def test_name_problem(name: str, ok: bool) -> None:
    assert (name_problem(name) is None) == ok


# --- grouping -----------------------------------------------------------------------------------

D = Path("/lib/0123/files")


def paths(*names: str) -> list[Path]:
    return [D / name for name in names]


def test_single_split_and_mmproj_make_units() -> None:
    result = group(
        paths(
            "Big-00002-of-00003.gguf",
            "mmproj-F16.gguf",
            "Big-00003-of-00003.gguf",
            "Small-Q8_0.gguf",
            "Big-00001-of-00003.gguf",
        )
    )
    assert result.rejected == ()
    assert result.units == (
        Unit(
            "Big",
            tuple(paths(*(f"Big-0000{i}-of-00003.gguf" for i in (1, 2, 3)))),
            D / "mmproj-F16.gguf",
        ),
        Unit("Small-Q8_0", (D / "Small-Q8_0.gguf",), D / "mmproj-F16.gguf"),
    )
    big = result.units[0]
    assert big.main == D / "Big-00001-of-00003.gguf"
    assert big.files[-1] == D / "mmproj-F16.gguf"


def test_a_missing_shard_skips_the_split_model_and_names_the_shard() -> None:
    result = group(paths("Big-00001-of-00003.gguf", "Big-00003-of-00003.gguf", "ok.gguf"))
    assert [u.name for u in result.units] == ["ok"]
    assert result.rejected == (
        Rejected(D / "Big-00002-of-00003.gguf", "shard missing (split model Big skipped)"),
    )
    assert (
        str(result.rejected[0])
        == "Big-00002-of-00003.gguf: shard missing (split model Big skipped)"
    )


def test_shards_that_disagree_on_the_count_are_all_rejected() -> None:
    result = group(paths("m-00001-of-00002.gguf", "m-00002-of-00003.gguf"))
    assert result.units == ()
    assert {r.path.name for r in result.rejected} == {
        "m-00001-of-00002.gguf",
        "m-00002-of-00003.gguf",
    }
    assert all(
        "mixes shard counts (of-00002, of-00003) and is skipped" in r.reason
        for r in result.rejected
    )


def test_a_shard_number_out_of_range_is_rejected() -> None:
    result = group(paths("m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "m-00000-of-00002.gguf"))
    assert [u.name for u in result.units] == ["m"]
    assert result.rejected == (
        Rejected(D / "m-00000-of-00002.gguf", "shard number 0 is not in 1..2"),
    )


def test_mmproj_rules() -> None:
    alone = group(paths("mmproj-F16.gguf"))
    assert alone.units == ()
    assert alone.rejected == (Rejected(D / "mmproj-F16.gguf", "an mmproj file without a model"),)
    two = group(paths("v.gguf", "mmproj-F32.gguf", "mmproj-F16.gguf"))
    assert two.units == (Unit("v", (D / "v.gguf",), D / "mmproj-F16.gguf"),)
    assert two.rejected == (
        Rejected(D / "mmproj-F32.gguf", "another mmproj file (mmproj-F16.gguf) is used"),
    )


def test_an_mmproj_name_that_cannot_be_a_preset_value_is_rejected() -> None:
    result = group(paths("v.gguf", "mmproj;F16.gguf"))
    assert result.units == (Unit("v", (D / "v.gguf",)),)
    assert [r.reason for r in result.rejected] == [
        "file name 'mmproj;F16.gguf' contains / \\ [ ] ; # or a control character"
    ]


def test_conflicting_and_unusable_names_are_rejected() -> None:
    result = group(
        paths("x.gguf", "x-00001-of-00001.gguf", "bad;name.gguf", "notes.txt", "ok.gguf")
    )
    assert [u.name for u in result.units] == ["ok"]
    reasons = {r.path.name: r.reason for r in result.rejected}
    assert reasons["x.gguf"] == "both a single file and a split model are named x"
    assert reasons["x-00001-of-00001.gguf"] == "both a single file and a split model are named x"
    assert "contains / \\ [ ] ; #" in reasons["bad;name.gguf"]
    assert reasons["notes.txt"] == "not a .gguf file"


def test_grouping_is_by_name_only() -> None:
    # Nothing exists under /lib: grouping must not touch the file system.
    assert ggufcheck.group(paths("a.gguf")).units == (Unit("a", (D / "a.gguf",)),)
