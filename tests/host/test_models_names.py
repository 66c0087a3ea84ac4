"""Served names in the library: a download whose GGUF the router would serve under a name
outside the served-name rule is refused when it is added, before anything is written or
fetched; a GGUF a library already held under such a name stays Ready and offered (the record
keeps its rows by the name's digest form, tests/host/test_gateway_record.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.host.models import control
from supervisor.host.models import manifest as mf
from supervisor.library import ggufcheck
from supervisor.library.models import scan
from tests.gguf_fixtures import write_gguf
from tests.host.library_world import (
    GGUF,
    REPO,
    cli,
    cli_env,
    hub_of,
    make_repo,
    queue,
    running,
    wait_state,
)

LEGACY = "Qwen 7B (Q4).gguf"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


def everything(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes() if p.is_file() else b""
        for p in directory.rglob("*")
    }


@pytest.mark.parametrize(
    ("files", "include", "refused"),
    [
        ([LEGACY], [LEGACY], f"{LEGACY!r} would be served as 'Qwen 7B (Q4)'"),
        (["sub/模型-Q4_K_M.gguf"], ["sub/*"], "'sub/模型-Q4_K_M.gguf' would be served as '模型-"),
        ([".hidden-Q4_K_M.gguf"], [".hidden*"], "'.hidden-Q4_K_M.gguf' would be served as '.hid"),
        (["x..y-Q4_K_M.gguf"], ["x..y*"], "'x..y-Q4_K_M.gguf' would be served as 'x..y-Q4_K_M'"),
        (
            ["Qwen 7B-00001-of-00002.gguf", "Qwen 7B-00002-of-00002.gguf"],
            ["Qwen 7B-*"],
            "'Qwen 7B-00001-of-00002.gguf' would be served as 'Qwen 7B'",
        ),  # a split's prefix
    ],
)
def test_a_gguf_served_under_a_name_outside_the_rule_is_refused_at_add_losing_nothing(
    tmp_path: Path, root: Path, files: list[str], include: list[str], refused: str
) -> None:
    """Was: queued, downloaded and Ready, then served, and none of its rows recorded."""
    repo = make_repo(tmp_path / "repo")
    for name in files:
        write_gguf(repo / name)
    with hub_of(repo) as hub:
        kept = queue(root, hub)  # a model already in the library
        before = everything(root)
        with pytest.raises(control.RequestRefused) as caught:
            queue(root, hub, include=include)
    message = str(caught.value)
    assert message.startswith(f"{REPO}: {refused}"), message
    assert "which is not a served name: it " in message
    assert everything(root) == before, "nothing written, nothing removed"
    assert [m.id for m in mf.load_all(root)] == [kept.id]
    assert not [p for p in hub.paths if "/resolve/" in p], "nothing fetched"


def test_the_command_refuses_it_with_the_reason_and_exit_1(tmp_path: Path, root: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write_gguf(repo / LEGACY)
    with hub_of(repo) as hub:
        done = cli(
            "models", "add", REPO, "--revision", "main", "--include", LEGACY, env=cli_env(root, hub)
        )
    assert done.returncode == 1, done
    assert done.stderr == (
        f"lucia-supervisor: {REPO}: {LEGACY!r} would be served as 'Qwen 7B (Q4)', which is not a "
        "served name: it has a space: a served name has letters, digits and . _ : @ + - / only\n"
    )
    assert not root.exists() or not list(root.iterdir())


@pytest.mark.parametrize(
    "files",
    [
        ["mmproj model (F16).gguf", GGUF],  # an mmproj file is served under no name of its own
        ["Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf"],
        ["README (first).md", GGUF],  # not a GGUF: never served
    ],
)
def test_names_that_are_served_by_none_are_taken(
    tmp_path: Path, root: Path, files: list[str]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in files:
        if name.endswith(".gguf"):
            write_gguf(repo / name)
        else:
            (repo / name).write_text("read me\n")
    with hub_of(repo) as hub:
        queued = queue(root, hub, include=["*"])
    assert sorted(f.path for f in queued.hub_files) == sorted(files)


def test_a_gguf_a_library_held_before_the_rule_stays_ready_and_offered(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library from before the rule is not broken by it: the service's startup check passes
    the model, and the router's reader offers it under its own name."""
    repo = tmp_path / "repo"
    write_gguf(repo / LEGACY)
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with monkeypatch.context() as before_the_rule:
            before_the_rule.setattr(control, "served_name_problem", lambda _files: None)
            queued = queue(root, hub, include=[LEGACY])
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
        assert model.state == "Ready", model.message
    with running(root):  # its startup check: every Ready GGUF inspected again
        pass
    again = mf.load(root, queued.id)
    assert (again.state, again.message) == ("Ready", model.message)
    assert again.inspection is not None and again.inspection.units == ["Qwen 7B (Q4)"]
    (ready,) = scan(root).models
    assert [u.name for u in ggufcheck.group(ready.files).units] == ["Qwen 7B (Q4)"]
