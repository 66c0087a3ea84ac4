"""Where an engine of the tests or the bench keeps its files, and what its container is named."""

from __future__ import annotations

from pathlib import Path

from supervisor.protocol import layout


class EngineDirs:
    """The layout under `root` of the engine `name`, as the worker is pointed at it."""

    name: str
    root: Path

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def dir(self) -> Path:
        return self.data_dir / self.name

    @property
    def status_path(self) -> Path:
        return self.dir / layout.STATUS

    @property
    def recipe_path(self) -> Path:
        return self.root / f"{self.name}.toml"

    @property
    def container(self) -> str:
        return f"lucia-{self.name}"
