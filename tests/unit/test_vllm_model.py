"""The tiny Llama model for the real vLLM (tests/vllm_model.py): its files, shapes and bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from tests.vllm_model import FILES, TinyLlama, _bfloat16, write_tiny_llama


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return dict(json.loads(data[8 : 8 + length]))


def test_the_same_seed_writes_the_same_bytes(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "a", seed=5)
    second = write_tiny_llama(tmp_path / "b", seed=5)
    other = write_tiny_llama(tmp_path / "c", seed=6)
    assert sorted(p.name for p in first.iterdir()) == sorted(FILES)
    assert all((first / n).read_bytes() == (second / n).read_bytes() for n in FILES)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_the_files_describe_one_bf16_llama(tmp_path: Path) -> None:
    shape = TinyLlama()
    directory = write_tiny_llama(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"] == 128
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 32)
    header = _header(directory / "model.safetensors")
    tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
    assert {spec["dtype"] for spec in tensors.values()} == {"BF16"}
    assert header["__metadata__"] == {"format": "pt"}
    assert tensors["model.embed_tokens.weight"]["shape"] == [512, 128]
    assert tensors["model.layers.1.self_attn.k_proj.weight"]["shape"] == [64, 128]
    assert tensors["model.layers.1.self_attn.q_proj.weight"]["shape"] == [128, 128]
    assert tensors["lm_head.weight"]["shape"] == [512, 128]
    assert len(tensors) == 3 + 9 * shape.layers

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"] == 512
    assert tokenizer.token_to_id("</s>") == config["eos_token_id"]
    text = "the quick brown fox"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_bf16_is_float32_rounded_to_nearest_even() -> None:
    values = np.array([1.0, -2.0, 0.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9], dtype=np.float32)
    bits = _bfloat16(values)
    assert bits.dtype == np.dtype("<u2")
    # 1+2^-8 is halfway between 1 and 1+2^-7: to even (1.0); 1+3*2^-8 halfway: to even (1+2^-6)
    assert bits.tolist() == [0x3F80, 0xC000, 0x0000, 0x3F80, 0x3F82, 0x3F80]
