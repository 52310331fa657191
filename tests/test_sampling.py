"""Sampling is lossless: the output follows the target's warped distribution exactly (chi-square tests).

The 'target' is a bigram model over a small vocabulary, so the exact distribution of the first
three generated tokens is known in closed form. Each verification rule (chain/tree x
deterministic/stochastic draft) runs a little decode loop of its own, many times, seeded.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speculum.drafters.base import Draft
from speculum.sampling import SamplingParams, warp
from speculum.tree import TokenTree
from speculum.verify import verify

from helpers import build_drafter, generate_ids, markov_logits, save_random_heads
from tiny_models import tiny_model

V = 4
STEPS = 3
TRIALS = 6000


def tables(seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=-1)  # a different model
    return target, draft


def exact_joint(target, sampling):
    """P(first STEPS tokens) under the warped bigram target, starting after token 0."""
    warped = warp(torch.log(target), sampling)
    probs = {}
    for seq in itertools.product(range(V), repeat=STEPS):
        p, prev = 1.0, 0
        for tok in seq:
            p *= warped[prev, tok].item()
            prev = tok
        probs[seq] = p
    return probs


def propose(kind, rng, tokens, draft_table, sampling):
    """Random drafts: chains or trees, deterministic (random tokens), stochastic (sampled from q),
    mixed node by node (a sampled child beside deterministic ones), or deterministic written with
    explicit one-hot q rows."""
    depth = int(torch.randint(1, 4, (), generator=rng))
    if kind == "onehot-tree":
        draft = propose("det-tree", rng, tokens, draft_table, sampling)
        return Draft(draft.tokens, draft.parents, torch.eye(V)[draft.tokens])
    if kind == "mixed-tree":
        q_all = warp(torch.log(draft_table), sampling)
        toks, parents, probs = [], [], []
        frontier = [(-1, tokens[-1])]
        for _ in range(depth):
            new_frontier = []
            for parent, tok in frontier:
                choices = [int(torch.multinomial(q_all[tok], 1, generator=rng))]  # sampled from q
                choices += torch.randperm(V, generator=rng)[:2].tolist()  # deterministic (may repeat it)
                order = torch.randperm(3, generator=rng).tolist()  # sampled child first, middle or last
                for i in order:
                    toks.append(choices[i])
                    parents.append(parent)
                    probs.append(q_all[tok] if i == 0 else None)
                    new_frontier.append((len(toks) - 1, choices[i]))
            frontier = new_frontier[:2]
        return Draft(toks, parents, probs)
    if kind.startswith("det"):
        toks, parents = [], []
        branching = 2 if kind.endswith("tree") else 1
        frontier = [(-1, tokens[-1])]
        for _ in range(depth):
            new_frontier = []
            for parent, _tok in frontier:
                choices = torch.randperm(V, generator=rng)[:branching].tolist()
                for c in choices:
                    toks.append(c)
                    parents.append(parent)
                    new_frontier.append((len(toks) - 1, c))
            frontier = new_frontier[:2]
        return Draft(toks, parents)
    # stochastic: children i.i.d. from the warped draft distribution q(. | parent token)
    q_all = warp(torch.log(draft_table), sampling)
    toks, parents, probs = [], [], []
    width = 2 if kind.endswith("tree") else 1
    frontier = [(-1, tokens[-1])]
    for _ in range(depth):
        new_frontier = []
        for parent, tok in frontier:
            for _w in range(width):
                x = int(torch.multinomial(q_all[tok], 1, generator=rng))
                toks.append(x)
                parents.append(parent)
                probs.append(q_all[tok])
                new_frontier.append((len(toks) - 1, x))
        frontier = new_frontier[:2]
    return Draft(toks, parents, torch.stack(probs))


def run_trials(kind, sampling, seed=0):
    target, draft_table = tables(seed)
    rng = torch.Generator().manual_seed(seed + 100)
    counts = dict.fromkeys(itertools.product(range(V), repeat=STEPS), 0)
    for _ in range(TRIALS):
        tokens = [0]
        while len(tokens) <= STEPS:
            tree = TokenTree.from_draft(tokens[-1], propose(kind, rng, tokens, draft_table, sampling))
            logits = markov_logits(target, tree.tokens)
            verdict = verify(tree, logits, sampling, rng)
            tokens += [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
        counts[tuple(tokens[1 : STEPS + 1])] += 1
    return counts, exact_joint(target, sampling)


def assert_same_distribution(counts, exact):
    observed, expected = [], []
    for seq, p in exact.items():
        if p == 0:
            assert counts[seq] == 0, f"sampled {seq}, which the warped target forbids"
            continue
        observed.append(counts[seq])
        expected.append(p * TRIALS)
    scale = sum(observed) / sum(expected)
    _, pvalue = chisquare(observed, [e * scale for e in expected])
    assert pvalue > 1e-3, f"p-value {pvalue:.2e}: the output distribution differs from the target's"


@pytest.mark.parametrize("kind", ["det-chain", "det-tree", "sto-chain", "sto-tree", "mixed-tree", "onehot-tree"])
def test_rule_matches_target_distribution(kind):
    counts, exact = run_trials(kind, SamplingParams(temperature=0.8))
    assert_same_distribution(counts, exact)


@pytest.mark.parametrize("kind", ["det-tree", "sto-chain", "mixed-tree"])
def test_rule_with_top_k_top_p(kind):
    counts, exact = run_trials(kind, SamplingParams(temperature=1.3, top_k=3, top_p=0.9), seed=1)
    assert_same_distribution(counts, exact)


def test_the_test_detects_a_wrong_rule():
    """Accepting stochastic drafts blindly (a classic bug) must fail the same check."""
    target, draft_table = tables(0)
    sampling = SamplingParams(temperature=0.8)
    q_all = warp(torch.log(draft_table), sampling)
    rng = torch.Generator().manual_seed(5)
    counts = dict.fromkeys(itertools.product(range(V), repeat=STEPS), 0)
    for _ in range(TRIALS):
        tokens = [0]
        while len(tokens) <= STEPS:
            tokens.append(int(torch.multinomial(q_all[tokens[-1]], 1, generator=rng)))
        counts[tuple(tokens[1:])] += 1
    with pytest.raises(AssertionError):
        assert_same_distribution(counts, exact_joint(target, sampling))


def _first_two_exact(model, prompt, sampling):
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], sampling)[0]
        joint = {}
        for a in torch.nonzero(p1 > 0).flatten().tolist():
            p2 = warp(model(torch.tensor([prompt + [a]])).logits[0, -1], sampling)[0]
            for b in torch.nonzero(p2 > 0).flatten().tolist():
                joint[(a, b)] = p1[a].item() * p2[b].item()
    return joint


@pytest.mark.parametrize(
    "method,target_vocab,draft_vocab",
    [
        ("draft_model", 16, 16),
        ("prompt_lookup", 16, 16),
        ("lookahead", 16, 16),
        ("ouroboros", 16, 16),
        ("draft_model", 20, 16),  # the target's head is wider (a padded head, as Qwen2.5-7B's vs the 0.5B)
        ("draft_model", 16, 20),  # the draft's is wider
        ("specdecpp", 16, 16),  # draft_model stopped by an (untrained, early) acceptance head
        ("medusa", 16, 16),  # trees from (untrained) heads over the target's hidden states
        ("ctc", 16, 16),
    ],
)
def test_engine_sampling_on_a_real_model(method, target_vocab, draft_vocab, tmp_path):
    """End to end through the engine and a transformer: first two tokens follow the warped target."""
    model = tiny_model("llama", vocab_size=target_vocab)
    draft = tiny_model("llama", seed=7, vocab_size=draft_vocab)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = SamplingParams(temperature=1.0, top_k=6 if target_vocab == draft_vocab else 0)
    exact = _first_two_exact(model, prompt, sampling)
    trials = 1500
    counts = dict.fromkeys(exact, 0)
    gen = torch.Generator().manual_seed(11)
    params = {
        "lookahead": {"window_size": 3, "ngram_size": 3, "pool_from_prompt": True},
        "ouroboros": {"num_speculative_tokens": 3, "window_size": 3, "ngram_size": 3},
    }.get(method, {"num_speculative_tokens": 3})
    if method == "specdecpp":
        from speculum.acceptance_head import AcceptanceHead

        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, 1, early=True)
        torch.nn.init.normal_(head.confidence.weight)
        head.save(tmp_path / "head")
        method = "draft_model"
        params = {"length_policy": "specdecpp", "acceptance_head": str(tmp_path / "head"), "stop_threshold": 0.5}
    if method in ("medusa", "ctc"):
        params = {"heads": save_random_heads(method, model, tmp_path / method), "tree_nodes": 6}
    drafter = build_drafter(method, draft, target_vocab, target=model, **params)
    for _ in range(trials):
        # the draft-model run also goes through the lazy LM head (rows computed along the walk)
        out, _ = generate_ids(model, prompt, drafter, 2, sampling, gen, lazy_head=method == "draft_model")
        assert tuple(out) in counts, f"sampled {out}, outside the warped support"
        counts[tuple(out)] += 1
    keep = [k for k, p in exact.items() if p * trials >= 5]  # chi-square needs expected counts >= 5
    observed = [counts[k] for k in keep] + [trials - sum(counts[k] for k in keep)]
    expected = [exact[k] * trials for k in keep]
    expected.append(trials - sum(expected))
    _, pvalue = chisquare(observed, expected)
    assert pvalue > 1e-3
