"""Acceptance-only policy studies from precomputed draft chains (speculum.bench.chains)."""

import random

import pytest
import torch

from speculum.bench.chains import draft_chains, simulate
from speculum.heads.acceptance import AcceptanceHead, draft_hidden_size
from speculum.policies import make_policy
from speculum.sampling import SamplingParams

from helpers import build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, tiny_model


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama")
    return target, perturbed_copy(target, scale=0.4)


@pytest.fixture(scope="module")
def heads(pair):
    torch.manual_seed(3)
    paper = AcceptanceHead(draft_hidden_size(pair[1]), depth=1)
    early = AcceptanceHead(draft_hidden_size(pair[1]), depth=1, early=True)
    torch.nn.init.normal_(early.confidence.weight)  # (zero at initialisation: make the input count)
    return {"paper": paper, "early": early}


POLICIES = [
    ("fixed", {"num_speculative_tokens": 3}),
    ("fixed", {"num_speculative_tokens": 7}),
    ("heuristic", {"num_speculative_tokens": 5}),
    ("confidence", {"num_speculative_tokens": 8, "confidence_threshold": 0.5}),
    ("specdecpp", {"num_speculative_tokens": 8, "stop_threshold": 0.5, "head": "paper"}),
    ("specdecpp", {"num_speculative_tokens": 8, "stop_threshold": 0.5, "head": "early"}),
    ("oracle", {"num_speculative_tokens": 8}),
]


@pytest.mark.parametrize("name, params", POLICIES)
def test_simulation_matches_a_real_greedy_run(pair, heads, name, params, tmp_path):
    """Greedy: the chains give exactly the drafted/accepted/forward counts of a real run (float32)."""
    target, draft = pair
    prompt = [3, 17, 42, 8, 8, 19, 5]
    reference, _ = generate_ids(target, prompt, build_drafter("autoregressive"), max_new_tokens=40)
    chains = draft_chains(draft, prompt, reference, max_draft=8, batch=16)
    assert chains.tokens.shape == (40, 8) and chains.hidden.shape[:2] == (40, 8)

    extra = {}
    params = dict(params)
    if name == "specdecpp":
        heads[params.pop("head")].save(tmp_path / "head")
        extra["acceptance_head"] = str(tmp_path / "head")
    drafter = build_drafter("draft_model", draft, VOCAB, length_policy=name, **params, **extra)
    if name == "oracle":
        drafter.policy.set_reference(prompt + reference)
    output, real = generate_ids(target, prompt, drafter, max_new_tokens=40)
    assert output == reference
    real_head_calls = getattr(drafter.policy, "head_calls", 0)

    policy = drafter.policy  # the same object, reset by simulate
    sim = simulate(chains, policy)
    assert (sim.new_tokens, sim.drafted_tokens, sim.accepted_tokens, sim.target_forwards, sim.draft_forwards) == (
        real.new_tokens, real.drafted_tokens, real.accepted_tokens, real.target_forwards, real.draft_forwards
    )  # fmt: skip
    assert sim.head_calls == real_head_calls  # what the head costs: early heads score the first candidate too
    if name == "specdecpp":
        assert real_head_calls > 0


def test_oracle_is_the_best_stop_and_never_discards(pair):
    target, draft = pair
    prompt = [9, 9, 30, 2, 14]
    reference, _ = generate_ids(target, prompt, build_drafter("autoregressive"), max_new_tokens=30)
    chains = draft_chains(draft, prompt, reference, max_draft=6, hidden=False, batch=7)
    oracle = simulate(chains, make_policy("oracle", 6))
    assert oracle.drafted_tokens == oracle.accepted_tokens
    for k in range(1, 7):
        fixed = simulate(chains, make_policy("fixed", k))
        assert oracle.target_forwards <= fixed.target_forwards


def test_sampled_chains_carry_acceptance_ratios(pair):
    """Sampling: acceptance = min(1, p/q) from the target's forest forward; equals one computed by hand."""
    target, draft = pair
    prompt = [4, 11, 23]
    output = [5, 6, 7, 8, 9, 10]
    sampling = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    chains = draft_chains(draft, prompt, output, max_draft=3, target_model=target, sampling=sampling, generator=gen)
    assert ((chains.accept > 0) & (chains.accept <= 1)).all()
    row = 2  # starts after prompt + output[:2]
    context = prompt + output[:row]
    with torch.no_grad():
        for s in range(3):
            ids = torch.tensor([context + chains.tokens[row, :s].tolist()])
            p = torch.softmax(target(ids).logits[0, -1].float(), -1)[chains.tokens[row, s]]
            q = torch.softmax(draft(ids).logits[0, -1].float(), -1)[chains.tokens[row, s]]
            assert float(chains.accept[row, s]) == pytest.approx(min(1.0, float(p / q)), rel=1e-4)
            assert float(chains.confidence[row, s]) == pytest.approx(float(q), rel=1e-4)
    totals = simulate(chains, make_policy("fixed", 3), rng=random.Random(1))
    assert totals.new_tokens == len(output) and totals.accepted_tokens <= totals.drafted_tokens
