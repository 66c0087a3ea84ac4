"""What hf writes is held to the list the library verified: a mirror that lists more to the hf
CLI than to the library gets its extra files removed and the download Failed; a name that would
leave the library is refused by the hf CLI itself (huggingface_hub 1.26 and later); the
free-space check still speaks once more bytes are written than the hub listed; the tree's next
page is followed, with the token, only on the endpoint's own scheme, host and port; and the
token is masked in what hf said, its file gone even after a killed queue."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog
from packaging.requirements import Requirement

from supervisor.host.models import job
from supervisor.host.models.control import space_during, strays
from supervisor.host.models.hub import Hub, HubRefused
from supervisor.host.models.runner import Runner
from tests.host.library_world import (
    GGUF,
    ROOT,
    alive,
    hub_of,
    make_repo,
    queue,
    running,
    wait_state,
)

TINY = b"GGUF" + b"\0" * 60


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


def everything(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*")}


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"extra-Q4_K_M.gguf": TINY}, id="beside the listed file"),
        pytest.param({"sub/extra-Q4_K_M.gguf": TINY, "sub/x-Q4_K_M.bin": TINY}, id="a folder"),
    ],
)
def test_files_the_verified_list_does_not_name_fail_the_download_and_are_removed(
    repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, bytes]
) -> None:
    with hub_of(repo, unlisted=extra) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub, include=["*Q4_K_M*"])
        assert [f.path for f in queued.hub_files] == [GGUF], "our list: the tree we were told"
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    fetched = {p.split("/resolve/", 1)[1].split("/", 1)[1] for p in hub.paths if "/resolve/" in p}
    assert set(extra) <= fetched, "the hf CLI took the mirror's longer list"
    assert model.state == "Failed"
    assert model.message.startswith("files arrived that the hub's list does not name, removed: ")
    top = sorted({name.split("/")[0] for name in extra})
    assert all(repr(name) in model.message for name in top), model.message
    files = root / queued.id / "files"
    assert not {n.split("/")[0] for n in extra} & everything(files)
    assert (files / GGUF).read_bytes() == (repo / GGUF).read_bytes(), "the listed file is kept"


@pytest.mark.parametrize("name", ["../evil-Q4_K_M.gguf", "../../evil-Q4_K_M.gguf"])
def test_a_name_that_leaves_the_library_is_refused_by_hf_itself(
    tmp_path: Path, repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    before = everything(tmp_path)
    with hub_of(repo, unlisted={name: TINY}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub, include=["*Q4_K_M*"])
        with running(root):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.state == "Failed", model.message
    assert "cannot contain a '..' path segment" in model.message, model.message
    outside = {p for p in everything(tmp_path) - before if not p.startswith("models/")}
    assert not [p for p in outside if "evil" in p], outside
    assert not [p for p in everything(root) if "evil" in p]
    assert not any(name.rsplit("/", maxsplit=1)[-1] in p for p in hub.paths)


def test_the_hf_cli_refuses_names_that_leave_its_local_dir(tmp_path: Path) -> None:
    """The check the library relies on, in the installed huggingface_hub: every file hf
    download writes under --local-dir goes through get_local_download_paths."""
    from huggingface_hub._local_folder import get_local_download_paths

    for name in ("../x.gguf", "a/../../x.gguf", "/etc/x", "a/..\\..\\x"):
        with pytest.raises(ValueError, match="Invalid filename"):
            get_local_download_paths(tmp_path / "files", name)
    assert not (tmp_path / "x.gguf").exists()


def test_the_required_huggingface_hub_is_one_that_checks() -> None:
    """huggingface_hub checks '..' under local_dir on Linux from 1.26 (its PR 4540): the
    dependency may not allow an older one, and the installed one is allowed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (hub,) = [Requirement(d) for d in project["dependencies"] if d.startswith("huggingface_hub")]
    assert not hub.specifier.contains("1.25.1") and hub.specifier.contains("1.26.0")
    assert hub.specifier.contains(importlib.metadata.version("huggingface_hub"))


ALL = {"a.gguf", "b.gguf", "d/b.gguf", "d/c.gguf", "d/e/f"}


@pytest.mark.parametrize(
    ("expected", "found"),
    [
        (ALL, ["link"]),
        ({"a.gguf"}, ["b.gguf", "d", "link"]),
        ({"d/b.gguf"}, ["a.gguf", "b.gguf", "d/c.gguf", "d/e", "link"]),
        ({"a.gguf", "link"}, ["b.gguf", "d", "link"]),
    ],
)
def test_strays(tmp_path: Path, expected: set[str], found: list[str]) -> None:
    """The top-most paths that are not listed, hf's .cache/ left alone; a symlink always."""
    local = tmp_path / "files"
    for name in (*ALL, ".cache/huggingface/download/a.gguf.metadata"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(b"x")
    (local / "link").symlink_to(tmp_path)
    assert strays(local, expected) == found


FULL = (
    "not enough disk space: {} bytes are written, as many as the 100 listed or more, and no "
    "byte is free"
)


@pytest.mark.parametrize(
    ("total", "done", "free", "problem"),
    [
        (100, 40, 60, None),
        (100, 40, 59, "not enough disk space: it needs 60 bytes more and 59 bytes are free"),
        (100, 150, 10, None),
        (100, 100, 0, FULL.format(100)),
        (100, 150, 0, FULL.format(150)),
    ],
)
def test_the_space_check_while_hf_writes(
    total: int, done: int, free: int, problem: str | None
) -> None:
    assert space_during(total, done, free) == problem


def fake_hf(directory: Path, body: str) -> Path:
    """An executable that stands for the hf CLI: `local` is its --local-dir."""
    program = directory / "hf"
    program.write_text(
        f"#!{sys.executable}\nimport os, sys, time\nfrom pathlib import Path\n"
        "local = Path(sys.argv[sys.argv.index('--local-dir') + 1])\n" + body
    )
    program.chmod(0o755)
    return program


def test_the_space_check_speaks_once_more_is_written_than_the_hub_listed(
    tmp_path: Path, repo: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror sends more than it listed, and the disk fills: the check that compared the
    free space with `total - done` (negative by then) said nothing, and hf wrote on."""
    pidfile = tmp_path / "hf.pid"
    program = fake_hf(
        tmp_path,
        f"Path({str(pidfile)!r}).write_text(str(os.getpid()))\n"
        "(local / 'extra.bin').write_bytes(b'x' * 3 * 2**20)\n"
        "time.sleep(5)\n",
    )
    monkeypatch.setattr(
        job, "free_bytes", lambda path: 0 if (path / "extra.bin").exists() else 2**40
    )
    with hub_of(repo) as hub:
        queued = queue(root, hub)
        with running(root, program=str(program)):
            model = wait_state(root, queued.id, "Ready", "Failed")
    # The child names itself: the download may end before its record's pid is ever read.
    pid = int(pidfile.read_text())
    assert model.message.startswith(
        "the disk filled during the download: not enough disk space: "
    ), model.message
    assert "no byte is free" in model.message
    assert model.message.endswith(
        "; files arrived that the hub's list does not name, removed: 'extra.bin'"
    ), model.message
    assert not alive(pid)
    assert not (root / queued.id / "files" / "extra.bin").exists()
    assert os.listdir(root / queued.id / "files") in ([], [".cache"])


class Pages(BaseHTTPRequestHandler):
    """A hub's tree in two pages; the first's Link is the server's `link`; every request's
    path and Authorization recorded in the server's `seen`."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        server: Any = self.server
        server.seen.append((self.path, self.headers.get("Authorization")))
        second = "cursor=2" in self.path
        entry = {
            "type": "file",
            "path": "b.gguf" if second else "a.gguf",
            "size": 1,
            "oid": "0" * 40,
        }
        data = json.dumps([entry]).encode()
        self.send_response(200)
        if not second and server.link:
            self.send_header("Link", f'<{server.link}>; rel="next"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def pages(host: str, link: str | None = None) -> Iterator[Any]:
    server: Any = ThreadingHTTPServer((host, 0), Pages)
    server.seen, server.link = [], link
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


TREE = "/api/models/o/r/tree/" + "5" * 40


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("{ours}", id="the endpoint"),
        pytest.param("", id="relative to it"),
    ],
)
def test_the_next_page_on_the_endpoint_is_followed(where: str) -> None:
    with pages("127.0.0.1") as ours:
        endpoint = f"http://127.0.0.1:{ours.server_address[1]}"
        ours.link = where.format(ours=endpoint) + TREE + "?recursive=true&cursor=2"
        files = Hub(endpoint, "hf_secret_token").tree("o/r", "5" * 40)
    assert [f.path for f in files] == ["a.gguf", "b.gguf"]
    assert [auth for _, auth in ours.seen] == ["Bearer hf_secret_token"] * 2


@pytest.mark.parametrize(
    "elsewhere",
    [
        pytest.param("http://127.0.0.1:{port}", id="another port"),
        pytest.param("http://127.0.0.2:{port}", id="another host"),
        pytest.param("https://127.0.0.1:{ours}", id="another scheme"),
        pytest.param("//127.0.0.2:{port}", id="another host, scheme-relative"),
    ],
)
def test_the_next_page_elsewhere_is_refused_and_never_sent_the_token(elsewhere: str) -> None:
    with pages("127.0.0.1") as ours, pages("127.0.0.2") as theirs, pages("127.0.0.1") as other:
        port = (theirs if "127.0.0.2" in elsewhere else other).server_address[1]
        ours.link = elsewhere.format(port=port, ours=ours.server_address[1]) + TREE + "?cursor=2"
        endpoint = f"http://127.0.0.1:{ours.server_address[1]}"
        with pytest.raises(HubRefused, match="next page of o/r's files is elsewhere"):
            Hub(endpoint, "hf_secret_token").tree("o/r", "5" * 40)
        assert theirs.seen == [] and other.seen == []
        assert len(ours.seen) == 1


def test_the_hub_token_is_masked_in_what_hf_said(tmp_path: Path, repo: Path, root: Path) -> None:
    """hf's last line becomes the model's message: a token in it is masked, there and in the
    journal."""
    token = "hf_" + "t" * 34
    token_file = tmp_path / "hf-token"
    token_file.write_text(token + "\n")
    program = fake_hf(
        tmp_path,
        "token = Path(os.environ['HF_TOKEN_PATH']).read_text()\n"
        "print(f'401 Unauthorized: the token {token} is refused', file=sys.stderr)\n"
        "sys.exit(1)\n",
    )
    with hub_of(repo) as hub, structlog.testing.capture_logs() as journal:
        queued = queue(root, hub)
        with running(root, program=str(program), token_file=token_file):
            model = wait_state(root, queued.id, "Ready", "Failed")
    assert model.message == "hf download exited 1: 401 Unauthorized: the token *** is refused"
    assert token not in (root / queued.id / "model.json").read_text()
    assert token not in repr(journal)
    assert not list((root / job.TOKENS_DIR).iterdir()), "the token file ends with the download"


def test_token_files_a_killed_queue_left_are_removed_at_startup(root: Path) -> None:
    tokens = root / job.TOKENS_DIR
    tokens.mkdir(parents=True)
    left = tokens / ("a" * 32)
    left.write_text("hf_left_behind")
    left.chmod(0o400)
    runner = Runner(root, job.QueueSettings())
    try:
        said = runner.start()
    finally:
        runner.lease.release()
    assert not left.exists() and tokens.is_dir()
    assert said == ["removed 1 hub token files a stopped queue left"]
