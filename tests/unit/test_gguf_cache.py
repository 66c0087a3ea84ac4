"""The GGUF cache: first and incremental sync, removal, no re-reads, progress, atomicity, cancel."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.engines.llama_router import gguf_cache
from supervisor.engines.llama_router.cache_manifest import MANIFEST_NAME
from supervisor.engines.llama_router.fastcopy import SourceChanged, copy_file
from supervisor.engines.llama_router.gguf_cache import SyncResult, progress_message, sync
from supervisor.engines.llama_router.preset import render
from supervisor.errors import Cancelled
from supervisor.library.models import MODEL_STATES, scan
from tests.gguf_fixtures import (
    add_model,
    break_magic,
    set_version,
    write_gguf,
    write_mmproj,
    write_split,
)

NEVER = threading.Event()


@dataclass
class Env:
    models: Path
    cache: Path
    messages: list[str]

    def sync(self, **kwargs: Any) -> SyncResult:
        return sync(scan(self.models), self.cache, self.messages.append, NEVER, **kwargs)

    def cached_files(self) -> dict[str, bytes]:
        """Everything under the cache but the manifest, by relative path."""
        return {
            str(p.relative_to(self.cache)): p.read_bytes()
            for p in sorted(self.cache.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME
        }

    def manifest(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.cache / MANIFEST_NAME).read_text())
        return data


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path / "library", tmp_path / "cache", [])


@dataclass
class Fixture:
    single: Path
    split: list[Path]
    vision: Path
    mmproj: Path
    guids: dict[str, str]


def populate(models: Path) -> Fixture:
    """A library with one of everything: good models, bad files, and every non-Ready state."""
    guids = {}
    files = add_model(models, listed=["Qwen3-8B-Q4_K_M.gguf"])
    single = write_gguf(files / "Qwen3-8B-Q4_K_M.gguf")
    guids["single"] = files.parent.name

    files = add_model(models)  # no `files` in model.json: files/*.gguf
    split = write_split(files, "Kimi-K2-UD-IQ1_S", 3)
    guids["split"] = files.parent.name

    files = add_model(models, listed=["gemma-3-4b-it-Q8_0.gguf", "mmproj-F16.gguf"])
    vision = write_gguf(files / "gemma-3-4b-it-Q8_0.gguf")
    mmproj = write_mmproj(files / "mmproj-F16.gguf")
    guids["vision"] = files.parent.name

    files = add_model(models)
    break_magic(write_gguf(files / "corrupt.gguf"))
    files = add_model(models)
    set_version(write_gguf(files / "old-format.gguf"), 1)
    files = add_model(models)
    set_version(write_gguf(files / "future-format.gguf"), 4)
    files = add_model(models)
    shards = write_split(files, "Torn", 3)
    shards[1].unlink()
    for state in MODEL_STATES:
        if state != "Ready":
            files = add_model(models, state)
            write_gguf(files / f"{state}-model.gguf")
    return Fixture(single, split, vision, mmproj, guids)


EXPECTED_BAD = [
    "Torn-00002-of-00003.gguf: shard missing (split model Torn skipped)",
    "corrupt.gguf: not a GGUF file (does not start with GGUF) (model corrupt skipped)",
    "future-format.gguf: GGUF version 4 (only versions 2 and 3 are supported) "
    "(model future-format skipped)",
    "old-format.gguf: GGUF version 1 (only versions 2 and 3 are supported) "
    "(model old-format skipped)",
]


def no_partials(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.partial")] + [str(p) for p in root.rglob("*.tmp")]


# --- first sync ---------------------------------------------------------------------------------


def test_first_sync_copies_ready_models_and_names_bad_files(env: Env) -> None:
    fx = populate(env.models)
    result = env.sync()

    split_names = [p.name for p in fx.split]
    assert env.cached_files() == {
        "Kimi-K2-UD-IQ1_S/" + name: (fx.split[0].parent / name).read_bytes() for name in split_names
    } | {
        "Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf": fx.single.read_bytes(),
        "gemma-3-4b-it-Q8_0/gemma-3-4b-it-Q8_0.gguf": fx.vision.read_bytes(),
        "gemma-3-4b-it-Q8_0/mmproj-F16.gguf": fx.mmproj.read_bytes(),
    }
    assert [str(b) for b in result.bad] == EXPECTED_BAD
    assert sorted(result.copied) == sorted(env.cached_files())
    assert result.unchanged == ()
    assert result.removed == ()
    assert [(m.name, m.model_file, m.mmproj_file) for m in result.models] == [
        ("Kimi-K2-UD-IQ1_S", "Kimi-K2-UD-IQ1_S/Kimi-K2-UD-IQ1_S-00001-of-00003.gguf", None),
        ("Qwen3-8B-Q4_K_M", "Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf", None),
        (
            "gemma-3-4b-it-Q8_0",
            "gemma-3-4b-it-Q8_0/gemma-3-4b-it-Q8_0.gguf",
            "gemma-3-4b-it-Q8_0/mmproj-F16.gguf",
        ),
    ]
    assert result.models[0].guid == fx.guids["split"]
    assert no_partials(env.cache) == []
    for path in env.cache.rglob("*.gguf"):
        assert path.stat().st_mode & 0o777 == 0o644

    summary = result.summary()
    assert summary.startswith("3 models in the cache (6 files copied, 0 unchanged, 0 removed); ")
    for line in EXPECTED_BAD:
        assert line in summary
    assert "\n" not in summary

    manifest = env.manifest()
    record = manifest["models"]["Qwen3-8B-Q4_K_M"]
    assert record["guid"] == fx.guids["single"]
    info = fx.single.stat()
    assert record["files"]["Qwen3-8B-Q4_K_M.gguf"] == {
        "source": str(fx.single),
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "dest_size": info.st_size,
    }


def test_the_preset_follows_from_the_sync(env: Env) -> None:
    populate(env.models)
    result = env.sync()
    text = render(result.models, {"ctx-size": 4096}, ["Qwen3-8B-Q4_K_M"], "/models")
    assert "model = /models/Kimi-K2-UD-IQ1_S/Kimi-K2-UD-IQ1_S-00001-of-00003.gguf\n" in text
    assert "mmproj = /models/gemma-3-4b-it-Q8_0/mmproj-F16.gguf\n" in text
    assert "[Torn]" not in text and "[corrupt]" not in text
    for model in result.models:
        assert (env.cache / model.model_file).is_file()


# --- incremental sync, removal, re-checks -------------------------------------------------------


def test_a_new_ready_model_is_the_only_thing_copied(env: Env) -> None:
    populate(env.models)
    first = env.sync()
    files = add_model(env.models, "Downloading")
    write_gguf(files / "Late-Q4.gguf")
    assert env.sync().copied == ()  # still downloading: nothing to do
    (files.parent / "model.json").write_text(json.dumps({"state": "Ready"}))

    result = env.sync()
    assert result.copied == ("Late-Q4/Late-Q4.gguf",)
    assert sorted(result.unchanged) == sorted(first.copied)
    assert result.removed == ()
    assert [m.name for m in result.models] == sorted([m.name for m in first.models] + ["Late-Q4"])


def test_a_model_no_longer_ready_is_removed_from_the_cache(env: Env) -> None:
    fx = populate(env.models)
    env.sync()
    (env.models / fx.guids["split"] / "model.json").write_text('{"state": "Failed"}')
    result = env.sync()
    assert result.removed == ("Kimi-K2-UD-IQ1_S",)
    assert not (env.cache / "Kimi-K2-UD-IQ1_S").exists()
    assert "Kimi-K2-UD-IQ1_S" not in env.manifest()["models"]
    assert [m.name for m in result.models] == ["Qwen3-8B-Q4_K_M", "gemma-3-4b-it-Q8_0"]

    shutil.rmtree(env.models / fx.guids["vision"])  # deleted from the library entirely
    result = env.sync()
    assert result.removed == ("gemma-3-4b-it-Q8_0",)
    assert sorted(env.cached_files()) == ["Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf"]


def test_only_what_the_sync_created_is_removed(env: Env) -> None:
    fx = populate(env.models)
    env.sync()
    foreign_dir = env.cache / "operator-model"
    foreign_dir.mkdir()
    (foreign_dir / "x.gguf").write_bytes(b"GGUF mine")
    stray = env.cache / "Qwen3-8B-Q4_K_M" / "notes.txt"
    stray.write_text("the operator's")
    (env.models / fx.guids["single"] / "model.json").write_text('{"state": "Canceled"}')

    result = env.sync()
    assert result.removed == ("Qwen3-8B-Q4_K_M",)
    assert (foreign_dir / "x.gguf").read_bytes() == b"GGUF mine"
    assert stray.read_text() == "the operator's"  # its directory stays because it is not empty
    assert not (env.cache / "Qwen3-8B-Q4_K_M" / "Qwen3-8B-Q4_K_M.gguf").exists()


class Opens:
    """Records every path opened through os.open, open() and io.open, and every data copy call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        self.copies: list[str] = []
        real_os_open, real_open = os.open, builtins.open

        def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
            self.paths.append(str(path))
            return real_os_open(path, *args, **kwargs)

        def py_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            self.paths.append(str(file))
            return real_open(file, *args, **kwargs)

        def refuse(name: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.copies.append(name)
                raise AssertionError(f"{name} called")

            return call

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(builtins, "open", py_open)
        monkeypatch.setattr(io, "open", py_open)
        for name in ("copy_file_range", "sendfile", "pread"):
            monkeypatch.setattr(os, name, refuse(name))

    def gguf(self) -> list[str]:
        return [p for p in self.paths if p.endswith(".gguf")]


def test_an_unchanged_library_is_rechecked_without_reading_any_gguf_file(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate(env.models)
    first = env.sync()
    env.messages.clear()
    before = {p: p.stat().st_mtime_ns for p in env.cache.rglob("*")}

    opens = Opens(monkeypatch)
    result = env.sync()
    monkeypatch.undo()

    assert opens.gguf() == []  # not even the 8-byte header check
    assert opens.copies == []
    assert any(p.endswith("model.json") for p in opens.paths)  # the watcher did watch
    assert result.copied == ()
    assert sorted(result.unchanged) == sorted(first.copied)
    assert result.models == first.models
    assert result.bad == first.bad  # bad files are remembered by size and mtime, not re-read
    assert env.messages == []  # nothing copied, nothing to report
    assert {p: p.stat().st_mtime_ns for p in env.cache.rglob("*")} == before  # manifest too


def test_a_changed_or_damaged_file_is_copied_again(env: Env) -> None:
    fx = populate(env.models)
    env.sync()
    write_gguf(fx.single, elements=32)  # replaced in the library: new size and mtime
    os.utime(fx.vision, ns=(0, fx.vision.stat().st_mtime_ns + 1))  # same size, newer mtime
    os.truncate(env.cache / "Kimi-K2-UD-IQ1_S" / fx.split[2].name, 10)  # damaged copy
    (env.cache / "gemma-3-4b-it-Q8_0" / "mmproj-F16.gguf").unlink()  # lost copy

    result = env.sync()
    assert sorted(result.copied) == [
        "Kimi-K2-UD-IQ1_S/" + fx.split[2].name,
        "Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf",
        "gemma-3-4b-it-Q8_0/gemma-3-4b-it-Q8_0.gguf",
        "gemma-3-4b-it-Q8_0/mmproj-F16.gguf",
    ]
    assert (env.cache / "Qwen3-8B-Q4_K_M" / "Qwen3-8B-Q4_K_M.gguf").read_bytes() == (
        fx.single.read_bytes()
    )
    assert (env.cache / "Kimi-K2-UD-IQ1_S" / fx.split[2].name).read_bytes() == (
        fx.split[2].read_bytes()
    )


def test_a_file_that_turns_bad_takes_its_model_out_and_a_bad_mmproj_only_itself(
    env: Env,
) -> None:
    fx = populate(env.models)
    env.sync()
    break_magic(fx.split[1])
    set_version(fx.mmproj, 1)
    result = env.sync()
    assert "Kimi-K2-UD-IQ1_S" in result.removed
    assert not (env.cache / "Kimi-K2-UD-IQ1_S").exists()
    assert (
        f"{fx.split[1].name}: not a GGUF file (does not start with GGUF) "
        "(model Kimi-K2-UD-IQ1_S skipped)"
    ) in [str(b) for b in result.bad]
    assert (
        "mmproj-F16.gguf: GGUF version 1 (only versions 2 and 3 are supported) "
        "(gemma-3-4b-it-Q8_0 is served without it)"
    ) in [str(b) for b in result.bad]
    vision = next(m for m in result.models if m.name == "gemma-3-4b-it-Q8_0")
    assert vision.mmproj_file is None
    assert sorted(p.name for p in (env.cache / "gemma-3-4b-it-Q8_0").iterdir()) == [
        "gemma-3-4b-it-Q8_0.gguf"
    ]


def test_a_bad_file_is_remembered_until_it_changes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = add_model(env.models)
    bad = break_magic(write_gguf(files / "Fixed.gguf"))
    first = env.sync()
    assert [str(b) for b in first.bad] == [
        "Fixed.gguf: not a GGUF file (does not start with GGUF) (model Fixed skipped)"
    ]
    opens = Opens(monkeypatch)
    assert env.sync().bad == first.bad
    monkeypatch.undo()
    assert opens.gguf() == []

    write_gguf(bad)  # repaired in the library: a new mtime
    result = env.sync()
    assert result.bad == ()
    assert result.copied == ("Fixed/Fixed.gguf",)
    assert env.manifest()["bad"] == {}


def test_two_library_models_cannot_share_a_name(env: Env) -> None:
    first = add_model(env.models, guid="a" * 32)
    write_gguf(first / "Same.gguf")
    second = add_model(env.models, guid="b" * 32)
    write_gguf(second / "Same.gguf", elements=4)
    result = env.sync()
    assert [(m.name, m.guid) for m in result.models] == [("Same", "a" * 32)]
    assert [str(b) for b in result.bad] == [
        f"Same.gguf: model name Same is already used by library model {'a' * 32}"
    ]
    assert (env.cache / "Same" / "Same.gguf").read_bytes() == (first / "Same.gguf").read_bytes()


def test_an_unreadable_manifest_is_noted_and_everything_copied_again(env: Env) -> None:
    populate(env.models)
    first = env.sync()
    (env.cache / MANIFEST_NAME).write_text("{not json")
    result = env.sync()
    assert sorted(result.copied) == sorted(first.copied)
    assert len(result.notes) == 1
    assert result.notes[0].startswith(f"{MANIFEST_NAME} ignored (")
    assert result.notes[0] in result.summary()
    assert env.sync().notes == ()


def test_a_copy_that_fails_skips_its_model_and_not_the_others(env: Env) -> None:
    populate(env.models)
    env.cache.mkdir()
    (env.cache / "Qwen3-8B-Q4_K_M").write_text("a file where a directory should be")
    result = env.sync()
    assert [m.name for m in result.models] == ["Kimi-K2-UD-IQ1_S", "gemma-3-4b-it-Q8_0"]
    failed = [str(b) for b in result.bad if "copy failed" in b.reason]
    assert failed == [
        "Qwen3-8B-Q4_K_M: copy failed: "
        f"{env.cache / 'Qwen3-8B-Q4_K_M'} is not a directory (model Qwen3-8B-Q4_K_M skipped)"
    ]


def test_leftover_temp_files_are_removed_and_nothing_else(env: Env) -> None:
    populate(env.models)
    env.sync()
    model_dir = env.cache / "Qwen3-8B-Q4_K_M"
    (model_dir / ".Qwen3-8B-Q4_K_M.gguf.0badcafe.partial").write_bytes(b"GGUF half")
    (env.cache / "Gone").mkdir()
    (env.cache / "Gone" / ".Gone.gguf.12345678.partial").write_bytes(b"GGUF half")
    (model_dir / ".keep").write_text("not ours")
    env.sync()
    assert no_partials(env.cache) == []
    assert (model_dir / ".keep").exists()


# --- progress -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "total", "message"),
    [
        (12_345_678_901, 40_000_000_000, "copying M 12.3 of 40.0 GB"),
        (0, 4_000_000, "copying M 0.0 of 0.0 GB"),
        (125_000_000_000, 125_000_000_000, "copying M 125.0 of 125.0 GB"),
        (49_999_999, 1_050_000_000, "copying M 0.0 of 1.1 GB"),
    ],
)
def test_progress_message(done: int, total: int, message: str) -> None:
    assert progress_message("M", done, total) == message


class Ticks:
    """A clock that advances `step` seconds on every reading."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_progress_is_reported_per_chunk_and_throttled(env: Env) -> None:
    files = add_model(env.models)
    big = write_gguf(files / "Big.gguf", elements=64 * 1024)  # 256 KiB and a header
    size = big.stat().st_size

    env.sync(chunk_size=16 * 1024, clock=Ticks(1.0))  # every reading is a second apart
    chunks = -(-size // (16 * 1024))
    assert len(env.messages) == chunks + 1  # "0 of N", then one per chunk
    assert all(re.fullmatch(r"copying Big \d+\.\d of \d+\.\d GB", m) for m in env.messages)
    assert env.messages[0] == progress_message("Big", 0, size)
    assert env.messages[-1] == progress_message("Big", size, size)

    env.messages.clear()
    big.unlink()
    write_gguf(files / "Big.gguf", elements=64 * 1024 + 1)
    env.sync(chunk_size=16 * 1024, clock=Ticks(gguf_cache.PROGRESS_INTERVAL / 4))
    assert len(env.messages) == 1 + chunks // 4  # at most once per interval
    env.messages.clear()
    os.utime(files / "Big.gguf", ns=(0, 1))
    env.sync(chunk_size=16 * 1024, clock=lambda: 7.0)  # a clock that stands still
    assert len(env.messages) == 1


def test_progress_counts_the_whole_split_model(env: Env) -> None:
    files = add_model(env.models)
    shards = write_split(files, "S", 3, elements=1024)
    total = sum(p.stat().st_size for p in shards)
    env.sync(chunk_size=1 << 20, clock=Ticks(1.0))
    assert env.messages[0] == progress_message("S", 0, total)
    done = [int(float(m.split()[2]) * 1e9) for m in env.messages]
    assert done == sorted(done)
    assert env.messages[-1] == progress_message("S", total, total)


# --- cancel and atomicity -----------------------------------------------------------------------


def test_cancel_mid_copy_leaves_no_temp_and_no_partial_file(env: Env) -> None:
    files = add_model(env.models)
    write_gguf(files / "A-small.gguf")
    big = write_gguf(files / "B-big.gguf", elements=64 * 1024)
    cancel = threading.Event()
    seen: list[str] = []
    observed_partials: list[list[str]] = []

    def progress(message: str) -> None:
        seen.append(message)
        if message.startswith("copying B-big") and len([m for m in seen if "B-big" in m]) == 3:
            observed_partials.append(no_partials(env.cache))
            cancel.set()

    with pytest.raises(Cancelled, match=r"cancelled while copying B-big\.gguf"):
        sync(scan(env.models), env.cache, progress, cancel, chunk_size=16 * 1024, clock=Ticks(1.0))
    assert observed_partials and len(observed_partials[0]) == 1  # it was mid-copy
    assert no_partials(env.cache) == []
    assert not (env.cache / "B-big" / "B-big.gguf").exists()
    assert (env.cache / "A-small" / "A-small.gguf").is_file()  # finished before the cancel
    assert "B-big" not in env.manifest()["models"]
    assert list(env.manifest()["models"]) == ["A-small"]

    result = env.sync()
    assert result.copied == ("B-big/B-big.gguf",)
    assert result.unchanged == ("A-small/A-small.gguf",)
    assert (env.cache / "B-big" / "B-big.gguf").read_bytes() == big.read_bytes()


def test_a_cancel_before_the_sync_copies_nothing(env: Env) -> None:
    populate(env.models)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        sync(scan(env.models), env.cache, env.messages.append, cancel)
    assert env.cached_files() == {}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "src" / "m.gguf", elements=50_000)


def fail_with(code: int) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    return call


@pytest.mark.parametrize(
    ("broken", "method"),
    [
        ({}, "copy_file_range"),
        ({"copy_file_range": fail_with(errno.EXDEV)}, "sendfile"),
        ({"copy_file_range": fail_with(errno.ENOSYS)}, "sendfile"),
        ({"copy_file_range": lambda *a, **k: 0}, "sendfile"),  # answers 0 instead of an error
        (
            {"copy_file_range": fail_with(errno.EINVAL), "sendfile": fail_with(errno.EINVAL)},
            "pread",
        ),
    ],
)
def test_copy_falls_back_from_the_fast_paths(
    source: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    broken: dict[str, Callable[..., Any]],
    method: str,
) -> None:
    for name, replacement in broken.items():
        monkeypatch.setattr(os, name, replacement)
    dest = tmp_path / "m.gguf"
    reported: list[int] = []
    stats = copy_file(source, dest, on_bytes=reported.append, chunk_size=64 * 1024)
    assert stats.method == method
    assert stats.size == source.stat().st_size
    assert dest.read_bytes() == source.read_bytes()
    assert reported == sorted(reported) and reported[-1] == stats.size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "src"]


def test_copy_errors_that_are_not_about_support_are_raised(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", fail_with(errno.ENOSPC))
    with pytest.raises(OSError, match="No space left"):
        copy_file(source, tmp_path / "m.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_source_that_changes_during_the_copy_is_not_kept(source: Path, tmp_path: Path) -> None:
    def grow(done: int) -> None:
        if done == 64 * 1024:
            with source.open("ab") as f:
                f.write(b"more")

    with pytest.raises(SourceChanged, match="changed while being copied"):
        copy_file(source, tmp_path / "m.gguf", on_bytes=grow, chunk_size=64 * 1024)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_copy_does_not_follow_symlinks(source: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(source)
    with pytest.raises(OSError) as caught:
        copy_file(link, tmp_path / "m.gguf")
    assert caught.value.errno == errno.ELOOP


def test_copy_replaces_an_existing_file_atomically(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m.gguf"
    dest.write_bytes(b"old")
    fd = os.open(dest, os.O_RDONLY)
    try:
        copy_file(source, dest)
        assert os.pread(fd, 16, 0) == b"old"  # a reader of the old file keeps it whole
    finally:
        os.close(fd)
    assert dest.read_bytes() == source.read_bytes()
