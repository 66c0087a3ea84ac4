"""A vLLM request's extras (what shapes its KV besides its token ids) as lucia_kv.scheduling's
plain values, named so that they name the same thing after a restart.

vLLM keys its prefix cache with the same extras (vllm/v1/core/kv_cache_utils.py,
generate_block_hash_extra_keys): the cache salt, the LoRA adapter (name and path: its int id
is handed out per process), each multimodal item by its identifier (the content hash of the
item and its processing options, or the uuid the caller gave; with the prefix cache and the
processor cache both off, vLLM names items by a per-process counter instead, which names
another image after a restart: such a request is unkeyable) and the prompt embeddings (a
SHA-256 of each block's rows). Reads the request's attributes only: no vLLM import here, and
torch only where a request has prompt embeddings (which only vLLM hands over).
"""

from __future__ import annotations

import hashlib
from typing import Any

from .scheduling import Extras


def mm_named_by_content(vllm_config: Any) -> bool:
    """Whether vLLM names multimodal items by content (else by a per-process counter: vLLM
    skips the content hash when the prefix cache and the processor cache are both off)."""
    multimodal = getattr(vllm_config.model_config, "multimodal_config", None)
    if multimodal is None:
        return True
    counter_named = (
        getattr(multimodal, "mm_processor_cache_gb", 1) == 0
        and not vllm_config.cache_config.enable_prefix_caching
    )
    return not counter_named


class RequestExtras:
    """A connector's reader of its requests' extras (a request's embeddings digested once)."""

    def __init__(self, vllm_config: Any, block_size: int) -> None:
        self._block_size = block_size
        self._mm_by_content = mm_named_by_content(vllm_config)
        self._embeds: dict[str, tuple[bytes, ...]] = {}

    def of(self, request: Any) -> Extras | None:
        """The request's extras now (None: unkeyable)."""
        embeds = self._embeds.get(request.request_id)
        extras = request_extras(request, self._block_size, self._mm_by_content, embeds)
        if extras is not None and extras.embeds:
            self._embeds[request.request_id] = extras.embeds
        return extras

    def forget(self, request_id: str) -> None:
        self._embeds.pop(request_id, None)


def skips_reading(request: Any) -> bool:
    """Whether vLLM has the request skip reading cached KV (vllm/v1/request.py: set for prompt
    logprobs and some pooling requests, whose answer needs every prompt token computed)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def request_extras(
    request: Any, block_size: int, mm_by_content: bool, embeds: tuple[bytes, ...] | None = None
) -> Extras | None:
    """The request's extras, or None where one cannot be named stably (the tiers skip it).
    `embeds`: the per-block digests already computed for this request (they never change)."""
    lora = request.lora_request
    mm = []
    for feature in request.mm_features or ():
        identifier = getattr(feature, "identifier", None)
        if not mm_by_content or not isinstance(identifier, str) or not identifier:
            return None
        position = feature.mm_position
        mm.append((identifier, int(position.offset), int(position.length)))
    if embeds is None:
        embeds = embeds_digests(request, block_size)
    return Extras(
        salt=request.cache_salt or None,
        lora=None if lora is None else (str(lora.lora_name), str(lora.lora_path)),
        mm=tuple(sorted(mm, key=lambda item: item[1])),
        embeds=embeds,
    )


def embeds_digests(request: Any, block_size: int) -> tuple[bytes, ...]:
    """SHA-256 of each block's prompt embedding rows (dtype, shape and bytes; in a prompt
    mixing token ids and embeddings, which positions are which too); () without embeddings."""
    tensor = request.prompt_embeds
    if tensor is None:
        return ()
    import torch  # only vLLM hands a request with prompt embeddings over

    mask = getattr(request, "prompt_is_token_ids", None)
    digests = []
    for start in range(0, len(tensor), block_size):
        rows = tensor[start : start + block_size].detach().cpu().contiguous()
        digest = hashlib.sha256(f"{rows.dtype}{tuple(rows.shape)}".encode())
        digest.update(rows.view(torch.uint8).numpy().tobytes())
        if mask is not None:
            digest.update(bytes(bool(m) for m in mask[start : start + block_size]))
        digests.append(digest.digest())
    return tuple(digests)
