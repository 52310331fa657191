"""The phrases drafter (Ouroboros' context and history phrases, no draft model): lossless through
the engine, phrases carried from one request to the next by a shared pool, two-token matches
preferred, and the depth and end-of-sequence limits kept."""

from __future__ import annotations

import pytest

from speculum.drafters.base import DraftContext
from speculum.drafters.phrase_pool import PhrasePool
from speculum.drafters.phrases import Options, PhrasesDrafter
from speculum.errors import InvalidInputError
from speculum.sampling import SamplingParams

from helpers import generate_ids
from tiny_models import reference_greedy, repetitive_prompt, tiny_model

NEW = 32


def ctx(tokens, max_depth=8, eos=frozenset()):
    return DraftContext(list(tokens), len(tokens), SamplingParams(), None, max_depth=max_depth, eos_token_ids=eos)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_output_equals_plain_decoding_and_phrases_are_accepted(arch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(30, 6, 1)
    out, stats = generate_ids(model, prompt, PhrasesDrafter(), NEW)
    assert out == reference_greedy(model, prompt, NEW)
    assert stats.accepted_tokens > 0


def test_a_shared_pool_carries_phrases_to_the_next_request():
    pool = PhrasePool(15)
    first = PhrasesDrafter(Options(ngram_size=4), pool=pool)
    first.start(ctx([10, 11, 12, 13, 14, 15, 16]))
    second = PhrasesDrafter(Options(ngram_size=4), pool=pool)
    c = ctx([40, 41, 13], max_depth=4)
    second.start(c)
    assert second.propose(c).tokens == [14, 15, 16]  # the rest of request one, as far as it went
    alone = PhrasesDrafter(Options(ngram_size=4))
    alone.start(c)
    assert alone.propose(c) is None


def test_a_two_token_match_comes_before_the_newest_phrase():
    pool = PhrasePool(15)
    pool.add(7, (8, 20, 21, 22))  # after "7 8": 20 21 22
    pool.add(8, (30, 31, 32, 33))  # the newest after "8"
    drafter = PhrasesDrafter(Options(ngram_size=5, num_speculative_tokens=3), pool=pool)
    assert drafter.propose(ctx([1, 7, 8])).tokens == [20, 21, 22]
    assert drafter.propose(ctx([1, 6, 8])).tokens == [30, 31, 32]


def test_chains_continue_from_their_own_end_and_stop_at_the_limits():
    pool = PhrasePool(15)
    pool.add(1, (2, 3))
    pool.add(3, (4, 5))
    pool.add(5, (6, 9))
    drafter = PhrasesDrafter(Options(ngram_size=3, num_speculative_tokens=8), pool=pool)
    assert drafter.propose(ctx([0, 1])).tokens == [2, 3, 4, 5, 6, 9]
    assert drafter.propose(ctx([0, 1], max_depth=3)).tokens == [2, 3, 4]
    assert drafter.propose(ctx([0, 1], eos=frozenset({5}))).tokens == [2, 3, 4]


def test_committed_tokens_enter_the_pool():
    drafter = PhrasesDrafter(Options(ngram_size=3))
    drafter.start(ctx([1, 2, 3]))
    assert drafter.pool.get(1) == [(2, 3)]
    drafter.observe(ctx([1, 2, 3, 4, 5]), None)
    assert drafter.pool.get(3) == [(4, 5)] and drafter.pool.get(2) == [(3, 4)]


def test_options_are_checked():
    with pytest.raises(InvalidInputError, match="ngram_size"):
        Options(ngram_size=1)
    with pytest.raises(InvalidInputError, match="num_speculative_tokens"):
        Options(num_speculative_tokens=0)
