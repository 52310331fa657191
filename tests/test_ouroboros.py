"""Ouroboros' parts: phrases from verification, lengthened drafts, the pool shared and saved across requests."""

import pytest
import torch

import speculum
from speculum.drafters.base import Outcome
from speculum.drafters.phrase_pool import PhrasePool
from speculum.errors import InvalidInputError
from speculum.sampling import PositionNoise, SamplingParams
from speculum.tree import Draft

from helpers import build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, reference_greedy, repetitive_prompt, tiny_model, word_tokenizer

SMALL = {"num_speculative_tokens": 4, "window_size": 3, "ngram_size": 4, "guess_set_size": 3}


class FakeTarget:
    """What the target 'predicted' after each draft node."""

    def __init__(self, after: dict[int, int]):
        self.after = after

    def argmax_of(self, nodes):
        return [self.after.get(n) for n in nodes]


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama")
    return model, perturbed_copy(model, scale=0.4)


def test_rejected_tail_gives_the_target_consistent_segments(pair):
    model, draft = pair
    drafter = build_drafter("ouroboros", draft, VOCAB, **SMALL)
    drafter._chain = [10, 11, 12, 13]
    # the target rejects 11 (it says 20 after 10), then, reading the draft's context, predicts 13 after
    # 12 (as the draft has) and 14 after 13: the segment 12 -> (13, 14) is consistent with the draft
    target = FakeTarget({0: 20, 1: 5, 2: 13, 3: 14})
    drafter.observe(None, Outcome([10], [0], 20, 4, Draft.chain(drafter._chain), target))
    assert drafter.pool.get(12) == [(13, 14)]
    assert drafter.pool.get(11) == [] and drafter.pool.get(13) == []  # one-token segments are not phrases


def test_tried_phrases_are_replaced_by_the_target_version(pair):
    model, draft = pair
    drafter = build_drafter("ouroboros", draft, VOCAB, **SMALL)
    drafter.pool.add(11, (5, 6, 7))
    drafter.pool.add(11, (8, 1, 2))
    drafter._chain = [10, 11]
    drafter._phrases = [((5, 6, 7), [2, 3, 4]), ((8, 1, 2), [5, 6, 7])]
    # after the whole draft the target says 5; along the first phrase 6, then 9 (not 7)
    target = FakeTarget({0: 11, 1: 5, 2: 6, 3: 9, 4: 3, 5: 0, 6: 0, 7: 0})
    drafter.observe(None, Outcome([10, 11, 5, 6], [0, 1, 2, 3], 9, 8, None, target))
    assert (5, 6, 9) in drafter.pool.get(11) and (5, 6, 7) not in drafter.pool.get(11)
    assert (5,) in drafter.pool.get(11)  # the second phrase: the target's own first token instead


def test_lengthened_draft_hangs_phrases_below_the_last_token(pair):
    model, draft = pair
    drafter = build_drafter("ouroboros", draft, VOCAB, **SMALL, num_phrase_candidates=2)
    for phrase in [(1, 2, 3), (4, 5, 6), (7, 8, 9)]:
        drafter.pool.add(30, phrase)

    class Ctx:
        max_depth = 6
        eos_token_ids = frozenset()

    out = drafter._lengthened([20, 30], Ctx())
    assert out.tokens == [20, 30, 7, 8, 9, 4, 5, 6]  # the K=2 newest phrases
    assert out.parents == [-1, 0, 1, 2, 3, 1, 5, 6]
    # the controller verifies the draft model's chain as drafted and prunes the phrases only
    assert out.sources == ["draft_model"] * 2 + ["phrases"] * 6 and drafter.whole_sources == {"draft_model"}
    Ctx.max_depth = 3  # room for one more token only
    assert drafter._lengthened([20, 30], Ctx()).tokens == [20, 30, 7, 4]


def test_phrase_drafting_saves_draft_forwards():
    """A perfect draft (the target itself) on text that repeats: its lookahead finds phrases, so it
    needs fewer forwards per drafted token than drafting one token per forward."""
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(30, 5, 2)
    ref = reference_greedy(model, prompt, 60)
    forwards = {}
    for on in (True, False):
        drafter = build_drafter("ouroboros", model, VOCAB, **SMALL, phrase_drafting=on, lengthen=False)
        out, stats = generate_ids(model, prompt, drafter, 60)
        assert out == ref
        forwards[on] = stats.draft_forwards / stats.drafted_tokens
    assert forwards[False] == 1.0
    assert forwards[True] < 0.9


def test_pool_is_shared_by_a_speculum_and_survives_restarts(tmp_path):
    model_dir = tmp_path / "m"
    tiny_model("llama").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    path = tmp_path / "phrases.pool"
    spec = speculum.load(str(model_dir), draft="self:1", dtype="float32")
    prompt = repetitive_prompt(24, 5, 0)
    a = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL, pool_path=str(path)))
    spec.generate(prompt, "ouroboros", max_new_tokens=24, **SMALL, pool_path=str(path))
    assert path.exists() and len(a.pool) > 0  # saved after the request
    b = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL, num_phrase_candidates=1, pool_path=str(path)))
    assert b.pool is a.pool  # another configuration of the same Speculum: the same pool
    fresh = speculum.load(str(model_dir), draft="self:1", dtype="float32")  # a restart
    c = fresh.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL, pool_path=str(path)))
    assert {k: c.pool.get(k) for k in c.pool.keys()} == {k: a.pool.get(k) for k in a.pool.keys()}
    plain = fresh.generate(prompt, max_new_tokens=24)
    warm = fresh.generate(prompt, "ouroboros", max_new_tokens=24, **SMALL, pool_path=str(path))
    assert warm.token_ids == plain.token_ids
    assert isinstance(c.pool, PhrasePool)


def test_a_failed_save_keeps_the_result(tmp_path, caplog):
    """The pool is saved when a request ends; a write that fails (here: no such directory) is logged,
    and the generated text is still returned."""
    model = tiny_model("llama")
    spec = speculum.Speculum(model, word_tokenizer(), perturbed_copy(model), word_tokenizer())
    prompt = repetitive_prompt(24, 5, 0)
    plain = spec.generate(prompt, max_new_tokens=16)
    with caplog.at_level("WARNING", logger="speculum"):
        result = spec.generate(
            prompt, "ouroboros", max_new_tokens=16, **SMALL, pool_path=str(tmp_path / "missing" / "p.pool")
        )
    assert result.token_ids == plain.token_ids
    assert "not saved" in caplog.text and "missing" in caplog.text


def test_forget_drops_the_drafter_and_the_pools_no_other_drafter_uses(pair):
    model, draft = pair
    spec = speculum.Speculum(model, word_tokenizer(), draft, word_tokenizer())
    a = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL))
    b = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL, num_phrase_candidates=1))  # a's pool
    c = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **{**SMALL, "guess_set_size": 5}))  # its own pool

    def pools():  # (the shared objects are the pools and the draft forwards' clock)
        return [id(p) for p in spec._shared.values() if isinstance(p, PhrasePool)]

    assert b.pool is a.pool and len(pools()) == 2
    spec.forget(speculum.SpeculativeConfig("ouroboros", **SMALL))
    assert set(pools()) == {id(b.pool), id(c.pool)}  # b still uses the first pool
    assert c.clock in spec._shared.values()  # b and c still time their forwards on it
    spec.forget(speculum.SpeculativeConfig("ouroboros", **SMALL, num_phrase_candidates=1))
    assert pools() == [id(c.pool)] and spec.built_drafters() == [c]
    again = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL))
    assert again is not a and again.pool is not a.pool and len(again.pool) == 0  # starts afresh


def test_pools_per_config_keeps_each_configuration_apart(pair):
    """Benchmarks compare settings on the same prompts: one must not read the phrases another harvested."""
    model, draft = pair
    spec = speculum.Speculum(model, word_tokenizer(), draft, word_tokenizer())
    spec.pools_per_config = True
    prompt = repetitive_prompt(24, 5, 0)
    plain = spec.generate(prompt, max_new_tokens=24)
    first = spec.generate(prompt, "ouroboros", max_new_tokens=24, **SMALL)
    a = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL))
    b = spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL, num_phrase_candidates=1))
    assert len(a.pool) > 0 and b.pool is not a.pool and len(b.pool) == 0
    assert first.token_ids == plain.token_ids
    assert spec.generate(prompt, "ouroboros", max_new_tokens=24, **SMALL, num_phrase_candidates=1).token_ids == (
        plain.token_ids
    )
    assert spec.drafter_for(speculum.SpeculativeConfig("ouroboros", **SMALL)).pool is a.pool  # its own, kept
    spec.forget(speculum.SpeculativeConfig("ouroboros", **SMALL))
    assert a.pool not in list(spec._shared.values()) and b.pool in list(spec._shared.values())


def test_ouroboros_sampling_runs_and_is_seeded(pair):
    model, draft = pair
    prompt = repetitive_prompt(20, 4, 1)
    outs = []
    for _ in range(2):
        drafter = build_drafter("ouroboros", draft, VOCAB, **SMALL)
        gen = torch.Generator().manual_seed(4)
        out, _ = generate_ids(model, prompt, drafter, 20, SamplingParams(temperature=0.9), gen)
        outs.append(out)
    assert outs[0] == outs[1] and len(outs[0]) == 20


def test_bad_options_refused(pair):
    model, draft = pair
    with pytest.raises(InvalidInputError, match="draft model"):
        build_drafter("ouroboros")
    with pytest.raises(InvalidInputError, match="ngram_size"):
        build_drafter("ouroboros", draft, VOCAB, ngram_size=1)
    with pytest.raises(InvalidInputError, match="reuse_history"):
        build_drafter("ouroboros", draft, VOCAB, reuse_history=False, pool_path="x.pool")


def test_context_phrases_seed_the_pool_from_prompt_and_output(pair):
    model, draft = pair
    drafter = build_drafter("ouroboros", draft, VOCAB, **SMALL, context_phrases=True)

    class Ctx:
        tokens = [1, 2, 3, 4, 5, 6]
        sampling = None

    drafter.start(Ctx)
    assert drafter.pool.get(1) == [(2, 3, 4)] and drafter.pool.get(2) == [(3, 4, 5)]
    assert drafter.pool.get(3) == [(4, 5, 6)] and drafter.pool.get(4) == []  # phrases lie inside the text
    Ctx.tokens = [1, 2, 3, 4, 5, 6, 7, 2, 9]  # three tokens committed
    drafter._chain = []
    drafter.observe(Ctx, Outcome([], [], 7, 0))
    assert drafter.pool.get(4) == [(5, 6, 7)] and drafter.pool.get(6) == [(7, 2, 9)]
    assert drafter.pool.get(2) == [(3, 4, 5)]  # added once, not again
    assert drafter.pool.get(5) == [(6, 7, 2)]


def test_window_zero_drafts_from_pool_guesses_only(pair):
    model, draft = pair
    prompt = repetitive_prompt()
    ref = reference_greedy(model, prompt, 24)
    drafter = build_drafter(
        "ouroboros", model, VOCAB, **{**SMALL, "window_size": 0}, draft_guesses=2, context_phrases=True, lengthen=False
    )
    out, stats = generate_ids(model, prompt, drafter, 24)
    assert out == ref
    # the draft is the target itself: pool phrases copied from the repetitive prompt are accepted by
    # the draft, so it produces more than one token per forward
    assert stats.draft_forwards < stats.drafted_tokens


def test_draft_guesses_must_be_a_count(pair):
    model, draft = pair
    with pytest.raises(InvalidInputError, match="draft_guesses"):
        build_drafter("ouroboros", draft, VOCAB, draft_guesses=-1)


@pytest.mark.parametrize("method", ["ouroboros", "auto"])
def test_a_draft_with_a_narrower_head_gives_plain_decodings_text(method):
    """A draft whose head covers only the first 520 of the target's 1100 ids (the same tokenizer below
    520): its rows are padded to the target's width with no probability mass, so greedy decoding
    and a seeded sampled request (whose draft picks by the request's noise) give plain decoding's
    text, the seed's."""
    model = tiny_model("llama", vocab_size=1100)
    draft = perturbed_copy(model, scale=0.2)
    draft.resize_token_embeddings(520, mean_resizing=False)
    prompt = [3, 4, 5] + reference_greedy(model, [3, 4, 5], 12)
    params = SMALL if method == "ouroboros" else {}
    out, stats = generate_ids(model, prompt, build_drafter(method, draft, 1100, target=model, **params), 24)
    assert out == reference_greedy(model, prompt, 24) and stats.drafted_tokens > 0
    sampling = SamplingParams(temperature=1.0)
    drafted = 0
    for seed in range(3):
        plain_noise, noise = (PositionNoise(torch.Generator().manual_seed(seed)) for _ in range(2))
        plain, _ = generate_ids(model, prompt, build_drafter("autoregressive"), 24, sampling, plain_noise.generator,
                                noise=plain_noise)  # fmt: skip
        drafter = build_drafter(method, draft, 1100, target=model, **params)
        out, stats = generate_ids(model, prompt, drafter, 24, sampling, noise.generator, noise=noise)
        assert out == plain, f"seed {seed}"
        drafted += stats.drafted_tokens
    assert drafted > 0
