"""A tiny random LlamaForCausalLM (bf16) with a 512-token byte-level BPE, for a real vLLM.

`python -m tests.kv.tiny_llama DIR` with transformers, tokenizers and torch importable (the
vLLM site directory). Hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32: ready in seconds
on a CPU. Deterministic: the same DIR contents every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = (
    "the quick brown fox jumps over the lazy dog. a context cache keeps the keys and values "
    "of a prompt so that the next request with the same prefix skips its prefill. "
)


def write(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([CORPUS] * 50, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(22)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
