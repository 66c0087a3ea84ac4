"""A Hugging Face hub of the test's own: the real hub's file routes for one model, served from a
directory, so the real hf CLI downloads from it through `HF_ENDPOINT` where the hub cannot be
reached.

Routes, as huggingface_hub calls them (`hf_api.py`, `file_download.py`): `GET
/api/models/{repo}/revision/{rev}` (the model info with its siblings; `rev` a commit or a
branch), `GET /api/models/{repo}/tree/{rev}` (the recursive listing: git blob ids, sizes, and LFS
sha256 for `*.safetensors` and `*.gguf`), and `HEAD`/`GET /{repo}/resolve/{rev}/{filename}` with
`X-Repo-Commit`, `ETag` (the git blob id) or, for an LFS file, `X-Linked-Etag` (its sha256) and
`X-Linked-Size`. Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo). Each request's Authorization header is recorded.

Faults: `slow` dribbles file bodies (a download that lasts); `stall_after` sends that many bytes
of each file body and then nothing until the hub stops; `corrupt` names files whose served bytes
differ from what the tree's LFS id says (one byte flipped, same size); `token` makes the repo
gated (401 without `Authorization: Bearer <token>`); `unlisted` (path -> bytes) are files a
mirror lists and serves to the hf CLI but leaves out of the lists it answers lucia-supervisor's
own client (its User-Agent), as a mirror that answers the two differently would.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Hub:
    repo_id: str
    revision: str
    directory: Path
    host: str
    slow: bool = False
    chunk: int = 4096  # bytes a slow hub sends every half second
    branches: dict[str, str] = field(default_factory=dict)
    stall_after: int | None = None
    corrupt: frozenset[str] = frozenset()
    token: str | None = None
    unlisted: dict[str, bytes] = field(default_factory=dict)
    authorizations: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _signature: tuple[tuple[str, int, int], ...] | None = None
    _files: dict[str, bytes] = field(default_factory=dict)
    _listing: list[dict[str, object]] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    def files(self) -> dict[str, bytes]:
        """The repo's files by path, read again only when a file's size or mtime changed."""
        paths = sorted(p for p in self.directory.rglob("*") if p.is_file())
        signature = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
        with self._lock:
            if signature != self._signature:
                self._files = {str(p.relative_to(self.directory)): p.read_bytes() for p in paths}
                self._listing = self._tree(self._files)
                self._signature = signature
            return self._files

    def tree(self) -> list[dict[str, object]]:
        self.files()
        return self._listing

    @staticmethod
    def _tree(files: dict[str, bytes]) -> list[dict[str, object]]:
        listing: list[dict[str, object]] = []
        for name, data in files.items():
            entry: dict[str, object] = {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": _git_blob(data),
            }
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            listing.append(entry)
        return listing

    def __enter__(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _commit(self, rev: str) -> str | None:
        if rev == self.revision:
            return rev
        return self.branches.get(rev)

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        authorization = handler.headers.get("Authorization")
        self.authorizations.append(authorization)
        path = unquote(urlsplit(handler.path).path)
        self.paths.append(f"{handler.command} {path}")
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if not path.startswith((api, resolve)):
            self._error(handler, 404, "RepoNotFound")
            return
        if self.token is not None and authorization != f"Bearer {self.token}":
            self._error(handler, 401, "GatedRepo")
            return
        if path.startswith(api + "revision/"):
            commit = self._commit(path[len(api + "revision/") :])
            if commit is None:
                self._error(handler, 404, "RevisionNotFound")
                return
            siblings = [{"rfilename": name} for name in self.served(handler)]
            self._json(handler, {"id": self.repo_id, "sha": commit, "siblings": siblings})
        elif path.startswith(api + "tree/"):
            if self._commit(path[len(api + "tree/") :].rstrip("/")) is None:
                self._error(handler, 404, "RevisionNotFound")
                return
            served = self.served(handler)
            self._json(
                handler,
                self.tree()
                + self._tree({k: v for k, v in served.items() if k not in self.files()}),
            )
        elif path.startswith(resolve):
            rev, _, name = path[len(resolve) :].partition("/")
            commit = self._commit(rev)
            if commit is None:
                self._error(handler, 404, "RevisionNotFound")
            elif name not in self.served(handler):
                self._error(handler, 404, "EntryNotFound")
            else:
                self._file(handler, name, commit, body)
        else:
            self._error(handler, 404, "EntryNotFound")

    def served(self, handler: BaseHTTPRequestHandler) -> dict[str, bytes]:
        """The files this caller is told of: lucia-supervisor's own client is not told of the
        unlisted ones."""
        ours = (handler.headers.get("User-Agent") or "").startswith("lucia-supervisor")
        return self.files() if ours or not self.unlisted else {**self.files(), **self.unlisted}

    def _error(self, handler: BaseHTTPRequestHandler, code: int, error: str) -> None:
        data = json.dumps({"error": error}).encode()
        handler.send_response(code)
        handler.send_header("X-Error-Code", error)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def _json(self, handler: BaseHTTPRequestHandler, value: object) -> None:
        data = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _file(self, handler: BaseHTTPRequestHandler, name: str, commit: str, body: bool) -> None:
        data = self.served(handler)[name]
        listing = self.tree() if name in self.files() else self._tree({name: data})
        (entry,) = [e for e in listing if e["path"] == name]
        if name in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", f'"{entry["oid"]}"')
        lfs = entry.get("lfs")
        if isinstance(lfs, dict):
            handler.send_header("X-Linked-Etag", f'"{lfs["oid"]}"')
            handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if not body:
            return
        if self.stall_after is not None:
            handler.wfile.write(data[: self.stall_after])
            handler.wfile.flush()
            self._stop.wait()  # nothing more until the hub stops
            return
        if not self.slow:
            handler.wfile.write(data)
            return
        for start in range(0, len(data), 4096):  # a download that lasts minutes
            if self._stop.is_set():
                return
            handler.wfile.write(data[start : start + 4096])
            handler.wfile.flush()
            time.sleep(0.5)
