"""A vLLM request's extras read into plain values: what is keyed, and what cannot be."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from lucia_kv.extras import (
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
        (
            _request(lora_request=SimpleNamespace(lora_name="sql", lora_path="/a/sql", id=7)),
            Extras(lora=("sql", "/a/sql")),
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
