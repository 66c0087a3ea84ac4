"""The recipe's git checkout, at exactly one pinned commit, verified before use."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

import git
import git.exc

from supervisor.docker.process import run
from supervisor.engines.base import StepContext
from supervisor.errors import Permanent

_GIT_ENV: Final = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "LC_ALL": "C"}


class GitCheckout:
    def __init__(self, path: Path, repository: str, commit: str) -> None:
        self.path = path
        self.repository = repository
        self.commit = commit
        self._last_error = ""

    def verify(self) -> str | None:
        """None when the checkout is at the commit with a clean tree; otherwise what is wrong."""
        if not (self.path / ".git").is_dir():
            return "no checkout yet"
        try:
            repo = git.Repo(self.path)
            head = repo.head.commit.hexsha if repo.head.is_valid() else None
            if head != self.commit:
                return f"checkout is at {head or 'nothing'}, not {self.commit}"
            if repo.is_dirty(untracked_files=True):
                return "checkout has local changes"
        except (git.exc.GitError, ValueError, OSError) as exc:
            return f"checkout is unusable: {exc}"
        return None

    def ensure(self, ctx: StepContext) -> None:
        """Fetch the pinned commit (just that commit where the remote allows) and check it out."""
        problem = self.verify()
        if problem is None:
            return
        ctx.progress(f"fetching {self.commit[:12]} from {self.repository}")
        repo = self._repo()
        if not self._has_commit(repo):
            shallow = self._git(
                repo, ctx, "fetch", "--depth", "1", "--progress", "origin", self.commit
            )
            if shallow != 0 or not self._has_commit(repo):
                self._full_fetch(repo, ctx)
        if not self._has_commit(repo):
            raise Permanent(
                f"commit {self.commit} does not exist in {self.repository}; "
                "fix source.commit in the recipe"
            )
        self._git(repo, ctx, "checkout", "--force", "--detach", self.commit, required=True)
        self._git(repo, ctx, "clean", "-ffdx", "--quiet", required=True)
        problem = self.verify()
        if problem is not None:
            raise Permanent(f"checkout of {self.commit} could not be verified: {problem}")

    def _repo(self) -> git.Repo:
        if (self.path / ".git").is_dir():
            try:
                repo = git.Repo(self.path)
                if repo.remotes and repo.remotes.origin.url == self.repository:
                    return repo
            except (git.exc.GitError, ValueError, AttributeError):
                pass
        if self.path.exists():
            shutil.rmtree(self.path)  # ours alone, in the worker's state directory
        self.path.mkdir(mode=0o700, parents=True)
        repo = git.Repo.init(self.path)
        repo.create_remote("origin", self.repository)
        return repo

    def _has_commit(self, repo: git.Repo) -> bool:
        try:
            return repo.commit(self.commit).hexsha == self.commit
        except (git.exc.GitError, ValueError):
            return False

    def _full_fetch(self, repo: git.Repo, ctx: StepContext) -> None:
        code = self._git(
            repo,
            ctx,
            "fetch",
            "--progress",
            "--tags",
            "origin",
            "+refs/heads/*:refs/remotes/origin/*",
        )
        if code != 0 and not self._has_commit(repo):
            raise Permanent(
                f"cannot fetch {self.repository} (git exit {code}): {self._last_error}; "
                "check that the remote is reachable, then request again"
            )

    def _git(self, repo: git.Repo, ctx: StepContext, *args: str, required: bool = False) -> int:
        """Run one git command (gitpython's executable), streaming progress; a cancel ends it."""
        outcome = run(
            [repo.git.GIT_PYTHON_GIT_EXECUTABLE or "git", *args],
            cwd=self.path,
            env={**os.environ, **_GIT_ENV},
            progress=ctx.progress,
            cancel=ctx.cancel,
        )
        self._last_error = next(
            (line for line in reversed(outcome.tail) if "fatal" in line or "error" in line),
            outcome.tail[-1] if outcome.tail else "no output",
        )
        if required and outcome.code != 0:
            raise Permanent(f"git {args[0]} failed: {' | '.join(outcome.tail[-3:])}")
        return outcome.code
