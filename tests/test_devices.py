"""Devices and attention implementations: a target split over devices by accelerate, sampling on
the device where the logits are (CUDA tests run where a GPU is present), tree masks only on
attention implementations that take them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculum
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams

from helpers import RandomTreeDrafter, build_drafter, generate_ids
from tiny_models import VOCAB, reference_greedy, repetitive_prompt, tiny_config, tiny_model

NEW = 24
PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


SPLIT = {  # layer 1 and the LM head offloaded to disk: accelerate's hooks bring them in per forward
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


def test_target_split_by_accelerate_is_lossless(model_dir, tmp_path):
    whole = speculum.load(model_dir, draft="self:1", dtype="float32")
    split = speculum.load(model_dir, draft="self:1", dtype="float32", device_map=SPLIT, offload_folder=tmp_path)
    assert split.model.hf_device_map == SPLIT
    assert any(p.device.type == "meta" for p in split.model.parameters())  # really offloaded
    for method in ["autoregressive", "prompt_lookup", "anpd", "draft_model"]:
        expected = whole.generate(PROMPT, method, max_new_tokens=NEW).token_ids
        assert split.generate(PROMPT, method, max_new_tokens=NEW).token_ids == expected, method
    # trees (random, partly right) and their keep-path on the split model, through the engine directly
    prompt = repetitive_prompt(20, 6, 2)
    reference = reference_greedy(whole.model, prompt, NEW)
    out, stats = generate_ids(split.model, prompt, RandomTreeDrafter(reference, VOCAB, seed=2), NEW)
    assert out == reference and stats.accepted_tokens > 0
    sampled = split.generate(PROMPT, "anpd", max_new_tokens=NEW, temperature=0.8, seed=5)
    assert sampled.token_ids == whole.generate(PROMPT, "anpd", max_new_tokens=NEW, temperature=0.8, seed=5).token_ids


def test_bad_device_map_refused(model_dir):
    with pytest.raises(speculum.InvalidInputError):
        speculum.load(model_dir, device_map="everywhere")
    with pytest.raises(speculum.InvalidInputError):
        speculum.load(model_dir, device_map={"lm_head": "tpu:7"})


@pytest.mark.parametrize("impl", ["flex_attention"])
def test_other_attention_is_switched_to_sdpa_for_trees(impl):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=impl).eval()
    reference_model = tiny_model("llama")
    model.load_state_dict(reference_model.state_dict())
    runner = ModelRunner(model)
    assert model.config._attn_implementation == "sdpa"
    prompt = repetitive_prompt(20, 6, 2)
    reference = reference_greedy(reference_model, prompt, NEW)
    out, _ = generate_ids(runner.model, prompt, RandomTreeDrafter(reference, VOCAB, seed=2), NEW)
    assert out == reference


def test_attention_that_cannot_be_switched_is_refused(monkeypatch):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="flex_attention").eval()

    def cannot(*args, **kwargs):
        raise ValueError("not supported by this model")

    monkeypatch.setattr(model, "set_attn_implementation", cannot)
    with pytest.raises(speculum.InvalidInputError, match="flex_attention.*sdpa"):
        ModelRunner(model)


# ------------------------------------------------------------------------------------------ CUDA


@needs_cuda
def test_sampling_on_cuda(model_dir):
    spec = speculum.load(model_dir, draft="self:1", dtype="float32", device="cuda")
    assert spec.runner.output_device.type == "cuda"
    # (a seeded text may end at the end-of-text token before NEW: each method's must be plain sampling's)
    plain = spec.generate(PROMPT, "autoregressive", max_new_tokens=NEW, temperature=0.9, top_k=20, seed=3).token_ids
    for method in ["prompt_lookup", "anpd", "draft_model"]:
        a = spec.generate(PROMPT, method, max_new_tokens=NEW, temperature=0.9, top_k=20, seed=3)
        assert a.token_ids == plain, method
    greedy = spec.generate(PROMPT, "draft_model", max_new_tokens=NEW)
    assert greedy.token_ids == spec.generate(PROMPT, "autoregressive", max_new_tokens=NEW).token_ids


@needs_cuda
def test_engine_sampling_distribution_on_cuda():
    """The first token sampled through draft_model on the GPU follows the warped target."""
    from scipy.stats import chisquare

    from speculum.sampling import warp

    model = tiny_model("llama", vocab_size=16).cuda()
    draft = tiny_model("llama", seed=7, vocab_size=16).cuda()
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p = warp(model(torch.tensor([prompt], device="cuda")).logits[0, -1], sampling)[0].cpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    drafter = build_drafter("draft_model", draft, 16, num_speculative_tokens=3)
    trials = 2000
    counts = torch.zeros(16)
    for _ in range(trials):
        out, _ = generate_ids(model, prompt, drafter, 1, sampling, gen)
        counts[out[0]] += 1
    keep = p * trials >= 5
    _, pvalue = chisquare(counts[keep].numpy(), (p[keep] / p[keep].sum() * counts[keep].sum()).numpy())
    assert pvalue > 1e-3


@needs_cuda
def test_target_split_over_cpu_and_cuda(model_dir):
    split_map = {**SPLIT, "model.layers.1": 0, "lm_head": 0}
    split = speculum.load(model_dir, draft="self:1", dtype="float32", device_map=split_map)
    assert split.runner.output_device.type == "cuda"
    expected = split.generate(PROMPT, "autoregressive", max_new_tokens=NEW).token_ids  # same kernels as the others
    for method in ["prompt_lookup", "anpd", "draft_model"]:
        assert split.generate(PROMPT, method, max_new_tokens=NEW).token_ids == expected, method
    plain = split.generate(PROMPT, "autoregressive", max_new_tokens=NEW, temperature=0.9, seed=1).token_ids
    assert split.generate(PROMPT, "draft_model", max_new_tokens=NEW, temperature=0.9, seed=1).token_ids == plain


@needs_cuda
def test_position_noise_on_cuda_follows_the_distribution():
    """A seeded request's noise drawn by a CUDA generator samples each position from the
    distribution (chi-square over seeds), late positions as early ones; a CPU generator's noise
    serves CUDA logits too."""
    from scipy.stats import chisquare

    from speculum.sampling import PositionNoise

    probs = torch.softmax(torch.linspace(-2.0, 2.0, 12, device="cuda"), dim=0)
    for position in (0, 13):
        counts = torch.zeros(12)
        for seed in range(3000):
            noise = PositionNoise(torch.Generator(device="cuda").manual_seed(seed))
            counts[noise.choose(probs, position)] += 1
        assert chisquare(counts.numpy(), probs.cpu().double().numpy() * 3000).pvalue > 1e-3, position
    on_cpu = PositionNoise(torch.Generator().manual_seed(5))
    assert on_cpu.choose(probs, 2) == PositionNoise(torch.Generator().manual_seed(5)).choose(probs.cpu(), 2)
