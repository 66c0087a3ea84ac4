"""Downloads with the real hf CLI from the tests' hub: Ready with the inspection, and each fault
ending in a clear state and message with nothing else harmed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from supervisor.host.models import manifest as mf
from supervisor.host.models.control import RequestRefused, apply, request
from supervisor.host.models.hub import HubRefused
from supervisor.library.models import scan
from tests.gguf_fixtures import write_gguf
from tests.host.library_world import (
    COMMIT,
    GGUF,
    REPO,
    alive,
    hub_of,
    make_repo,
    queue,
    running,
    wait_for,
    wait_state,
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


def test_a_branch_is_resolved_and_the_gguf_becomes_ready_with_its_inspection(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        assert queued.source.commit == COMMIT and queued.source.revision == "main"
        assert [f.path for f in queued.hub_files] == [GGUF]  # --include picked one quantisation
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Ready", model.message
    assert model.inspection is not None
    assert (model.inspection.format, model.inspection.architecture) == ("gguf", "llama")
    assert model.inspection.context == 128
    assert model.inspection.size_bytes == (repo / GGUF).stat().st_size
    assert model.bytes_done == model.bytes_total == (repo / GGUF).stat().st_size
    assert all(f.verified for f in model.hub_files)
    files = root / model.id / "files"
    assert (files / GGUF).read_bytes() == (repo / GGUF).read_bytes()
    assert not (files / "README.md").exists() and not (files / "tiny-Q8_0.gguf").exists()
    assert not list(files.rglob("*.incomplete"))
    # what the router reads: the Ready model and its file
    library = scan(root)
    assert [(m.guid, [p.name for p in m.files]) for m in library.models] == [(model.id, [GGUF])]
    assert any(f"/resolve/{COMMIT}/" in p for p in hub.paths)  # the commit, never the branch


def test_a_file_whose_bytes_differ_from_the_lfs_id_fails_naming_it(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hub_of(repo, corrupt=frozenset({GGUF})) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Failed"
    assert model.message.startswith(f"{GGUF}: SHA-256 check failed against the hub's LFS id")
    assert hashlib.sha256((repo / GGUF).read_bytes()).hexdigest() in model.message
    assert not (root / model.id / "files" / GGUF).exists()  # a retry fetches it again
    assert scan(root).models == ()


def test_a_truncated_gguf_fails_its_header_check(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = (repo / GGUF).read_bytes()
    (repo / GGUF).write_bytes(data[:40])  # the hub's LFS id is of these 40 bytes: hashes pass
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Failed"
    assert model.message.startswith(f"{GGUF}: GGUF header check failed: truncated GGUF header")


def test_a_stalled_hub_fails_the_download_with_that_reason_and_ends_the_child(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hub_of(repo, stall_after=64) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root, stall_after=2.0):
            pid = wait_for("the hf child", lambda: state_of_pid(root, queued.id))
            model = wait_state(root, queued.id, "Failed", "Ready")
            assert model.state == "Failed"
            assert model.message == "stalled: no bytes arrived for 2 s"
            wait_for("the hf child to end", lambda: not alive(pid))
        assert not list((root / model.id / "files").rglob("*.incomplete"))


def state_of_pid(root: Path, guid: str) -> int | None:
    return mf.load(root, guid).pid


def test_a_revision_the_hub_does_not_have_is_refused_before_anything_is_queued(
    repo: Path, root: Path
) -> None:
    with hub_of(repo) as hub:
        with pytest.raises(HubRefused, match="the hub has no such revision"):
            queue(root, hub, revision="no-such-branch")
        with pytest.raises(HubRefused, match="the hub has no such revision"):
            queue(root, hub, revision="0" * 40)
        with pytest.raises(HubRefused, match=r"no file of .* matches --include \*\.bin"):
            queue(root, hub, include=["*.bin"])
    assert mf.load_all(root) == []


def test_the_queue_holds_at_most_sixteen(repo: Path, root: Path) -> None:
    with hub_of(repo) as hub:
        for index in range(16):
            model = queue(root, hub)
            mf.save(root, model.model_copy(update={"name": f"m{index}"}))
        with pytest.raises(RequestRefused, match=r"the queue holds 16 downloads \(at most 16\)"):
            queue(root, hub)


def test_cancel_ends_the_child_and_leaves_no_partial_then_retry_finishes_it(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_big(repo)
    with hub_of(repo, slow=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root):
            pid = wait_for("the hf child", lambda: state_of_pid(root, queued.id))
            assert request(root, queued.id, "cancel") is False  # the running queue takes it
            model = wait_state(root, queued.id, "Canceled")
            assert model.message == "canceled; finished files are kept" and model.pid is None
            assert not alive(pid)
            assert not list((root / queued.id / "files").rglob("*.incomplete"))
            hub.slow = False
            request(root, queued.id, "retry")
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Ready", model.message


def write_big(repo: Path) -> None:
    write_gguf(repo / GGUF, elements=200_000)


def test_remove_deletes_the_model_directory_and_nothing_else(repo: Path, root: Path) -> None:
    with hub_of(repo) as hub:
        first, second = queue(root, hub), queue(root, hub, include=["tiny-Q8_0.gguf"])
    outside = root / "keep.txt"
    outside.write_text("mine")
    (root / first.id / "files" / "link").symlink_to(outside)
    assert request(root, first.id, "remove") is True  # no queue runs: applied at once
    assert not (root / first.id).exists()
    assert (root / second.id / "model.json").is_file() and outside.read_text() == "mine"
    with pytest.raises(RequestRefused, match="only a Failed, Canceled or Interrupted"):
        apply(root, second.id, "retry", limit_queue=True)


def test_a_ready_gguf_that_no_longer_passes_fails_at_startup(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root):
            wait_state(root, queued.id, "Ready")
    path = root / queued.id / "files" / GGUF
    with path.open("r+b") as f:
        f.write(b"GGML")
    with running(root):
        model = mf.load(root, queued.id)
    assert model.state == "Failed"
    assert model.message == (
        f"startup check: {GGUF}: GGUF header check failed: "
        "not a GGUF file (does not start with GGUF)"
    )


def _hf_repo(directory: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 512,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file({"w": np.ones((4, 4), dtype=np.float32)}, str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    return directory


@pytest.mark.parametrize(
    ("damage", "state", "message"),
    [
        (None, "Ready", "ready: hf LlamaForCausalLM, context 512"),
        (
            "model.safetensors",
            "Failed",
            "model.safetensors: safetensors header check failed: tensors end at byte 136, "
            "the file has 132",
        ),
        (
            "tokenizer.json",
            "Failed",
            "HF layout check failed: no tokenizer.json or tokenizer.model",
        ),
        ("config.json", "Failed", "config.json: JSON check failed: not an object"),
    ],
)
def test_an_hf_layout_model_gets_the_checks_that_fit_it(
    tmp_path: Path,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: str | None,
    state: str,
    message: str,
) -> None:
    repo = _hf_repo(tmp_path / "hf")
    if damage == "model.safetensors":
        data = (repo / damage).read_bytes()
        (repo / damage).write_bytes(data[:-4])  # the hub's LFS id is of the cut file
    elif damage == "tokenizer.json":
        (repo / damage).unlink()
    elif damage == "config.json":
        (repo / damage).write_text("[1]")
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub, include=["*.json", "*.safetensors"])
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert (model.state, model.message) == (state, message)
    if state == "Ready":
        assert model.inspection is not None and model.inspection.format == "hf"
        assert model.inspection.size_bytes == sum(f.stat().st_size for f in repo.iterdir())


def test_retry_keeps_the_verified_files_and_fetches_only_the_one_that_fails_its_check(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub, include=["*.gguf"])
        with running(root):
            wait_state(root, queued.id, "Ready")
        files = root / queued.id / "files"
        damaged = files / "tiny-Q8_0.gguf"
        with damaged.open("r+b") as f:  # a bit flipped on disk since
            f.seek(20)
            f.write(b"\xff")
        kept = (files / GGUF).stat()
        model = mf.load(root, queued.id)
        hub_files = [f.model_copy(update={"verified": f.path == GGUF}) for f in model.hub_files]
        mf.save(root, model.model_copy(update={"hub_files": hub_files}).transition("Failed", "x"))
        hub.paths.clear()
        assert request(root, queued.id, "retry") is True  # no queue runs: applied at once
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Ready", model.message
    assert damaged.read_bytes() == (repo / "tiny-Q8_0.gguf").read_bytes()
    fetched = [p for p in hub.paths if p.startswith("GET") and "/resolve/" in p]
    assert fetched == [f"GET /{REPO}/resolve/{COMMIT}/tiny-Q8_0.gguf"]
    assert (files / GGUF).stat().st_ino == kept.st_ino  # the verified file was left alone


def test_a_split_gguf_in_a_sub_folder_is_linked_where_the_router_reads_it(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.gguf_fixtures import write_split

    repo = tmp_path / "split"
    write_split(repo / "Q4_K_M", "tiny-Q4_K_M", 2)
    write_gguf(repo / "Q8_0" / "tiny-Q8_0.gguf")
    with hub_of(repo) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub, include=["Q4_K_M/"])
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Ready", model.message
    assert model.inspection is not None and model.inspection.units == ["tiny-Q4_K_M"]
    shards = ["tiny-Q4_K_M-00001-of-00002.gguf", "tiny-Q4_K_M-00002-of-00002.gguf"]
    assert [f.name for f in model.files] == shards
    files = root / model.id / "files"
    assert all((files / s).samefile(files / "Q4_K_M" / s) for s in shards)
    (ready,) = scan(root).models
    assert [p.name for p in ready.files] == shards
