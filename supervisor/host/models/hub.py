"""The hub's API before a download: a revision resolved to its commit, the commit's file tree.

The routes are the real hub's (huggingface_hub's hf_api.py): `GET
/api/models/{repo}/revision/{rev}` answers the commit as `sha`; `GET
/api/models/{repo}/tree/{commit}?recursive=true` lists each file's path, size, git blob id and,
for an LFS file, its sha256 (`lfs.oid`), paged through `Link: <...>; rel="next"`. Errors carry
`X-Error-Code`. The endpoint is HF_ENDPOINT's, as for the hf CLI. A token goes only into the
Authorization header, never into a message, and only to the endpoint: a next page elsewhere
(another scheme, host or port) is refused, not followed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urljoin, urlsplit

from supervisor.host.models.manifest import COMMIT, HubFile

DEFAULT_ENDPOINT: Final = "https://huggingface.co"
TIMEOUT: Final = 30.0
MAX_PAGES: Final = 1000
REPO: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
_NEXT: Final = re.compile(r'<([^>]+)>;\s*rel="next"')


class HubRefused(Exception):
    """The hub said no, or could not be reached; str() is one line for the operator."""


@dataclass(frozen=True)
class Hub:
    endpoint: str
    token: str | None = None

    @classmethod
    def from_env(cls, token: str | None) -> Hub:
        return cls(os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/"), token)

    def _get(self, url: str, what: str) -> tuple[Any, str | None]:
        request = urllib.request.Request(url, headers={"User-Agent": "lucia-supervisor"})  # noqa: S310
        if self.token:
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:  # noqa: S310
                return json.loads(answer.read()), answer.headers.get("Link")
        except urllib.error.HTTPError as exc:
            raise HubRefused(self._refusal(exc, what)) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise HubRefused(f"the hub at {self.endpoint} cannot be reached: {reason}") from None
        except ValueError:
            raise HubRefused(f"the hub's answer about {what} is not JSON") from None

    def _refusal(self, exc: urllib.error.HTTPError, what: str) -> str:
        code = exc.headers.get("X-Error-Code", "") if exc.headers else ""
        if exc.code in (401, 403) or code == "GatedRepo":
            given = "the token given is refused" if self.token else "no token is set"
            return f"{what} needs a token with access to it ({exc.code}; {given})"
        if code == "RevisionNotFound":
            return f"{what}: the hub has no such revision (404)"
        if code == "RepoNotFound" or exc.code == 404:
            return f"{what}: not found on the hub ({exc.code} {code or 'Not Found'})"
        return f"{what}: the hub answered {exc.code} {exc.reason}"

    def resolve(self, repo: str, revision: str) -> str:
        """The commit a revision (a commit, a branch or a tag) names now."""
        url = f"{self.endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
        info, _ = self._get(url, f"{repo} at revision {revision!r}")
        commit = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
            raise HubRefused(f"the hub named no commit for {repo} at {revision!r}")
        return commit

    def tree(self, repo: str, commit: str) -> list[HubFile]:
        """Every file of the repository at commit, with its size and ids."""
        url: str | None = f"{self.endpoint}/api/models/{repo}/tree/{commit}?recursive=true"
        files: list[HubFile] = []
        for _ in range(MAX_PAGES):
            if url is None:
                return files
            page, link = self._get(url, f"{repo}'s files at {commit}")
            files.extend(parse_tree(page))
            found = _NEXT.search(link or "")
            url = self._same_endpoint(urljoin(url, found[1]), repo) if found else None
        raise HubRefused(f"{repo}'s file list is longer than {MAX_PAGES} pages")

    def _same_endpoint(self, url: str, repo: str) -> str:
        """A next page's url, when it is on the endpoint's own scheme, host and port."""
        ours = _origin(self.endpoint)
        if ours is None or _origin(url) != ours:
            shown = urlsplit(url)._replace(path="", query="", fragment="").geturl()
            raise HubRefused(
                f"the hub's next page of {repo}'s files is elsewhere ({shown:.200}),"
                f" not at {self.endpoint}: not followed"
            )
        return url


def _origin(url: str) -> tuple[str, str | None, int | None] | None:
    """A url's scheme, host and port (the scheme's default filled in), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    return parts.scheme.lower(), parts.hostname, port


def parse_tree(page: object) -> list[HubFile]:
    """The files of one page of the tree listing (folders are left out)."""
    if not isinstance(page, list):
        raise HubRefused("the hub's file list is not a list")
    files: list[HubFile] = []
    for entry in page:
        if not isinstance(entry, dict) or entry.get("type") != "file":
            continue
        lfs = entry.get("lfs")
        sha256 = lfs.get("oid") if isinstance(lfs, dict) else None
        try:
            files.append(
                HubFile(path=entry["path"], size=entry["size"], sha256=sha256, gitOid=entry["oid"])
            )
        except (KeyError, ValueError):
            raise HubRefused(f"the hub's file list has a malformed entry: {entry!r:.200}") from None
        if not safe_path(files[-1].path):
            raise HubRefused(f"the hub lists a file path that is not safe: {files[-1].path!r}")
    return files


def safe_path(path: str) -> bool:
    """A relative path with no '..', no empty part and no control character."""
    parts = path.split("/")
    return (
        bool(path)
        and not path.startswith("/")
        and all(part not in ("", ".", "..") for part in parts)
        and not any(ord(c) < 32 or c == "\\" for c in path)
    )


def included(path: str, patterns: list[str]) -> bool:
    """Whether hf download --include PATTERN... takes path (its fnmatch rules; none: all)."""
    if not patterns:
        return True
    wanted = [p + "*" if p.endswith("/") else p for p in patterns]
    return any(fnmatch.fnmatch(path, pattern) for pattern in wanted)


def select(files: list[HubFile], patterns: list[str]) -> list[HubFile]:
    return [f for f in files if included(f.path, patterns)]


def check_repo(repo: str) -> str:
    if not REPO.fullmatch(repo) or ".." in repo:
        raise ValueError(f"{repo!r} is not a repository id (owner/name)")
    return repo
