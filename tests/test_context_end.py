"""Requests that reach the end of the model's context end there as plain decoding does, with every
method: a draft model never feeds positions past its own context (learned absolute positions, as
GPT-2's, have no embedding there), whether it is as long as the target's or shorter."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculum
from speculum.costs import CostModel

from helpers import build_drafter, generate_ids, save_random_heads
from tiny_models import perturbed_copy, reference_greedy, tiny_config, tiny_model, word_tokenizer

CONTEXT = 256  # the tiny GPT-2's n_positions
SHORT = 224  # the shorter draft's
LENGTHS = (196, 212, 228)  # prompts that leave 28-60 positions; the short draft reaches past the first two
METHODS = [
    ("draft_model", {}),
    ("draft_model", {"controller": False}),
    ("ouroboros", {}),
    ("ouroboros", {"controller": False}),
    ("ouroboros", {"preset": "paper"}),
    ("lookahead", {}),
    ("prompt_lookup", {}),
    ("anpd", {}),
    ("auto", {}),
    ("auto", {"drafters": "anpd,ouroboros"}),
    ("auto", {"drafters": "anpd,draft_model"}),
]


def short_context_copy(model, positions: int, seed: int = 1):
    """A perturbed copy of the tiny GPT-2 ``model`` whose context is only ``positions`` long."""
    near = perturbed_copy(model, scale=0.3, seed=seed)
    config = tiny_config("gpt2")
    config.n_positions = positions
    config._attn_implementation = "eager"
    short = AutoModelForCausalLM.from_config(config).to(model.device).eval()
    state = {name: value[:positions] if name.endswith("wpe.weight") else value
             for name, value in near.state_dict().items()}  # fmt: skip
    short.load_state_dict(state)
    short.generation_config.eos_token_id = None
    return short


@pytest.fixture(scope="module")
def setting():
    target = tiny_model("gpt2")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in LENGTHS]
    drafts = {"same": perturbed_copy(target, scale=0.3), "short": short_context_copy(target, SHORT)}
    specs = {}
    for name, draft in drafts.items():
        spec = speculum.Speculum(target, word_tokenizer(), draft)
        spec.cost_model = CostModel([(1, 0.010), (64, 0.011)])  # (not measured: a fixed, cheap verification)
        spec.eos_token_ids = frozenset()  # every request runs to the context's end
        specs[name] = spec
    plain = [specs["same"].generate(p, "autoregressive", max_new_tokens=200).token_ids for p in prompts]
    assert [len(p) + len(out) for p, out in zip(prompts, plain, strict=True)] == [CONTEXT] * len(prompts)
    return specs, prompts, plain


@pytest.mark.parametrize("draft", ["same", "short"])
@pytest.mark.parametrize("method,params", METHODS, ids=[f"{m}-{'-'.join(map(str, p.values()))}" for m, p in METHODS])
def test_a_request_ends_at_the_context_end_as_plain_decoding_does(setting, draft, method, params):
    specs, prompts, plain = setting
    spec = specs[draft]
    drafted = 0
    for prompt, want in zip(prompts, plain, strict=True):
        result = spec.generate(prompt, method, max_new_tokens=200, **params)
        assert result.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert result.stats.stop_reason == "length"
        drafted += result.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("method", ["draft_model", "ouroboros"])
def test_a_batch_drafts_up_to_the_short_drafts_context_as_each_row_alone(setting, method):
    """Rows draft together until the draft's context runs out (a row whose round ended rides along
    in the others' draft forwards), and each row gives what plain decoding gives."""
    specs, prompts, plain = setting
    params = {"controller": False}
    results = specs["short"].generate(prompts, method, max_new_tokens=200, **params)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted_tokens for r in results) > 0


@pytest.mark.parametrize("kind", ["medusa", "ctc"])
def test_heads_end_at_the_context_end_as_plain_decoding_does(kind, tmp_path):
    """Heads over a tiny Llama (their test heads need a plain LM head) whose context is 256."""
    target = tiny_model("llama")
    heads = save_random_heads(kind, target, tmp_path / kind)
    prompt = torch.randint(3, 64, (220,), generator=torch.Generator().manual_seed(2)).tolist()
    want = reference_greedy(target, prompt, CONTEXT - len(prompt))
    out, stats = generate_ids(target, prompt, build_drafter(kind, target=target, heads=heads), 200)
    assert out == want and stats.drafted_tokens > 0


def test_the_draft_window_waits_where_its_top_level_was_cut(setting, monkeypatch):
    """Near the draft's context end Ouroboros' Jacobi window loses its top level to the cut: the
    window then waits a step (no outputs) instead of stepping by rows that were never computed."""
    from speculum.drafters.lookahead import JacobiWindow

    specs, prompts, plain = setting
    steps = []
    step = JacobiWindow.step

    def recording(window, outputs):
        steps.append(outputs)
        return step(window, outputs)

    monkeypatch.setattr(JacobiWindow, "step", recording)
    result = specs["same"].generate(prompts[0], "ouroboros", max_new_tokens=200, preset="paper")
    assert result.token_ids == plain[0]
    assert None in steps and any(outputs is not None for outputs in steps)
