"""A vLLM request's extras read into plain values: what is keyed, and what cannot be."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lucia_kv import extras as extras_module
from lucia_kv.extras import (
    AdapterDigests,
    RequestExtras,
    mm_named_by_content,
    request_extras,
    skips_reading,
)
from lucia_kv.scheduling import Extras


def _request(**fields: Any) -> SimpleNamespace:
    """The attributes of vllm.v1.request.Request the reader uses."""
    found: dict[str, Any] = {
        "request_id": "r",
        "lora_request": None,
        "mm_features": [],
        "cache_salt": None,
        "prompt_embeds": None,
    }
    found.update(fields)
    return SimpleNamespace(**found)


def _item(identifier: str | None, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def _config(multimodal: bool, processor_cache_gb: float, prefix_caching: bool) -> Any:
    multimodal_config = (
        SimpleNamespace(mm_processor_cache_gb=processor_cache_gb) if multimodal else None
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=multimodal_config),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (_request(), Extras()),
        (_request(cache_salt="tenant-b"), Extras(salt="tenant-b")),
        (_request(cache_salt=""), Extras()),
        (  # an adapter whose files cannot be read has no name that lasts
            _request(lora_request=SimpleNamespace(lora_name="sql", lora_path="/a/sql", id=7)),
            None,
        ),
        (
            _request(mm_features=[_item("hash-b", 40, 8), _item("hash-a", 3, 10)]),
            Extras(mm=(("hash-a", 3, 10), ("hash-b", 40, 8))),
        ),
        (_request(mm_features=[_item(None, 3, 10)]), None),
        (_request(mm_features=[_item("", 3, 10)]), None),
    ],
)
def test_a_request_reads_into_extras_or_none_when_unkeyable(
    request_: SimpleNamespace, expected: Extras | None
) -> None:
    assert request_extras(request_, 16, mm_by_content=True) == expected


def test_multimodal_items_named_per_process_make_a_request_unkeyable() -> None:
    with_image = _request(mm_features=[_item("renderer0-mm-1-image-0", 3, 10)])
    assert request_extras(with_image, 16, mm_by_content=False) is None
    assert request_extras(_request(cache_salt="s"), 16, mm_by_content=False) == Extras(salt="s")


@pytest.mark.parametrize(
    ("multimodal", "processor_cache_gb", "prefix_caching", "by_content"),
    [
        (False, 0, False, True),  # a text model: no items
        (True, 4, False, True),  # the processor cache hashes the content
        (True, 0, True, True),  # the prefix cache does
        (True, 0, False, False),  # neither: vLLM names items renderer<n>-mm-<count>-...
    ],
)
def test_vllm_names_items_by_content_unless_both_of_its_caches_are_off(
    multimodal: bool, processor_cache_gb: float, prefix_caching: bool, by_content: bool
) -> None:
    config = _config(multimodal, processor_cache_gb, prefix_caching)
    assert mm_named_by_content(config) is by_content
    reader = RequestExtras(config, 16)
    read = reader.of(_request(mm_features=[_item("h", 0, 4)]))
    assert (read is not None) is by_content


BLOCK = 4


def _expected(rows: Any, mask: list[bool] | None = None) -> bytes:
    """A block's digest from its rows, written out from embeds_digests' docstring; the bytes
    taken as 16-bit integers, another road to the same memory."""
    import hashlib

    import torch

    digest = hashlib.sha256(f"{rows.dtype}{tuple(rows.shape)}".encode())
    digest.update(rows.contiguous().view(torch.int16).numpy().tobytes())
    if mask is not None:
        digest.update(bytes(mask))
    return digest.digest()


def test_prompt_embeddings_are_keyed_per_block_by_their_bytes_and_positions() -> None:
    import torch  # in the test extras

    generator = torch.Generator().manual_seed(25)
    embeds = torch.randn(10, 3, generator=generator).to(torch.bfloat16)  # 2 full blocks, 2 rows
    digests = request_extras(_request(prompt_embeds=embeds), BLOCK, mm_by_content=True)
    assert digests is not None
    assert digests.embeds == tuple(
        _expected(embeds[start : start + BLOCK]) for start in range(0, 10, BLOCK)
    )

    changed = embeds.clone()
    changed[5, 1] += 1  # block 1 only
    other = request_extras(_request(prompt_embeds=changed), BLOCK, mm_by_content=True)
    assert other is not None
    assert [a == b for a, b in zip(digests.embeds, other.embeds, strict=True)] == [
        True,
        False,
        True,
    ]

    as_f32 = request_extras(_request(prompt_embeds=embeds.float()), BLOCK, mm_by_content=True)
    assert as_f32 is not None
    assert set(as_f32.embeds).isdisjoint(digests.embeds)  # the dtype is keyed

    mask = [True, False, True, True, False, False, True, True, True, True]
    mixed = request_extras(
        _request(prompt_embeds=embeds, prompt_is_token_ids=mask), BLOCK, mm_by_content=True
    )
    assert mixed is not None
    assert mixed.embeds[0] == _expected(embeds[:BLOCK], mask[:BLOCK])
    assert mixed.embeds[0] != digests.embeds[0]  # which positions are embeddings is keyed


@pytest.mark.parametrize(
    ("request_", "skips"),
    [
        (_request(skip_reading_prefix_cache=True), True),  # prompt logprobs, some pooling
        (_request(skip_reading_prefix_cache=False), False),
        (_request(), False),  # a vLLM without the attribute
    ],
)
def test_a_request_vllm_has_skip_reading_cached_kv_is_read_as_such(
    request_: SimpleNamespace, skips: bool
) -> None:
    assert skips_reading(request_) is skips


def _adapter(where: Path, weights: bytes = b"weights v1") -> Path:
    """A LoRA adapter directory as vLLM loads one."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (where / "adapter_model.safetensors").write_bytes(weights)
    return where


def _lora(name: str, path: Path) -> SimpleNamespace:
    return _request(lora_request=SimpleNamespace(lora_name=name, lora_path=str(path), id=1))


def _rewritten(tmp: Path) -> tuple[str, Path]:
    """The same name and path, the weights rewritten in place (same size)."""
    (tmp / "sql" / "adapter_model.safetensors").write_bytes(b"weights v2")
    return "sql", tmp / "sql"


def _replaced(tmp: Path) -> tuple[str, Path]:
    """The same name and path, the directory replaced by a new version's (a rename)."""
    _adapter(tmp / "sql-new", b"weights v2")
    os.rename(tmp / "sql", tmp / "sql-old")
    os.rename(tmp / "sql-new", tmp / "sql")
    return "sql", tmp / "sql"


def _config_changed(tmp: Path) -> tuple[str, Path]:
    (tmp / "sql" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')
    return "sql", tmp / "sql"


def _file_added(tmp: Path) -> tuple[str, Path]:
    (tmp / "sql" / "new_embeddings.safetensors").write_bytes(b"rows")
    return "sql", tmp / "sql"


def _copied(tmp: Path) -> tuple[str, Path]:
    """The same files at another path, under the same name."""
    return "sql", _adapter(tmp / "elsewhere" / "sql")


def _renamed(tmp: Path) -> tuple[str, Path]:
    """The same files under another name (vLLM's prefix cache keys the name: so do the tiers)."""
    return "chat", _adapter(tmp / "chat")


def _untouched(tmp: Path) -> tuple[str, Path]:
    os.utime(tmp / "sql")  # the directory's own times are not the adapter's content
    return "sql", tmp / "sql"


@pytest.mark.parametrize(
    ("change", "same_kv"),
    [
        (_untouched, True),
        (_rewritten, False),
        (_replaced, False),
        (_config_changed, False),
        (_file_added, False),
        (_copied, True),
        (_renamed, False),
    ],
)
def test_a_lora_adapter_is_keyed_by_its_name_and_its_files_content(
    tmp_path: Path, change: Callable[[Path], tuple[str, Path]], same_kv: bool
) -> None:
    """An adapter replaced in place under the same name and path makes other KV: keyed by a
    digest of its files, a new reader (a restart) names it anew."""
    before = request_extras(_lora("sql", _adapter(tmp_path / "sql")), 16, mm_by_content=True)
    name, path = change(tmp_path)
    after = request_extras(_lora(name, path), 16, mm_by_content=True)
    assert before is not None and after is not None and before.lora is not None
    assert (before == after) is same_kv
    assert before.lora[0] == "sql" and len(before.lora[1]) == 64  # a SHA-256, not the path


def _missing(tmp: Path) -> Path:
    return tmp / "gone"


def _empty(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _dangling(tmp: Path) -> Path:
    """The weights a link to a file that is not there (a pruned download's snapshot)."""
    where = _adapter(tmp / "sql")
    (where / "adapter_model.safetensors").unlink()
    (where / "adapter_model.safetensors").symlink_to(tmp / "blobs" / "gone")
    return where


def _under_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("not a directory")
    return tmp / "file" / "sql"


def _unreadable(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The weights' read fails (EIO, say)."""
    where = _adapter(tmp / "sql")

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(extras_module, "open", failing, raising=False)
    return where


@pytest.mark.parametrize("place", [_missing, _empty, _dangling, _under_a_file, _unreadable])
def test_a_lora_adapter_whose_files_cannot_be_read_makes_its_request_unkeyable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, place: Callable[..., Path]
) -> None:
    """No exception into vLLM: the request skips the tiers (counted as unkeyable)."""
    path = place(tmp_path, monkeypatch) if place is _unreadable else place(tmp_path)
    assert request_extras(_lora("sql", path), 16, mm_by_content=True) is None
    reader = RequestExtras(_config(False, 0, True), 16)
    assert reader.of(_lora("sql", path)) is None
    assert AdapterDigests().of(str(path)) is None


def test_an_adapters_digest_is_computed_once_per_version_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    computed: list[str] = []
    digest = extras_module._digest

    def counted(path: str, version: Any) -> str:
        computed.append(path)
        return digest(path, version)

    monkeypatch.setattr(extras_module, "_digest", counted)
    where = _adapter(tmp_path / "sql")
    reader = RequestExtras(_config(False, 0, True), 16)

    def asked(request_id: str) -> Extras | None:
        return reader.of(
            _request(request_id=request_id, lora_request=_lora("sql", where).lora_request)
        )

    first = [asked(f"r{i}") for i in range(3)]
    assert len(computed) == 1 and first[0] == first[1] == first[2] is not None
    _rewritten(tmp_path)
    os.utime(where / "adapter_model.safetensors", ns=(1, 1))  # a new mtime whatever the clock
    second = asked("r3")
    assert len(computed) == 2 and second is not None and second != first[0]
    assert asked("r0") == first[0], "a running request keeps the adapter version it started with"
    reader.forget("r0")
    assert asked("r0") == second
    assert len(computed) == 2
