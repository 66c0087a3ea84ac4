"""Where a vLLM recipe's model is on the host, and whether its download is done.

The model is an HF id at a pinned revision, downloaded by the engine's own step into the cache
a run volume holds (its snapshot found through that volume), or a library model's files. The
download's stamp (state/model.json) says which id and revision ended well into which snapshot.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.docker.spec import Mount
from supervisor.engines.vllm import model as hf_model
from supervisor.engines.vllm import tiers as kv_tiers
from supervisor.engines.vllm.recipe import VllmRecipe


class ModelFiles:
    """The recipe's model on the host; `volumes`: the recipe's run volumes, expanded."""

    def __init__(self, recipe: VllmRecipe, volumes: tuple[Mount, ...], stamp: Path) -> None:
        self.recipe = recipe
        self.volumes = volumes
        self.stamp = stamp

    def directory(self) -> Path | None:
        """Where the model's files are on the host: the HF snapshot, or the library's files."""
        return self.snapshot() if self.recipe.vllm.model.hf else self.library_files()

    def snapshot(self) -> Path | None:
        """The HF snapshot directory on the host, through the run volume holding the cache."""
        hf = self.recipe.vllm.model.hf
        assert hf is not None
        inside = hf_model.snapshot(self.recipe.environment, hf.id, hf.revision)
        return hf_model.on_host(inside, self.volumes)

    def library_files(self) -> Path:
        ref = self.recipe.vllm.model.library
        assert ref is not None
        return Path(ref.models_dir).expanduser() / ref.guid / "files"

    def download_key(self) -> str:
        hf = self.recipe.vllm.model.hf
        assert hf is not None
        return hf_model.download_key(hf.id, hf.revision, self.snapshot())

    def downloaded(self) -> bool:
        """The download of this id and revision into this cache ended well, and is still there."""
        return hf_model.downloaded(self.stamp, self.download_key(), self.snapshot())

    def record_download(self) -> None:
        hf_model.record_download(self.stamp, self.download_key())

    def manifest(self) -> str:
        model = self.recipe.vllm.model
        if model.hf is not None:
            return kv_tiers.hf_manifest(model.hf.id, model.hf.revision)
        assert model.library is not None
        return kv_tiers.library_manifest(
            model.library.guid, hf_model.file_stats(self.library_files())
        )
