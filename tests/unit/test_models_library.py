"""The model library's pure rules, in tables: globs, space, queue, the child's environment and
argv, the tree's paths, progress, and model.json as supervisor.library.models reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.host.commands.models import progress_text, size
from supervisor.host.models import manifest as mf
from supervisor.host.models.control import default_name, queue_problem, space_problem
from supervisor.host.models.fetch import Rate, child_argv, child_env
from supervisor.host.models.hub import HubRefused, check_repo, included, parse_tree, safe_path
from supervisor.library.models import parse_model_json

C = "c" * 40


@pytest.mark.parametrize(
    ("path", "patterns", "taken"),
    [
        ("m-Q4_K_M.gguf", [], True),
        ("m-Q4_K_M.gguf", ["*Q4_K_M*"], True),
        ("m-Q8_0.gguf", ["*Q4_K_M*"], False),
        ("Q4_K_M/m-00001-of-00002.gguf", ["Q4_K_M/"], True),
        ("Q4_K_M/m-00001-of-00002.gguf", ["Q4_K_M/*"], True),
        ("README.md", ["*.gguf", "*.json"], False),
        ("config.json", ["*.gguf", "*.json"], True),
        ("m-q4_k_m.gguf", ["*Q4_K_M*"], False),  # case counts, as in hf
    ],
)
def test_include_globs_take_what_hf_download_takes(
    path: str, patterns: list[str], taken: bool
) -> None:
    assert included(path, patterns) is taken


@pytest.mark.parametrize(
    ("needed", "free", "problem"),
    [
        (10, 10, None),
        (0, 0, None),
        (11, 10, "not enough disk space: it needs 11 bytes more and 10 bytes are free"),
    ],
)
def test_space(needed: int, free: int, problem: str | None) -> None:
    assert space_problem(needed, free) == problem


def _model(state: str, name: str = "m") -> mf.ModelManifest:
    return mf.ModelManifest(
        id=mf.new_guid(),
        name=name,
        state=state,
        since="t",
        created="t",  # type: ignore[arg-type]
        source=mf.FileOrigin(repo="o/r", revision="main", commit=C),
    )


@pytest.mark.parametrize(
    ("states", "refused"),
    [
        (["Queued"] * 15, False),
        (["Queued"] * 8 + ["Downloading"] * 7 + ["Ready"] * 9, False),
        (["Queued"] * 8 + ["Downloading"] * 8, True),
        (["Failed", "Canceled", "Interrupted", "Ready"] * 10, False),
    ],
)
def test_the_queue_counts_queued_and_downloading(states: list[str], refused: bool) -> None:
    assert (queue_problem([_model(s) for s in states]) is not None) is refused


BASE = {
    "PATH": "/bin",
    "HF_ENDPOINT": "http://hub",
    "HF_TOKEN": "t",
    "HUGGING_FACE_HUB_TOKEN": "t",
    "HF_TOKEN_PATH": "/x",
    "HF_HOME": "/home/u/.cache/hf",
    "HF_OIDC_TOKEN": "o",
    "HF_OIDC_ISSUER": "i",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0",
}


@pytest.mark.parametrize(
    ("token_file", "expected"),
    [
        (
            None,
            {
                "PATH": "/bin",
                "HF_ENDPOINT": "http://hub",
                "HF_HOME": "/lib/.hf-home",
                "HF_HUB_DISABLE_UPDATE_CHECK": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            },
        ),
        (
            Path("/lib/tok"),
            {
                "PATH": "/bin",
                "HF_ENDPOINT": "http://hub",
                "HF_HOME": "/lib/.hf-home",
                "HF_HUB_DISABLE_UPDATE_CHECK": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_TOKEN_PATH": "/lib/tok",
            },
        ),
    ],
)
def test_the_childs_environment_follows_the_token_rules(
    token_file: Path | None, expected: dict[str, str]
) -> None:
    assert child_env(BASE, Path("/lib/.hf-home"), token_file) == expected


@pytest.mark.parametrize(
    ("include", "tail"),
    [
        ([], ["--quiet"]),
        (["*Q4*", "*.json"], ["--include", "*Q4*", "--include", "*.json", "--quiet"]),
    ],
)
def test_the_childs_argv(include: list[str], tail: list[str]) -> None:
    argv = child_argv("hf", "o/r", C, Path("/lib/g/files"), include)
    assert argv == ["hf", "download", "o/r", "--revision", C, "--local-dir", "/lib/g/files", *tail]


@pytest.mark.parametrize(
    ("path", "safe"),
    [
        ("a.gguf", True),
        ("d/a.gguf", True),
        ("../a", False),
        ("/etc/passwd", False),
        ("a//b", False),
        ("d/./a", False),
        ("a\nb", False),
        ("", False),
        ("a\\b", False),
    ],
)
def test_tree_paths(path: str, safe: bool) -> None:
    assert safe_path(path) is safe


def test_the_tree_keeps_files_with_their_lfs_ids_and_refuses_unsafe_paths() -> None:
    page = [
        {"type": "directory", "path": "d", "oid": "x", "size": 0},
        {"type": "file", "path": "a.gguf", "size": 5, "oid": "g1", "lfs": {"oid": "s1", "size": 5}},
        {"type": "file", "path": "README.md", "size": 2, "oid": "g2"},
    ]
    files = parse_tree(page)
    assert [(f.path, f.size, f.sha256, f.git_oid) for f in files] == [
        ("a.gguf", 5, "s1", "g1"),
        ("README.md", 2, None, "g2"),
    ]
    with pytest.raises(HubRefused, match="not safe"):
        parse_tree([{"type": "file", "path": "../x", "size": 1, "oid": "g"}])
    with pytest.raises(HubRefused, match="not a list"):
        parse_tree({"error": "x"})


@pytest.mark.parametrize("repo", ["o/r", "TheBloke/Llama-2-7B-GGUF", "gpt2"])
def test_repo_ids(repo: str) -> None:
    assert check_repo(repo) == repo


@pytest.mark.parametrize("repo", ["../x", "o/r/s", "o/..", "-o/r", "o r/x", ""])
def test_bad_repo_ids(repo: str) -> None:
    with pytest.raises(ValueError, match="not a repository id"):
        check_repo(repo)


@pytest.mark.parametrize(
    ("repo", "include", "name"),
    [
        ("o/Qwen3-8B-GGUF", ["*Q4_K_M*"], "Qwen3-8B-GGUF:Q4_K_M"),
        ("o/r", [], "r"),
        ("o/r", ["*.gguf"], "r"),
        ("o/r", ["Q8_0/"], "r:Q8_0"),
        ("o/r", ["*.json", "*.safetensors"], "r"),
    ],
)
def test_default_names(repo: str, include: list[str], name: str) -> None:
    assert default_name(repo, include) == name


def test_speed_and_time_left_from_samples() -> None:
    rate = Rate(window=10)
    assert rate.speed() is None
    for second in range(0, 21):
        rate.add(float(second), second * 100)
    assert rate.speed() == 100.0
    assert rate.seconds_left(2000, 3000) == 10.0
    assert rate.seconds_left(3000, 3000) is None


@pytest.mark.parametrize(
    ("count", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**30, "5.0 GiB")]
)
def test_sizes(count: int, text: str) -> None:
    assert size(count) == text


def test_progress_shows_speed_and_time_left_only_while_downloading() -> None:
    model = _model("Downloading").model_copy(
        update={"bytes_done": 1024, "bytes_total": 4096, "speed": 1024.0, "seconds_left": 3.0}
    )
    assert progress_text(model) == "1.0 KiB/4.0 KiB 1.0 KiB/s 3s left"
    assert progress_text(model.transition("Failed", "x")) == "1.0 KiB/4.0 KiB"


@pytest.mark.parametrize(
    "state", ["Queued", "Downloading", "Ready", "Failed", "Canceled", "Interrupted"]
)
def test_what_the_library_writes_the_router_reads(state: str) -> None:
    model = _model(state).model_copy(
        update={
            "hub_files": [
                mf.HubFile(path="a.gguf", size=1, gitOid="g"),
                mf.HubFile(path="Q8/b-00001-of-00002.gguf", size=1, gitOid="g"),
            ]
        }
    )
    model = model.model_copy(update={"files": mf.plain_names(model.hub_files)})
    read = parse_model_json(mf.dump(model).decode())
    assert read.state == state
    assert [f.name for f in read.files or []] == ["a.gguf"]


@pytest.mark.parametrize("guid", ["../etc", "x" * 32, "A" * 31, ""])
def test_model_ids_cannot_leave_the_library(guid: str) -> None:
    with pytest.raises(ValueError, match="not a model id"):
        mf.model_dir(Path("/lib"), guid)
