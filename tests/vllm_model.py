"""A tiny random Llama model in the Hugging Face layout, written without torch, for the real vLLM.

`write_tiny_llama(directory, seed)` writes `config.json`, `generation_config.json`,
`model.safetensors` (random bf16 weights), `tokenizer.json` (a byte-level BPE trained here with
`tokenizers` on text drawn from the seed) and `tokenizer_config.json` (with a chat template, so
that vLLM serves chat completions and /v1/responses for it). The same seed gives the
same bytes. The shape is the smallest the CPU backend of vLLM serves: head_dim 32 (its attention
takes head sizes 32, 64, 80, 96, 112, 128 and up), 4 query heads over 2 KV heads, 2 layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cache",
    "block",
    "token",
    "model",
    "engine",
    "worker",
    "status",
    "request",
    "container",
    "memory",
    "prefix",
    "server",
    "answer",
    "running",
    "stopped",
    "image",
    "build",
    "layer",
)


# one line per message, then the assistant's turn: enough for chat and /v1/responses to render
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] if message['content'] is string else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyLlama:
    """The shape of the model; the defaults are the tested one."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    max_positions: int = 2048


def _corpus(rng: np.random.Generator, lines: int = 2000) -> list[str]:
    """Sentences of fixed words and of random letters, drawn from rng (enough merges for 512)."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    invented = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(3, 9, size=400)]
    words = list(WORDS) + invented
    picks = rng.integers(0, len(words), size=(lines, 12))
    return [" ".join(words[int(i)] for i in row) + "." for row in picks]


def _tokenizer(rng: np.random.Generator, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(rng), trainer=trainer)
    return tokenizer


def _weights(rng: np.random.Generator, shape: TinyLlama) -> dict[str, np.ndarray]:
    def normal(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)

    h, q, kv = shape.hidden_size, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors = {"model.embed_tokens.weight": normal(shape.vocab_size, h)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "mlp.gate_proj.weight": normal(shape.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(shape.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, shape.intermediate_size),
        }
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = normal(shape.vocab_size, h)
    return tensors


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """The bf16 bits of float32 values (rounded to nearest even), as little-endian uint16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def _save_bfloat16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write tensors as a safetensors file of BF16 tensors, as a bf16 checkpoint holds them."""
    converted = {name: _bfloat16(values) for name, values in tensors.items()}
    specs = {
        name: TensorSpec(
            dtype="bfloat16",
            shape=list(bits.shape),
            data_ptr=bits.ctypes.data,
            data_len=bits.nbytes,
        )
        for name, bits in converted.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})


def _config(shape: TinyLlama, bos: int, eos: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "bfloat16",
    }


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_tiny_llama(directory: Path, seed: int = 0, shape: TinyLlama | None = None) -> Path:
    """Write the model into directory (made if missing) and return it; same seed, same bytes."""
    shape = shape or TinyLlama()
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    # The BPE trainer is parallel; one thread keeps its merges in one order.
    previous = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        tokenizer = _tokenizer(rng, shape.vocab_size)
    finally:
        if previous is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = previous
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, over {shape}")
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"the tokenizer has no {BOS} or {EOS}")
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "unk_token": UNK,
            "add_bos_token": False,
            "model_max_length": shape.max_positions,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(directory / "config.json", _config(shape, bos, eos))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False},
    )
    _save_bfloat16(_weights(rng, shape), directory / "model.safetensors")
    return directory
