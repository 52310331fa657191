"""Unit tests of the ANPD drafter against the drafter protocol (no model needed)."""

from __future__ import annotations

import os
import random

import pytest

from speculum.drafters.anpd import AnpdDrafter, Options
from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, Resources
from speculum.drafters.ngram_table import NgramTable
from speculum.errors import InvalidInputError, PoolFileError

from helpers import brute_counts, repetitive


def ctx_of(tokens, prompt_length=None, max_depth=64, eos=frozenset()):
    return DraftContext(
        tokens=tokens,
        prompt_length=len(tokens) if prompt_length is None else prompt_length,
        sampling=None,
        generator=None,
        max_depth=max_depth,
        eos_token_ids=frozenset(eos),
    )


def greedy_walk(draft, truth):
    """What a greedy verifier accepts when the target would produce ``truth``."""
    accepted, nodes, node = [], [], -1
    if draft is not None:
        for i, (tok, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
            if parent == node and len(accepted) < len(truth) - 1 and tok == truth[len(accepted)]:
                accepted.append(tok)
                nodes.append(i)
                node = i
    return Outcome(
        accepted=accepted,
        accepted_nodes=nodes,
        next_token=truth[len(accepted)],
        drafted=0 if draft is None else len(draft),
    )


def run_request(drafter, prompt, full, max_new=None):
    """Engine-like loop: generate ``full[len(prompt):]`` with drafts from ``drafter``."""
    tokens = list(prompt)
    end = len(full) if max_new is None else len(prompt) + max_new
    drafter.start(ctx_of(tokens))
    steps = []
    while len(tokens) < end:
        ctx = ctx_of(tokens, len(prompt), max_depth=end - len(tokens) - 1)
        draft = drafter.propose(ctx)
        if draft is not None:
            assert draft.probs is None
            assert len(draft) >= 1 and max(_depths(draft)) <= ctx.max_depth
        outcome = greedy_walk(draft, full[len(tokens) : end])
        tokens.extend([*outcome.accepted, outcome.next_token])
        drafter.observe(ctx_of(tokens, len(prompt)), outcome)
        steps.append((draft, outcome))
    assert tokens == full[:end]
    return steps


def _depths(draft):
    depths = []
    for p in draft.parents:
        depths.append(1 if p == -1 else depths[p] + 1)
    return depths


# ---------------------------------------------------------------- options


def test_defaults_and_name():
    o = Options()
    assert (o.num_speculative_tokens, o.max_ngram_size, o.tree_top_k, o.max_tree_nodes) == (
        7,
        5,
        3,
        16,
    )
    assert o.runtime_update and o.multi_level and o.adaptive
    assert not o.tree and not o.persist and o.pool_path is None
    d = AnpdDrafter(o)
    assert AnpdDrafter.name == "anpd" and isinstance(d, Drafter)
    assert AnpdDrafter.Options is Options
    assert d.forwards == 0
    assert (d.table.min_n, d.table.max_n) == (2, 5)
    # the engine passes every drafter the same resources
    e = AnpdDrafter(o, Resources(vocab_size=100, model_key="m"))
    assert e.model_key == "m"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 2.5},
        {"max_ngram_size": 1},
        {"tree_top_k": 0},
        {"max_tree_nodes": 0},
        {"min_count": 0},
        {"min_agreement": 1.5},
        {"min_agreement": -0.1},
        {"min_agreement": "high"},
        {"max_entries": 0},
        {"tree": "yes"},
        {"persist": 1},
        {"num_speculative_tokens": True},
        {"pool_path": 3},
    ],
)
def test_bad_options_raise(kwargs):
    with pytest.raises(InvalidInputError):
        Options(**kwargs)


def test_constructor_rejects_foreign_options():
    with pytest.raises(InvalidInputError):
        AnpdDrafter({"num_speculative_tokens": 3})
    with pytest.raises(InvalidInputError):
        AnpdDrafter(Options(), table=NgramTable(max_n=3))  # levels 2..3, options ask 2..5


# ---------------------------------------------------------------- drafting


def test_chain_copies_from_prompt_up_to_k():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 5, 6]
    d = AnpdDrafter(Options(num_speculative_tokens=4))
    d.start(ctx_of(prompt))
    draft = d.propose(ctx_of(prompt))
    assert draft.tokens == [7, 8, 9, 10] and draft.parents == [-1, 0, 1, 2]
    assert draft.probs is None
    assert d.propose(ctx_of(prompt, max_depth=2)).tokens == [7, 8]
    assert d.propose(ctx_of(prompt, max_depth=0)) is None
    assert d.propose(ctx_of([*prompt, 99])) is None  # nothing to copy: a plain decode step
    before = d.table.counts()
    d.propose(ctx_of([*prompt, 99, 5, 6, 4, 4]))  # proposing never changes the table
    assert d.table.counts() == before


def test_eos_stops_the_draft_when_adaptive():
    prompt = [1, 2, 3, 0, 4, 1, 2]
    d = AnpdDrafter(Options())
    d.start(ctx_of(prompt))
    assert d.propose(ctx_of(prompt, eos={0})).tokens == [3, 0]
    faithful = AnpdDrafter(Options(adaptive=False))
    faithful.start(ctx_of(prompt))
    assert faithful.propose(ctx_of(prompt, eos={0})).tokens[:3] == [3, 0, 4]


def test_weak_evidence_stops_only_when_adaptive():
    prompt = [1, 2, 1, 3, 1, 4, 1, 5, 1]  # after 1: four continuations, 1/4 agreement each
    strict = AnpdDrafter(Options(min_agreement=0.3))
    strict.start(ctx_of(prompt))
    assert strict.propose(ctx_of(prompt)) is None
    faithful = AnpdDrafter(Options(min_agreement=0.3, adaptive=False))
    faithful.start(ctx_of(prompt))
    assert faithful.propose(ctx_of(prompt)).tokens[0] == 5  # most recent of the tied counts


def test_multi_level_off_uses_only_the_largest_n():
    prompt = [1, 2, 3, 4, 9, 9, 9, 7, 3]
    multi = AnpdDrafter(Options(max_ngram_size=3))
    multi.start(ctx_of(prompt))
    assert multi.propose(ctx_of(prompt)).tokens[0] == 4  # bigram 3 -> 4
    single = AnpdDrafter(Options(max_ngram_size=3, multi_level=False))
    single.start(ctx_of(prompt))
    assert single.propose(ctx_of(prompt)) is None  # trigram (7, 3) never seen
    # (9, 9) -> 9 and (9, 9) -> 7 tie on count: the most recent, 7, wins
    assert single.propose(ctx_of([*prompt, 9, 9])).tokens[0] == 7


def test_tree_draft_shape_and_budget():
    prompt = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 6, 1, 2]
    d = AnpdDrafter(Options(tree=True, tree_top_k=3, max_tree_nodes=5, min_agreement=0.0))
    d.start(ctx_of(prompt))
    draft = d.propose(ctx_of(prompt))
    assert isinstance(draft, Draft) and draft.probs is None
    assert len(draft) == 5
    roots = [t for t, p in zip(draft.tokens, draft.parents, strict=True) if p == -1]
    assert sorted(roots) == [3, 4, 5]
    assert all(-1 <= p < i for i, p in enumerate(draft.parents))
    shallow = d.propose(ctx_of(prompt, max_depth=1))
    assert set(shallow.parents) == {-1}


# ---------------------------------------------------------------- updates


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_runtime_update_counts_each_token_once(seed, tree):
    rng = random.Random(seed)
    full = repetitive(rng, 260, vocab=8)
    prompt = full[:60]
    d = AnpdDrafter(Options(tree=tree))
    steps = run_request(d, prompt, full)
    assert sum(len(o.accepted) for _, o in steps) > 20  # drafts were actually used
    assert d.table.counts() == brute_counts([full])
    # a repeated observe / propose on the same tokens adds nothing
    d.observe(ctx_of(list(full)), Outcome([], [], full[-1], 0))
    d.propose(ctx_of(list(full)))
    assert d.table.counts() == brute_counts([full])


def test_runtime_update_off_keeps_the_prompt_table():
    rng = random.Random(7)
    full = repetitive(rng, 200, vocab=8)
    d = AnpdDrafter(Options(runtime_update=False))
    run_request(d, full[:50], full)
    assert d.table.counts() == brute_counts([full[:50]])


def test_requests_are_independent_without_persist():
    d = AnpdDrafter(Options())
    d.start(ctx_of([1, 2, 3]))
    d.start(ctx_of([4, 5, 6]))
    assert d.table.counts() == brute_counts([[4, 5, 6]])


def test_persist_accumulates_requests_without_boundary_ngrams():
    rng = random.Random(8)
    a, b = repetitive(rng, 120, vocab=8), repetitive(rng, 120, vocab=8)
    d = AnpdDrafter(Options(persist=True))
    run_request(d, a[:40], a)
    run_request(d, b[:40], b)
    assert d.table.counts() == brute_counts([a, b])


def test_adaptive_k_shrinks_on_rejection_and_grows_on_full_acceptance():
    prompt = [*range(10, 30), 10, 11]
    d = AnpdDrafter(Options(num_speculative_tokens=7))
    d.start(ctx_of(prompt))
    ctx = ctx_of(prompt)
    assert len(d.propose(ctx)) == 7
    rejected = Outcome([], [], 99, 7)
    d.observe(ctx, rejected)
    assert d.current_k == 3 and len(d.propose(ctx)) == 3
    d.observe(ctx, Outcome([], [], 99, 3))
    assert d.current_k == 1
    d.observe(ctx, Outcome([], [], 99, 1))
    assert d.current_k == 1  # never below 1
    assert len(d.propose(ctx)) == 1
    d.observe(ctx, Outcome([12], [0], 13, 1))  # full acceptance
    assert d.current_k == 3
    assert len(d.propose(ctx)) == 3
    d.observe(ctx, Outcome([12], [0], 77, 3))  # partial acceptance keeps K
    assert d.current_k == 3
    for _ in range(5):
        draft = d.propose(ctx)
        d.observe(ctx, Outcome(draft.tokens, list(range(len(draft))), 0, len(draft)))
    assert d.current_k == 7  # capped at num_speculative_tokens
    d.observe(ctx, Outcome([], [], 0, 0))  # no draft: no change
    assert d.current_k == 7
    fixed = AnpdDrafter(Options(num_speculative_tokens=7, adaptive=False))
    fixed.start(ctx_of(prompt))
    fixed.observe(ctx, rejected)
    assert fixed.current_k == 7 and len(fixed.propose(ctx)) == 7
    d.start(ctx_of(prompt))  # a new request starts from full K again
    d.observe(ctx, rejected)
    d.start(ctx_of(prompt))
    assert d.current_k == 7


# ---------------------------------------------------------------- persistence


def test_pool_round_trip_gives_same_proposals(tmp_path):
    path = str(tmp_path / "anpd.pool")
    rng = random.Random(9)
    full = repetitive(rng, 200, vocab=10)
    first = AnpdDrafter(Options(pool_path=path), Resources(model_key="vocab-1"))
    run_request(first, full[:50], full)
    first.save()
    assert os.listdir(tmp_path) == ["anpd.pool"]
    second = AnpdDrafter(Options(pool_path=path), Resources(model_key="vocab-1"))
    assert second.table.counts() == first.table.counts()
    fresh = AnpdDrafter(Options(), table=first.table)  # same table, fresh adaptive state
    proposed = 0
    for _ in range(20):
        history = [rng.randrange(10) for _ in range(6)]
        a, b = fresh.propose(ctx_of(history)), second.propose(ctx_of(history))
        proposed += a is not None
        assert (a is None and b is None) or (a.tokens, a.parents) == (b.tokens, b.parents)
    assert proposed > 5
    # a new request on the loaded pool adds its prompt to the persisted counts
    second.start(ctx_of([1, 2, 3]))
    assert second.table.counts() == brute_counts([full, [1, 2, 3]])


def test_pool_from_other_model_or_levels_is_refused(tmp_path):
    path = str(tmp_path / "anpd.pool")
    d = AnpdDrafter(Options(persist=True), Resources(model_key="vocab-1"))
    d.start(ctx_of([1, 2, 3, 1, 2]))
    d.save(path)
    with pytest.raises(PoolFileError):
        AnpdDrafter(Options(pool_path=path), Resources(model_key="vocab-2"))
    with pytest.raises(PoolFileError):
        AnpdDrafter(Options(pool_path=path, max_ngram_size=4), Resources(model_key="vocab-1"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(PoolFileError):
        AnpdDrafter(Options(pool_path=path), Resources(model_key="vocab-1"))


def test_missing_pool_file_starts_empty_and_save_needs_a_path(tmp_path):
    path = tmp_path / "new.pool"
    d = AnpdDrafter(Options(pool_path=str(path)))
    assert len(d.table) == 0 and not path.exists()
    with pytest.raises(InvalidInputError):
        AnpdDrafter(Options()).save()


def test_shared_table_between_drafters():
    table = NgramTable(max_n=5)
    a = AnpdDrafter(Options(), table=table)
    b = AnpdDrafter(Options(), table=table)
    a.start(ctx_of([1, 2, 3, 4]))
    b.start(ctx_of([9, 1, 2]))
    assert b.propose(ctx_of([9, 1, 2])).tokens == [3, 4]
    assert a.table is b.table is table
