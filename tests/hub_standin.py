"""A Hugging Face hub of the test's own: the real hub's file routes for one model, served from a
directory, so the real hf CLI downloads from it through `HF_ENDPOINT` where the hub cannot be
reached.

Routes, as huggingface_hub calls them (`hf_api.py`, `file_download.py`): `GET
/api/models/{repo}/revision/{rev}` (the model info with its siblings), `GET
/api/models/{repo}/tree/{rev}` (the recursive listing: git blob ids, sizes, and LFS sha256 for
`*.safetensors`), and `HEAD`/`GET /{repo}/resolve/{rev}/{filename}` with `X-Repo-Commit`, `ETag`
(the git blob id) or, for an LFS file, `X-Linked-Etag` (its sha256) and `X-Linked-Size`. Each
request's Authorization header is recorded. `slow` dribbles file bodies (a download that lasts).
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


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Hub:
    repo_id: str
    revision: str
    directory: Path
    host: str
    slow: bool = False
    authorizations: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.directory.iterdir()) if p.is_file()}

    def tree(self) -> list[dict[str, object]]:
        listing: list[dict[str, object]] = []
        for name, data in self.files().items():
            entry: dict[str, object] = {"type": "file", "path": name, "size": len(data),
                                        "oid": _git_blob(data)}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}
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
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        self.authorizations.append(handler.headers.get("Authorization"))
        path = unquote(urlsplit(handler.path).path)
        self.paths.append(f"{handler.command} {path}")
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/{self.revision}/"
        if path == api + f"revision/{self.revision}":
            siblings = [{"rfilename": name} for name in self.files()]
            self._json(handler, {"id": self.repo_id, "sha": self.revision, "siblings": siblings})
        elif path.rstrip("/") == api + f"tree/{self.revision}":
            self._json(handler, self.tree())
        elif path.startswith(resolve) and path[len(resolve):] in self.files():
            self._file(handler, path[len(resolve):], body)
        else:
            handler.send_response(404)
            handler.send_header("X-Error-Code", "EntryNotFound")
            handler.send_header("Content-Length", "0")
            handler.end_headers()

    def _json(self, handler: BaseHTTPRequestHandler, value: object) -> None:
        data = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _file(self, handler: BaseHTTPRequestHandler, name: str, body: bool) -> None:
        data = self.files()[name]
        (entry,) = [e for e in self.tree() if e["path"] == name]
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", self.revision)
        handler.send_header("ETag", f'"{entry["oid"]}"')
        lfs = entry.get("lfs")
        if isinstance(lfs, dict):
            handler.send_header("X-Linked-Etag", f'"{lfs["oid"]}"')
            handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if not body:
            return
        if not self.slow:
            handler.wfile.write(data)
            return
        for start in range(0, len(data), 4096):  # a download that lasts minutes
            handler.wfile.write(data[start:start + 4096])
            handler.wfile.flush()
            time.sleep(0.5)
