"""A vLLM request's extras (what shapes its KV besides its token ids) as lucia_kv.scheduling's
plain values, named so that they name the same thing after a restart.

vLLM keys its prefix cache with the same extras (vllm/v1/core/kv_cache_utils.py,
generate_block_hash_extra_keys): the cache salt, the LoRA adapter (vLLM: name and path, its
int id being handed out per process; here: name and a digest of the adapter's files, since an
adapter replaced in place under the same path makes other KV, and an adapter whose files cannot
be read makes its request unkeyable), each multimodal item by its identifier (the content hash
of the item and its processing options, or the uuid the caller gave; with the prefix cache and the
processor cache both off, vLLM names items by a per-process counter instead, which names
another image after a restart: such a request is unkeyable) and the prompt embeddings (a
SHA-256 of each block's rows). Reads the request's attributes only: no vLLM import here, and
torch only where a request has prompt embeddings (which only vLLM hands over).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any, Final

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


CHUNK: Final = 1 << 20  # bytes read at a time from an adapter's file
ADAPTER_VERSIONS: Final = 64  # adapter versions whose digests are kept
# an adapter's files, by relative path: (path, inode, size, mtime in ns)
Version = tuple[tuple[str, int, int, int], ...]


class AdapterDigests:
    """SHA-256 digests of LoRA adapters' files, each computed once per version of the files
    (their paths, inodes, sizes and mtimes), not per request."""

    def __init__(self, limit: int = ADAPTER_VERSIONS) -> None:
        self._limit = limit
        self._digests: OrderedDict[tuple[str, Version], str] = OrderedDict()

    def of(self, path: str) -> str | None:
        """The hex digest of the adapter directory's files (their relative paths and bytes),
        or None where they cannot be read, or changed while they were read."""
        try:
            version = _version(path)
            known = self._digests.get((path, version))
            if known is not None:
                self._digests.move_to_end((path, version))
                return known
            digest = _digest(path, version)
            if _version(path) != version:
                return None  # replaced while read: named on a later request
        except (OSError, ValueError):
            return None
        self._digests[(path, version)] = digest
        while len(self._digests) > self._limit:
            self._digests.popitem(last=False)
        return digest


def _version(path: str) -> Version:
    """The regular files under an adapter directory (a file: itself), sorted, with what names
    their version; raises OSError where the path cannot be listed, ValueError where it holds
    no file."""
    if not os.path.isdir(path):
        info = os.stat(path)
        return ((os.path.basename(path), info.st_ino, info.st_size, info.st_mtime_ns),)

    def raise_error(error: OSError) -> None:
        raise error

    found = []
    for root, dirs, files in os.walk(path, onerror=raise_error):
        dirs.sort()
        for name in files:
            full = os.path.join(root, name)
            info = os.stat(full)
            relative = os.path.relpath(full, path)
            found.append((relative, info.st_ino, info.st_size, info.st_mtime_ns))
    if not found:
        raise ValueError(f"no files in {path}")
    return tuple(sorted(found))


def _digest(path: str, version: Version) -> str:
    """SHA-256 over each file's relative path, size and bytes, read a chunk at a time."""
    digest = hashlib.sha256(b"lucia-kv adapter v1\0")
    base = path if os.path.isdir(path) else os.path.dirname(path)
    for relative, _, size, _ in version:
        encoded = relative.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "little") + encoded + size.to_bytes(8, "little"))
        read = 0
        with open(os.path.join(base, relative), "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                read += len(chunk)
        if read != size:
            raise ValueError(f"{relative} changed while read")
    return digest.hexdigest()


class RequestExtras:
    """A connector's reader of its requests' extras (a request's embeddings digested once, its
    adapter's files looked at once)."""

    def __init__(self, vllm_config: Any, block_size: int) -> None:
        self._block_size = block_size
        self._mm_by_content = mm_named_by_content(vllm_config)
        self._embeds: dict[str, tuple[bytes, ...]] = {}
        self._adapters = AdapterDigests()
        self._loras: dict[str, tuple[str, str]] = {}

    def of(self, request: Any) -> Extras | None:
        """The request's extras now (None: unkeyable)."""
        rid = request.request_id
        embeds = self._embeds.get(rid)
        lora = self._loras.get(rid)
        extras = request_extras(
            request,
            self._block_size,
            self._mm_by_content,
            embeds,
            adapters=self._adapters,
            lora=lora,
        )
        if extras is not None and extras.embeds:
            self._embeds[rid] = extras.embeds
        if extras is not None and extras.lora is not None:
            self._loras[rid] = extras.lora
        return extras

    def forget(self, request_id: str) -> None:
        self._embeds.pop(request_id, None)
        self._loras.pop(request_id, None)


def skips_reading(request: Any) -> bool:
    """Whether vLLM has the request skip reading cached KV (vllm/v1/request.py: set for prompt
    logprobs and some pooling requests, whose answer needs every prompt token computed)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def request_extras(
    request: Any,
    block_size: int,
    mm_by_content: bool,
    embeds: tuple[bytes, ...] | None = None,
    *,
    adapters: AdapterDigests | None = None,
    lora: tuple[str, str] | None = None,
) -> Extras | None:
    """The request's extras, or None where one cannot be named stably (the tiers skip it).
    `embeds`, `lora`: what was already found for this request (they never change);
    `adapters`: where adapters' digests are kept (None: computed afresh)."""
    adapter = request.lora_request
    if adapter is None:
        lora = None
    elif lora is None:
        digest = (adapters or AdapterDigests()).of(str(adapter.lora_path))
        if digest is None:
            return None
        lora = (str(adapter.lora_name), digest)
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
        lora=lora,
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
