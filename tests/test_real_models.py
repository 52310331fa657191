"""Real packaged models (slow; `python -m pytest -m real_model`): every method reproduces plain greedy decoding."""

import pytest
import torch

import speculum
from speculum import accel

pytestmark = pytest.mark.real_model

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
METHODS = [
    ("prompt_lookup", {}),
    ("anpd", {}),
    ("anpd", {"tree": True}),
    ("draft_model", {"length_policy": "fixed", "num_speculative_tokens": 4}),
    ("lookahead", {"window_size": 4, "ngram_size": 4, "guess_set_size": 4}),
    ("ouroboros", {"num_speculative_tokens": 4, "window_size": 4, "ngram_size": 4, "guess_set_size": 4}),
    ("medusa", {}),  # the heads shipped for Gemma 3 270M, found by its fingerprint
    ("ctc", {}),
]


def skip_unless_installed(alias: str, extra: str) -> None:
    from speculum.models import list_models

    if not {r["alias"]: r for r in list_models()}[alias]["installed"]:
        pytest.skip(f'needs pip install "speculum[{extra}]"')


@pytest.fixture(scope="module", params=["none", "gguf"])
def gemma(request):
    skip_unless_installed("gemma-3-270m", "gemma")
    if request.param == "gguf":
        from speculum.kernels import quant

        if quant.native_isa() == "portable":
            pytest.skip("no AVX-512 VNNI or AVX2 for the quantized kernel")
    return speculum.load("gemma-3-270m", draft="self:6", dtype="float32", quantization=request.param)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gemma_every_method_equals_plain_greedy(gemma, prompt):
    plain = gemma.generate(prompt, "autoregressive", max_new_tokens=32)
    if gemma.quantization is None:  # the de-quantized model: plain decoding is transformers' own greedy decoding
        # (on the file's blocks it is not meant to be: transformers' attention rounds the last bits of float32
        # differently, and activations rounded to 8 bits make steps of them; exact mode is on there)
        ids = torch.tensor([plain.prompt_ids])
        with accel.unpacked(gemma.model), torch.no_grad():  # stock kernels
            stock = gemma.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert plain.token_ids == stock[0, ids.shape[1] :].tolist()[: len(plain.token_ids)]
    for method, params in METHODS:
        result = gemma.generate(prompt, method, max_new_tokens=32, **params)
        assert result.token_ids == plain.token_ids, (method, params)
        # with the controller deciding what to verify (it measures this machine's costs once)
        result = gemma.generate(prompt, method, max_new_tokens=32, controller=True, **params)
        assert result.token_ids == plain.token_ids, (method, params, "controller")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen_medusa_heads_ship_and_stay_exact(dtype):
    """The Medusa heads shipped for the Qwen2.5-Coder 1.5B are found by its fingerprint in either
    dtype (no ``heads=``) and get accepted; in float32 the output equals plain greedy decoding (in
    bfloat16 a tree forward may round a near-tie differently from a one-token step)."""
    from speculum.heads import bundled_draft_head

    skip_unless_installed("qwen2.5-coder-1.5b", "qwen-1-5b")
    spec = speculum.load("qwen2.5-coder-1.5b", dtype=dtype)
    assert bundled_draft_head("medusa", spec.model).name == "qwen2.5-coder-1.5b-medusa"
    plain = spec.generate(PROMPTS[0], "autoregressive", max_new_tokens=32)
    result = spec.generate(PROMPTS[0], "medusa", max_new_tokens=32)
    if dtype == "float32":
        assert result.token_ids == plain.token_ids
    assert result.stats.mean_acceptance_length > 1.2, "the shipped heads should be accepted on plain code"
