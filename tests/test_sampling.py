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
from speculum.sampling import PositionNoise, SamplingParams, warp
from speculum.tree import TokenTree
from speculum.verify import verify

from helpers import build_drafter, generate_ids, markov_logits
from tiny_models import perturbed_copy, reference_greedy, tiny_model, word_tokenizer

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


def run_trials(kind, sampling, seed=0, coupled=False):
    """``coupled``: each trial samples by a ``PositionNoise`` of its own (a seeded request's rule)."""
    target, draft_table = tables(seed)
    rng = torch.Generator().manual_seed(seed + 100)
    counts = dict.fromkeys(itertools.product(range(V), repeat=STEPS), 0)
    for _ in range(TRIALS):
        tokens = [0]
        noise = PositionNoise(torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=rng))))
        while len(tokens) <= STEPS:
            tree = TokenTree.from_draft(tokens[-1], propose(kind, rng, tokens, draft_table, sampling))
            logits = markov_logits(target, tree.tokens)
            if coupled:
                verdict = verify(tree, logits, sampling, noise=noise, position=len(tokens) - 1)
            else:
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


@pytest.mark.parametrize("kind", ["det-tree", "sto-chain", "mixed-tree"])
def test_the_seeded_rule_matches_target_distribution(kind):
    counts, exact = run_trials(kind, SamplingParams(temperature=0.8), coupled=True)
    assert_same_distribution(counts, exact)
    counts, exact = run_trials(kind, SamplingParams(temperature=1.3, top_k=3, top_p=0.9), seed=1, coupled=True)
    assert_same_distribution(counts, exact)


def test_a_seeded_text_does_not_depend_on_the_draft():
    """The same noise gives the same tokens whether nothing, a random tree or the noise's own pick
    from the draft distribution was drafted (only how many forwards it took changes)."""
    target, draft_table = tables(2)
    sampling = SamplingParams(temperature=1.0)
    rng = torch.Generator().manual_seed(9)
    accepted = 0
    for trial in range(200):
        texts = []
        for kind in ("none", "det-tree", "sto-chain", "noise"):
            noise, tokens = PositionNoise(torch.Generator().manual_seed(trial)), [0]
            while len(tokens) <= 6:
                if kind == "none":
                    draft = None
                elif kind == "noise":  # a chain drafted by the very noise the target samples with
                    q = warp(torch.log(draft_table), sampling)
                    chain = [noise.choose(q[tokens[-1]], len(tokens) - 1)]
                    chain.append(noise.choose(q[chain[-1]], len(tokens)))
                    draft = Draft(chain, [-1, 0], q[[tokens[-1], chain[0]]])
                else:
                    draft = propose(kind, rng, tokens, draft_table, sampling)
                tree = TokenTree.from_draft(tokens[-1], draft)
                logits = markov_logits(target, tree.tokens)
                verdict = verify(tree, logits, sampling, noise=noise, position=len(tokens) - 1)
                accepted += verdict.num_accepted
                tokens += [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
            texts.append(tokens[:7])
        assert texts[1:] == texts[:-1], f"trial {trial}: {texts}"
    assert accepted > 200  # drafts were accepted, so the check saw more than plain steps


def test_position_noise_draws_follow_the_distribution_over_many_blocks():
    """``PositionNoise`` picks a block by its mass, then a token inside it: across positions (fresh
    noise each) a vocabulary that is not a multiple of the block, zeros and uneven masses come out
    right; a position's token does not depend on the order positions are asked in."""
    from speculum.sampling import SAMPLE_BLOCK

    vocab = 3 * SAMPLE_BLOCK + 37
    probs = torch.zeros(vocab)
    hot = [0, SAMPLE_BLOCK - 2, SAMPLE_BLOCK + 3, 2 * SAMPLE_BLOCK + 5, vocab - 1]
    probs[hot] = torch.tensor([0.1, 0.25, 0.15, 0.2, 0.3]) * 7.0  # unnormalised; blocks 0 and 1 hold two each
    noise = PositionNoise(torch.Generator().manual_seed(0))
    draws = [noise.choose(probs, i) for i in range(5000)]
    assert set(draws) <= set(hot)
    _, pvalue = chisquare([draws.count(t) for t in hot], [500.0, 1250.0, 750.0, 1000.0, 1500.0])
    assert pvalue > 1e-3
    backwards = PositionNoise(torch.Generator().manual_seed(0))
    assert [backwards.choose(probs, i) for i in reversed(range(50))] == draws[:50][::-1]
    backwards.forget(10)
    with pytest.raises(RuntimeError):
        backwards.choose(probs, 3)  # committed and forgotten: asking again is a bug


def test_one_draw_follows_the_distribution_over_many_blocks():
    """``sample`` searches blocks of tokens, then inside one: a vocabulary that is not a multiple of
    the block, zeros (whole blocks, and at a block's end) and uneven masses all come out right."""
    from speculum.sampling import SAMPLE_BLOCK, sample

    vocab = 3 * SAMPLE_BLOCK + 37
    probs = torch.zeros(vocab)
    hot = [0, SAMPLE_BLOCK - 2, 2 * SAMPLE_BLOCK + 5, vocab - 1]  # block 1 is all zeros
    probs[hot] = torch.tensor([0.1, 0.4, 0.2, 0.3]) * 7.0  # unnormalised on purpose
    rng = torch.Generator().manual_seed(0)
    draws = [sample(probs, rng) for _ in range(4000)]
    assert set(draws) <= set(hot)
    _, pvalue = chisquare([draws.count(t) for t in hot], [400.0, 1600.0, 800.0, 1200.0])
    assert pvalue > 1e-3
    assert sample(torch.eye(vocab)[SAMPLE_BLOCK - 1], rng) == SAMPLE_BLOCK - 1  # a block's last token


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


@pytest.mark.parametrize(
    "method", ["prompt_lookup", "anpd", "lookahead", "draft_model", "ouroboros", "medusa", "ctc", "random_tree"]
)
def test_a_seeded_request_gives_plain_samplings_text_with_every_method(method, trained_heads):
    """Through the engine and a transformer, a seeded sampled request gives the very text plain
    sampling with that seed gives, whatever drafts, and a draft model's chain is accepted."""
    from helpers import RandomTreeDrafter

    model = tiny_model("llama", vocab_size=16)
    draft = _draft_for(model, 16)
    prompt = [3, 4, 5] + reference_greedy(model, [3, 4, 5], 12)
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    params = {
        "lookahead": {"window_size": 3, "ngram_size": 4, "pool_from_prompt": True},
        "ouroboros": {"num_speculative_tokens": 3, "window_size": 3, "ngram_size": 3},
        "medusa": {"heads": trained_heads["medusa"], "tree_nodes": 12},
        "ctc": {"heads": trained_heads["ctc"], "tree_nodes": 12},
    }.get(method, {"num_speculative_tokens": 3})

    def text(drafter, seed):
        noise = PositionNoise(torch.Generator().manual_seed(seed))
        return generate_ids(model, prompt, drafter, 24, sampling, noise.generator, noise=noise)

    accepted = 0
    for seed in range(6):
        plain, _ = text(build_drafter("autoregressive"), seed)
        if method == "random_tree":
            drafter = RandomTreeDrafter(plain, 16, seed=seed)  # (trees that hold the text's tokens, partly)
        else:
            drafter = build_drafter(method, draft, 16, target=model, **params)
        out, stats = text(drafter, seed)
        assert out == plain, f"seed {seed}"
        accepted += stats.accepted_tokens
    assert accepted > 0


def _first_tokens_exact(model, prompt, sampling, n):
    """P(first ``n`` generated tokens) under the warped target, by enumerating its support."""
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(n):
            longer = {}
            for seq, p in joint.items():
                probs = warp(model(torch.tensor([prompt + list(seq)], device=model.device)).logits[0, -1], sampling)[0]
                for token in torch.nonzero(probs > 0).flatten().tolist():
                    longer[seq + (token,)] = p * probs[token].item()
            joint = longer
    return joint


def test_ouroboros_draft_picks_by_the_seeded_requests_noise():
    """At T > 0 with a seed, Ouroboros' draft picks its tokens by the request's noise, as the target
    does: a draft equal to the target is accepted (nearly) always, even on the tiny model's nearly
    flat distributions, where its argmax would be the sampled token about one time in ten."""
    model = tiny_model("llama", vocab_size=16)
    prompt = [3, 4, 5] + reference_greedy(model, [3, 4, 5], 12)
    sampling = SamplingParams(temperature=1.0)
    params = dict(num_speculative_tokens=4, phrase_drafting=False, lengthen=False, context_phrases=False,
                  length_policy="fixed")  # fmt: skip
    accepted = drafted = 0
    for seed in range(4):
        plain_noise, noise = (PositionNoise(torch.Generator().manual_seed(seed)) for _ in range(2))
        plain, _ = generate_ids(model, prompt, build_drafter("autoregressive"), 24, sampling, plain_noise.generator,
                                noise=plain_noise)  # fmt: skip
        drafter = build_drafter("ouroboros", model, 16, **params)
        out, stats = generate_ids(model, prompt, drafter, 24, sampling, noise.generator, noise=noise)
        assert out == plain
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
    assert drafted >= 40 and accepted >= 0.9 * drafted


def test_an_unseeded_ouroboros_request_samples_by_noise_too(model_dir):
    """Without a seed, a sampled Ouroboros request still samples by a noise (of fresh entropy), so
    its draft picks by it; draft_model's keeps speculative sampling's rule; greedy needs none."""
    import speculum
    from speculum.methods import SpeculativeConfig

    spec = speculum.load(model_dir, draft="self:1", dtype="float32")
    ids = spec.encode_prompt("w3 w4 w5 w6 w3 w4")

    def request(method, **kw):
        config = SpeculativeConfig.coerce(method)
        return spec.request(ids, config, spec.drafters_for(config, 1)[0], max_new_tokens=8, **kw)

    assert request("ouroboros", temperature=0.8).noise is not None
    assert request("draft_model", temperature=0.8).noise is None
    assert request("draft_model", temperature=0.8, seed=1).noise is not None
    assert request("ouroboros").noise is None
    texts = {tuple(spec.generate(ids, "ouroboros", max_new_tokens=12, temperature=1.0).token_ids) for _ in range(4)}
    assert len(texts) > 1  # fresh entropy per request


def _draft_for(target, vocab_size: int):
    """A draft close to the target (so its drafts are often accepted several tokens deep), with a head
    of ``vocab_size`` rows (wider or narrower than the target's)."""
    draft = perturbed_copy(target, scale=0.2)
    if vocab_size != target.config.vocab_size:
        draft.resize_token_embeddings(vocab_size, mean_resizing=False)
    return draft


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    """Medusa heads and a CTC module trained (seconds) on the tiny target's own greedy text: random
    heads are almost never right twice in a row, so they would not exercise deep trees."""
    import speculum
    from speculum.training import draft_heads
    from speculum.training.texts import TrainingText

    # one thread, float32: what a few epochs of training give must not depend on the machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = tiny_model("llama", vocab_size=16), word_tokenizer()
    texts = []
    for seed in range(24):
        start = torch.randint(3, 16, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        texts.append(TrainingText(f"t{seed}", "", tokenizer.decode(start + reference_greedy(model, start, 40))))
    paths = {}
    for kind in ("medusa", "ctc"):
        shape = dict(num_heads=3, slots=6, label_length=3, context=4, draft_vocab=16)
        training = dict(epochs=8, lr=1e-2, batch_size=32, val_fraction=0.1, consistent=False, precision="float32")
        settings = draft_heads.HeadSettings(kind, **shape, **training)
        out = tmp_path_factory.mktemp(kind)
        spec = speculum.Speculum(model, tokenizer)
        draft_heads.run(spec, texts, out, draft_heads.DistillSettings(), settings, progress=False, log=lambda _: None)
        paths[kind] = str(out)
    torch.set_num_threads(threads)
    return paths


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
        ("medusa", 16, 16),  # trees from heads over the target's hidden states
        ("ctc", 16, 16),
    ],
)
def test_engine_sampling_on_a_real_model(method, target_vocab, draft_vocab, tmp_path, trained_heads):
    """End to end through the engine and a transformer: the first three tokens follow the warped target.

    Four tokens are generated, so the first step verifies drafts three deep (plus the bonus token);
    the prompt holds the target's own greedy text and the drafts come from a close draft model or
    trained heads, so drafts are accepted three deep, which the test checks (else it would not cover
    what decides the third token)."""
    model = tiny_model("llama", vocab_size=target_vocab)
    draft = _draft_for(model, draft_vocab)
    prompt = [3, 4, 5] + reference_greedy(model, [3, 4, 5], 12)
    # top-k 3: few enough sequences that each has an expected count a chi-square test can use (the tiny
    # model's full distribution is nearly flat over its vocabulary)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    exact = _first_tokens_exact(model, prompt, sampling, 3)
    trials = 1500
    counts = dict.fromkeys(exact, 0)
    gen = torch.Generator(model.device).manual_seed(11)
    params = {
        "lookahead": {"window_size": 3, "ngram_size": 4, "pool_from_prompt": True},
        "ouroboros": {"num_speculative_tokens": 3, "window_size": 3, "ngram_size": 3},
    }.get(method, {"num_speculative_tokens": 3})
    if method == "specdecpp":
        from speculum.heads.acceptance import AcceptanceHead

        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, 1, early=True)
        torch.nn.init.normal_(head.confidence.weight)
        head.save(tmp_path / "head")
        method = "draft_model"
        # (an untrained head stops at random: at least three tokens, so that some drafts go three deep)
        params = {"length_policy": "specdecpp", "acceptance_head": str(tmp_path / "head"), "stop_threshold": 0.5,
                  "min_draft_tokens": 3}  # fmt: skip
    if method in ("medusa", "ctc"):
        params = {"heads": trained_heads[method], "tree_nodes": 12}
    drafter = build_drafter(method, draft, target_vocab, target=model, **params)
    accepted_three_deep = 0
    for _ in range(trials):
        # the draft-model run also goes through the lazy LM head (rows computed along the walk)
        out, stats = generate_ids(model, prompt, drafter, 4, sampling, gen, lazy_head=method == "draft_model")
        first = tuple(out[:3])
        assert first in counts, f"sampled {first}, outside the warped support"
        counts[first] += 1
        accepted_three_deep += len(stats.accepted_per_position) > 2 and stats.accepted_per_position[2] > 0
    if target_vocab == draft_vocab:  # (the other cases test distributions fitted across vocabulary widths)
        assert accepted_three_deep >= 5, "drafts were (almost) never accepted three deep: deep trees went untested"
    # chi-square needs expected counts >= 5: the rarer sequences are pooled into one cell (or, when even
    # that cell would be too small, into the least likely kept one)
    keep = sorted((k for k, p in exact.items() if p * trials >= 5), key=exact.get, reverse=True)
    observed = [counts[k] for k in keep]
    expected = [exact[k] * trials for k in keep]
    rest_observed, rest_expected = trials - sum(observed), trials - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:
        observed[-1] += rest_observed
        expected[-1] += rest_expected
    _, pvalue = chisquare(observed, expected)
    assert pvalue > 1e-3
