"""Greedy losslessness: every drafter reproduces transformers' plain greedy decoding token for token."""

import pytest
import torch

from helpers import RandomTreeDrafter, build_drafter, generate_ids
from tiny_models import ARCHS, VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model

NEW = 40


def prompts():
    gen = torch.Generator().manual_seed(3)
    return [
        repetitive_prompt(24, 5, 0),
        repetitive_prompt(30, 7, 1),
        torch.randint(3, VOCAB, (20,), generator=gen).tolist(),
    ]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request):
    model = tiny_model(request.param)
    refs = [reference_greedy(model, p, NEW) for p in prompts()]
    return request.param, model, refs


def _check(model, refs, make_drafter):
    for prompt, ref in zip(prompts(), refs, strict=True):
        out, stats = generate_ids(model, prompt, make_drafter(ref), NEW)
        assert out == ref
        assert stats.new_tokens == NEW
    return stats


def test_autoregressive(arch_setup):
    _, model, refs = arch_setup
    stats = _check(model, refs, lambda ref: build_drafter("autoregressive"))
    assert stats.mean_acceptance_length == 1.0
    assert stats.target_forwards == NEW


def test_prompt_lookup(arch_setup):
    _, model, refs = arch_setup
    stats = _check(model, refs, lambda ref: build_drafter("prompt_lookup"))
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence"])
def test_draft_model(arch_setup, policy):
    _, model, refs = arch_setup
    draft = perturbed_copy(model, scale=0.4)
    stats = _check(
        model,
        refs,
        lambda ref: build_drafter("draft_model", draft, VOCAB, num_speculative_tokens=4, length_policy=policy),
    )
    assert stats.draft_forwards > 0


def test_draft_model_partly_right(arch_setup):
    """The draft must agree only sometimes, or the test proves little."""
    _, model, refs = arch_setup
    draft = perturbed_copy(model, scale=0.4)
    rates = []
    for prompt, ref in zip(prompts(), refs, strict=True):
        out, stats = generate_ids(model, prompt, build_drafter("draft_model", draft, VOCAB, length_policy="fixed"), NEW)
        assert out == ref
        rates.append(stats.draft_acceptance_rate)
    assert 0.0 < sum(rates) / len(rates) < 1.0


@pytest.mark.parametrize("target_vocab,draft_vocab", [(80, 64), (64, 80)])
def test_draft_model_with_unequal_head_widths(target_vocab, draft_vocab):
    """A target head wider than the draft's (padded rows it may still emit) or narrower."""
    model = tiny_model("llama", vocab_size=target_vocab)
    draft = tiny_model("llama", seed=3, vocab_size=draft_vocab)
    emitted_beyond_draft = 0
    for prompt in prompts():
        ref = reference_greedy(model, prompt, NEW)
        emitted_beyond_draft += sum(t >= draft_vocab for t in ref)
        out, _ = generate_ids(model, prompt, build_drafter("draft_model", draft, target_vocab), NEW)
        assert out == ref
    if target_vocab > draft_vocab:
        assert emitted_beyond_draft > 0  # the target did emit ids the draft cannot embed


def test_random_trees(arch_setup):
    _, model, refs = arch_setup
    total_accepted = 0
    for seed in range(2):
        for prompt, ref in zip(prompts(), refs, strict=True):
            out, stats = generate_ids(model, prompt, RandomTreeDrafter(ref, VOCAB, seed=seed), NEW)
            assert out == ref
            total_accepted += stats.accepted_tokens
    assert total_accepted > 0  # trees were partly right, so side branches and keep-path were exercised


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_anpd(arch_setup, tree, adaptive):
    _, model, refs = arch_setup
    stats = _check(model, refs, lambda ref: build_drafter("anpd", tree=tree, adaptive=adaptive))
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize(
    "params",
    [
        {},  # LADE's defaults: N=5, W=7, G=7 (56-node trees)
        {"window_size": 3, "ngram_size": 3, "guess_set_size": 2, "pool_from_prompt": True},
        {"window_size": 2, "ngram_size": 2, "guess_set_size": 0},  # the Jacobi window alone (no guesses)
    ],
)
def test_lookahead(arch_setup, params):
    _, model, refs = arch_setup
    stats = _check(model, refs, lambda ref: build_drafter("lookahead", **params))
    assert stats.drafted_tokens > 0


OUROBOROS_SMALL = {"num_speculative_tokens": 4, "window_size": 3, "ngram_size": 3, "guess_set_size": 3}


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"phrase_drafting": False},
        {"lengthen": False},
        {"verification_phrases": False},
        {"reuse_history": False},
        {"phrase_drafting": False, "lengthen": False, "verification_phrases": False, "reuse_history": False},
        {"length_policy": "heuristic"},
        {"length_policy": "confidence"},
        {"context_phrases": True, "window_size": 0, "draft_guesses": 2},
        {"context_phrases": True, "phrase_drafting": False},
    ],
    ids=[
        "all",
        "no-phrase-drafting",
        "no-lengthen",
        "no-verification-phrases",
        "no-history",
        "none",
        "heuristic",
        "confidence",
        "context-no-window",
        "context-lengthen-only",
    ],
)
def test_ouroboros(arch_setup, switches):
    _, model, refs = arch_setup
    draft = perturbed_copy(model, scale=0.4)
    drafter = build_drafter("ouroboros", draft, VOCAB, **{**OUROBOROS_SMALL, **switches})
    stats = _check(model, refs, lambda ref: drafter)  # one drafter for all prompts: the pool carries over
    assert stats.draft_forwards > 0


def test_ouroboros_paper_defaults(arch_setup):
    _, model, refs = arch_setup
    draft = perturbed_copy(model, scale=0.4)
    _check(model, refs, lambda ref: build_drafter("ouroboros", draft, VOCAB))


def test_lazy_head_lossless(arch_setup):
    arch, model, refs = arch_setup
    if arch == "gpt2":
        pytest.skip("GPT-2 keeps the full head (not a known plain-head architecture)")
    from helpers import generate_ids as gen

    for prompt, ref in zip(prompts(), refs, strict=True):
        out, _ = gen(model, prompt, RandomTreeDrafter(ref, VOCAB, seed=1), NEW, lazy_head=True)
        assert out == ref
        out, _ = gen(model, prompt, build_drafter("anpd"), NEW, lazy_head=True)
        assert out == ref
        out, _ = gen(model, prompt, build_drafter("lookahead", window_size=3, ngram_size=3), NEW, lazy_head=True)
        assert out == ref


def test_a_half_precision_head_is_lazy_only_where_more_rows_cost_more(monkeypatch):
    """bfloat16 on a CPU: the LM head runs row by row along the verifier's path where 8 rows cost
    much more than one (emulated bf16), and over the whole tree at once where they cost about the
    same (native bf16 kernels); float32, and a model without a plain LM head, never run it lazily."""
    from speculum import runner as runner_module
    from speculum.runner import ModelRunner, half_rows_cost_ratio

    model = tiny_model("llama").to("cpu", torch.bfloat16)  # a CPU policy, wherever the tests' models live
    monkeypatch.setattr(runner_module, "half_rows_cost_ratio", lambda dtype, threads: 7.5)
    assert ModelRunner(model).lazy_head
    monkeypatch.setattr(runner_module, "half_rows_cost_ratio", lambda dtype, threads: 1.4)
    assert not ModelRunner(model).lazy_head
    assert ModelRunner(model, lazy_head=True).lazy_head  # asked for: kept
    assert not ModelRunner(tiny_model("llama").cpu()).lazy_head
    assert not ModelRunner(tiny_model("gpt2").to("cpu", torch.bfloat16)).lazy_head  # not a known plain-head model
    assert half_rows_cost_ratio(torch.bfloat16, torch.get_num_threads()) > 0  # the probe itself runs


@pytest.mark.parametrize("method", ["draft_model", "ouroboros"])
def test_specdecpp_and_oracle_policies(arch_setup, method, tmp_path):
    """SpecDec++ (an untrained head: its stops are arbitrary, the output must not care) and the oracle,
    which must stop exactly before the first rejection: every drafted token accepted."""
    from speculum.heads.acceptance import AcceptanceHead, draft_fingerprint, draft_hidden_size

    _, model, refs = arch_setup
    draft = perturbed_copy(model, scale=0.4)
    torch.manual_seed(0)
    head = AcceptanceHead(draft_hidden_size(draft), 2, draft_fingerprint(draft))
    head.save(tmp_path / "head")
    extra = OUROBOROS_SMALL if method == "ouroboros" else {}
    params = {**extra, "num_speculative_tokens": 6, "length_policy": "specdecpp", "stop_threshold": 0.5}
    params["acceptance_head"] = str(tmp_path / "head")
    stats = _check(model, refs, lambda ref: build_drafter(method, draft, VOCAB, **params))
    assert stats.drafted_tokens > 0

    def oracle(ref, prompt):
        params = {**extra, "num_speculative_tokens": 6, "length_policy": "oracle"}
        drafter = build_drafter(method, draft, VOCAB, **params)
        drafter.policy.set_reference(prompt + ref)
        return drafter

    chain_drafted = 0
    for prompt, ref in zip(prompts(), refs, strict=True):
        drafter = oracle(ref, prompt)
        out, stats = generate_ids(model, prompt, drafter, NEW)
        assert out == ref
        if method == "draft_model":  # (ouroboros' phrases below the chain may still be cut)
            assert stats.accepted_tokens == stats.drafted_tokens
        chain_drafted += stats.drafted_tokens
    assert chain_drafted > 0
