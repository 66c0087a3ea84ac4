"""llama-models.ini: exact content, llama.cpp's INI grammar, write on change, startup limits."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from supervisor.engines.llama_router.gguf_cache import CachedModel
from supervisor.engines.llama_router.preset import (
    PresetError,
    StartupModelsMissing,
    StartupRefused,
    TooManyStartupModels,
    changed_sections,
    check_startup,
    format_value,
    render,
    write,
)


def cached(name: str, model: str, mmproj: str | None = None) -> CachedModel:
    files = (model,) + ((mmproj,) if mmproj else ())
    return CachedModel(
        name=name,
        guid="0" * 32,
        model_file=f"{name}/{model}",
        mmproj_file=f"{name}/{mmproj}" if mmproj else None,
        files=tuple(f"{name}/{f}" for f in files),
    )


MODELS = [
    cached("Qwen3-8B-Q4_K_M", "Qwen3-8B-Q4_K_M.gguf"),
    cached("Kimi-K2-UD-IQ1_S", "Kimi-K2-UD-IQ1_S-00001-of-00003.gguf"),
    cached("gemma-3-4b-it-Q8_0", "gemma-3-4b-it-Q8_0.gguf", "mmproj-F16.gguf"),
]
DEFAULTS: dict[str, str | int | float | bool] = {
    "n-gpu-layers": 99,
    "ctx-size": 8192,
    "jinja": True,
    "temp": 0.7,
    "flash-attn": "on",
}

EXPECTED = """\
; written by lucia-supervisor from the model library; edits are overwritten
version = 1

[*]
ctx-size = 8192
flash-attn = on
jinja = true
n-gpu-layers = 99
temp = 0.7

[Kimi-K2-UD-IQ1_S]
model = /models/Kimi-K2-UD-IQ1_S/Kimi-K2-UD-IQ1_S-00001-of-00003.gguf

[Qwen3-8B-Q4_K_M]
model = /models/Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf
load-on-startup = true

[gemma-3-4b-it-Q8_0]
model = /models/gemma-3-4b-it-Q8_0/gemma-3-4b-it-Q8_0.gguf
mmproj = /models/gemma-3-4b-it-Q8_0/mmproj-F16.gguf
load-on-startup = true
"""


def test_exact_content_for_a_small_library() -> None:
    startup = ["gemma-3-4b-it-Q8_0", "Qwen3-8B-Q4_K_M"]
    assert render(MODELS, DEFAULTS, startup, "/models") == EXPECTED


def test_content_is_deterministic() -> None:
    shuffled = MODELS[:]
    for seed in range(5):
        random.Random(seed).shuffle(shuffled)
        defaults = dict(random.Random(seed).sample(list(DEFAULTS.items()), len(DEFAULTS)))
        startup = ("Qwen3-8B-Q4_K_M", "gemma-3-4b-it-Q8_0")
        assert render(shuffled, defaults, startup, "/models/") == EXPECTED


def test_no_defaults_no_global_section_and_unknown_startup_names_are_ignored() -> None:
    text = render(MODELS[:1], {}, ["not-there"], "/srv/cache")
    assert text == (
        "; written by lucia-supervisor from the model library; edits are overwritten\n"
        "version = 1\n\n[Qwen3-8B-Q4_K_M]\n"
        "model = /srv/cache/Qwen3-8B-Q4_K_M/Qwen3-8B-Q4_K_M.gguf\n"
    )
    assert render([], {}, [], "/models").endswith("version = 1\n")


# llama.cpp's INI grammar (common/preset.cpp, parse_ini_from_file), as regular expressions.
_EOL = r"[ \t]*(?:[;#][^\r\n]*)?"
_LINE = re.compile(
    rf"\[[ \t]*(?P<section>[^\]]+?)[ \t]*\]{_EOL}"
    rf"|(?P<key>[a-zA-Z_][a-zA-Z0-9_.-]*)[ \t]*=[ \t]*(?P<value>[^;#\r\n]*?){_EOL}"
    r"|[ \t]*[;#][^\r\n]*|[ \t]*"
)


def parse_like_llama_cpp(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {"default": {}}
    current = "default"
    for line in text.split("\n"):
        match = _LINE.fullmatch(line)
        assert match, f"llama.cpp would not parse {line!r}"
        if match["section"] is not None:
            current = match["section"]
            sections[current] = {}
        elif match["key"] is not None:
            sections[current][match["key"]] = match["value"]
    return sections


def test_llama_cpp_reads_back_what_was_meant() -> None:
    parsed = parse_like_llama_cpp(render(MODELS, DEFAULTS, ["Qwen3-8B-Q4_K_M"], "/models"))
    assert parsed["default"] == {"version": "1"}
    assert parsed["*"] == {k: format_value(v) for k, v in DEFAULTS.items()}
    assert parsed["gemma-3-4b-it-Q8_0"] == {
        "model": "/models/gemma-3-4b-it-Q8_0/gemma-3-4b-it-Q8_0.gguf",
        "mmproj": "/models/gemma-3-4b-it-Q8_0/mmproj-F16.gguf",
    }
    assert parsed["Qwen3-8B-Q4_K_M"]["load-on-startup"] == "true"
    assert set(parsed) == {"default", "*", *(m.name for m in MODELS)}


@pytest.mark.parametrize(
    ("value", "text"),
    [(True, "true"), (False, "false"), (0, "0"), (-1, "-1"), (0.05, "0.05"), ("q8_0", "q8_0")],
)
def test_values(value: str | int | float | bool, text: str) -> None:
    assert format_value(value) == text


@pytest.mark.parametrize(
    ("models", "defaults", "container_dir", "problem"),
    [
        ([], {"ctx size": 1}, "/models", "preset key 'ctx size' is not an argument name"),
        ([], {"-c": 1}, "/models", "preset key '-c' is not an argument name"),
        ([], {"model": "/x.gguf"}, "/models", "preset key 'model' is set per model by the worker"),
        ([], {"load-on-startup": True}, "/models", "'load-on-startup' is set per model"),
        ([], {"chat-template": "a;b"}, "/models", "preset value 'a;b' is empty, has outer spaces"),
        ([], {"alias": "x # y"}, "/models", "contains ; # or a control character"),
        ([], {"alias": ""}, "/models", "preset value '' is empty"),
        ([], {"alias": "a\nb"}, "/models", "contains ; # or a control character"),
        ([], {}, "models", "container cache directory 'models' is not absolute"),
        (MODELS[:1], {}, "/mod;els", "preset value '/mod;els/Qwen3-8B-Q4_K_M/"),
        ([cached("a]b", "a.gguf")], {}, "/models", "model name 'a]b' cannot be a preset section"),
        ([cached("a", "../a.gguf")], {}, "/models", "cache path 'a/../a.gguf' leaves the cache"),
        (MODELS[:1] * 2, {}, "/models", "two models are named 'Qwen3-8B-Q4_K_M'"),
    ],
)
def test_what_cannot_be_written_is_refused_in_one_line(
    models: list[CachedModel],
    defaults: dict[str, str | int | bool],
    container_dir: str,
    problem: str,
) -> None:
    with pytest.raises(PresetError, match=re.escape(problem)) as caught:
        render(models, defaults, [], container_dir)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)


# --- write --------------------------------------------------------------------------------------


def test_written_atomically_and_only_when_the_content_changes(tmp_path: Path) -> None:
    path = tmp_path / "llama-models.ini"
    assert write(path, EXPECTED) is True
    assert path.read_text() == EXPECTED
    assert path.stat().st_mode & 0o777 == 0o644  # the container reads it, as whatever uid
    before = path.stat()
    assert write(path, EXPECTED) is False
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    changed = EXPECTED.replace("ctx-size = 8192", "ctx-size = 4096")
    assert write(path, changed) is True
    assert path.read_text() == changed
    assert path.stat().st_ino != before.st_ino  # replaced by rename, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-models.ini"]


def test_a_symlink_or_directory_in_the_way_is_replaced_or_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.ini"
    target.write_text(EXPECTED)
    path = tmp_path / "llama-models.ini"
    path.symlink_to(target)
    assert write(path, EXPECTED) is True  # never trust what a symlink points at
    assert not path.is_symlink()
    assert target.read_text() == EXPECTED
    (tmp_path / "d.ini").mkdir()
    with pytest.raises(OSError):
        write(tmp_path / "d.ini", EXPECTED)


# --- load-on-startup ----------------------------------------------------------------------------


def test_more_startup_models_than_models_max_is_refused() -> None:
    with pytest.raises(TooManyStartupModels) as caught:
        check_startup(["a", "b", "c"], ["a", "b", "c"], 2)
    assert str(caught.value) == (
        "3 load-on-startup models (a, b, c) but --models-max is 2; "
        "raise models_max or load fewer at start"
    )
    assert isinstance(caught.value, StartupRefused)
    assert isinstance(caught.value, ValueError)


def test_startup_models_not_in_the_cache_are_named() -> None:
    with pytest.raises(StartupModelsMissing) as caught:
        check_startup(["a", "b", "c"], ["b"], 4)
    assert caught.value.missing == ("a", "c")
    assert (
        str(caught.value) == "load-on-startup models not in the cache (not Ready or skipped): a, c"
    )


def test_startup_within_limits_passes() -> None:
    check_startup([], [], 1)
    check_startup(["a", "a"], ["a"], 1)  # a name listed twice loads once
    check_startup(["a", "b"], iter(["b", "a", "c"]), 2)


def test_file_is_never_partially_visible(tmp_path: Path) -> None:
    path = tmp_path / "llama-models.ini"
    write(path, EXPECTED)
    fd = os.open(path, os.O_RDONLY)  # a reader holding the old file keeps the old content
    try:
        write(path, EXPECTED + "\n")
        assert os.pread(fd, 1 << 16, 0).decode() == EXPECTED
    finally:
        os.close(fd)


# --- what a reload unloads -----------------------------------------------------------------------

_BEFORE = (
    "version = 1\n\n[*]\nctx-size = 256\n\n[a]\nmodel = /models/a.gguf\n\n"
    "[b]\nmodel = /models/b.gguf\n"
)


@pytest.mark.parametrize(
    ("before", "after", "changed"),
    [
        (_BEFORE, _BEFORE, ()),
        (
            _BEFORE,
            _BEFORE.replace(
                "[b]\nmodel = /models/b.gguf", "[b]\nmodel = /models/b.gguf\nload-on-startup = true"
            ),
            ("b",),
        ),
        (_BEFORE, _BEFORE.replace("ctx-size = 256", "ctx-size = 512"), ("a", "b")),
        (_BEFORE, _BEFORE + "\n[c]\nmodel = /models/c.gguf\n", ("c",)),
        (_BEFORE, _BEFORE.replace("version = 1", "version = 2"), ("a", "b")),
        (None, _BEFORE, ("a", "b")),
    ],
)
def test_changed_sections(before: str | None, after: str, changed: tuple[str, ...]) -> None:
    assert changed_sections(before, after) == changed
