"""Tiny random models built from configs (no download): the architectures the engine must support."""

from __future__ import annotations

import copy
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 64
# SPECULUM_TEST_DEVICE=cuda runs every test built on tiny_model() on the GPU (the device tool's check)
DEVICE = torch.device(os.environ.get("SPECULUM_TEST_DEVICE", "cpu"))


def tiny_config(arch: str, vocab_size: int = VOCAB):
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            **common,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            **common,
        )
    if arch == "gemma3":
        # sliding window (6) shorter than the test sequences; layers alternate sliding / full.
        return Gemma3TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=6,
            max_position_embeddings=256,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            **common,
        )
    if arch == "mistral":
        # no layer_types: the modeling code applies sliding_window (6, shorter than the test
        # sequences) to every layer
        return MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=6,
            max_position_embeddings=256,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, **common)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "gemma3", "mistral", "gpt2"]


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32, vocab_size: int = VOCAB):
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size)
    config._attn_implementation = "sdpa" if arch != "gpt2" else "eager"
    model = AutoModelForCausalLM.from_config(config).to(DEVICE, dtype).eval()
    # Sharpen the output so argmax is far from ties and the model loops on repetitive text.
    if not getattr(config, "tie_word_embeddings", False):
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # tests control the length
    return model


def perturbed_copy(model, scale: float = 0.5, seed: int = 1):
    """A draft that agrees with the target only sometimes: the same weights plus noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype) * scale * p.std())
    return draft


def repetitive_prompt(length: int = 24, period: int = 5, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, VOCAB, (period,), generator=gen).tolist()
    return (motif * (length // period + 1))[:length]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own plain greedy decoding: the output every method must reproduce exactly."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: 'w3 w4 ...' (with a trivial chat template)."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[PAD]"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


GGUF_WORDS = ["▁hello", "▁world", "▁foo", "▁bar", "▁the", "▁a", "h", "e", "l", "o", "▁"]


def write_tiny_gguf(path, words=GGUF_WORDS, hidden=32, layers=2, heads=4, kv=2, inter=64, seed=0, matrix=None):
    """A tiny Llama GGUF (with a llama-style tokenizer) that transformers can load. ``matrix(writer,
    name, role, rows, cols)`` writes each matrix (role: embedding, head, attention, values, mlp or
    down); by default float32 random values."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>", *words]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(words))])
    writer.add_token_types([2, 3, 3] + [1] * len(words))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def random_float32(writer, name, role, rows, cols):
        writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32))

    write = matrix or random_float32
    head_dim = hidden // heads
    write(writer, "token_embd.weight", "embedding", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    write(writer, "output.weight", "head", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        write(writer, f"blk.{i}.attn_q.weight", "attention", heads * head_dim, hidden)
        write(writer, f"blk.{i}.attn_k.weight", "attention", kv * head_dim, hidden)
        write(writer, f"blk.{i}.attn_v.weight", "values", kv * head_dim, hidden)
        write(writer, f"blk.{i}.attn_output.weight", "attention", hidden, heads * head_dim)
        write(writer, f"blk.{i}.ffn_gate.weight", "mlp", inter, hidden)
        write(writer, f"blk.{i}.ffn_up.weight", "mlp", inter, hidden)
        write(writer, f"blk.{i}.ffn_down.weight", "down", hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
