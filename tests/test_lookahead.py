"""Lookahead decoding's parts: the Jacobi window's tree and steps, the phrase pool and its files."""

import json
import os

import pytest

from speculum import poolfile
from speculum.drafters.lookahead import JacobiWindow, LookaheadDrafter, Options
from speculum.drafters.phrase_pool import PhrasePool
from speculum.errors import InvalidInputError, PoolFileError
from speculum.tree import Draft, TokenTree

from helpers import build_drafter, generate_ids
from tiny_models import reference_greedy, repetitive_prompt, tiny_model


def full_window(width=4, levels=3):
    window = JacobiWindow(width, levels)
    window.reset(list(range(100, 120)))
    window.levels = [[10 * level + column for column in range(width)] for level in range(levels)]
    return window


def test_window_tree_positions_follow_jacobi_columns():
    """Level l, column j sits at position root + 1 + j + l and sees level 0 up to column j, then its column."""
    window = full_window()
    tokens, parents = [], []
    window.add_to(tokens, parents)
    tree = TokenTree.from_draft(999, Draft(tokens, parents))
    for level in range(3):
        for column in range(4):
            node = window.grid[level][column] + 1  # tree node (0 is the root)
            assert tree.tokens[node] == 10 * level + column
            assert tree.depth[node] == 1 + column + level
            ancestors = [tree.tokens[i] for i in tree.path_to(node)[1:]]
            assert ancestors == [c for c in range(column + 1)] + [10 * lv + column for lv in range(1, level + 1)]


def test_window_step_collects_column_ngrams():
    window = full_window()
    window.add_to([], [])
    assert window.step([30, 31, 32, 33]) == [(j, (10 + j, 20 + j, 30 + j)) for j in range(4)]
    assert window.levels == [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]  # oldest level dropped
    assert window.step(None) == []  # outputs unavailable (cut from the tree): nothing changes
    assert window.levels == [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]


def test_window_warm_up():
    window = JacobiWindow(3, 3)
    window.reset([5, 6, 7])
    assert len(window.levels) == 1 and all(t in (5, 6, 7) for t in window.levels[0])  # drawn from the text
    assert window.step([1, 2, 3]) == []  # warming up: no complete column yet
    assert window.step([4, 5, 6]) == []
    assert len(window.levels) == 3
    assert len(window.step([7, 8, 9])) == 3  # full: one n-gram per column


def test_jacobi_on_a_deterministic_bigram_model_gives_true_continuations():
    """With a model whose next token depends on the last token only, every column becomes a true
    trajectory x, f(x), f(f(x)), ...: the n-grams the window harvests are exact continuations."""

    def f(token):
        return (3 * token + 1) % 17

    window = JacobiWindow(5, 3)
    window.reset(list(range(17)))
    harvested = []
    for _ in range(8):
        window.add_to([], [])
        harvested += window.step([f(t) for t in window.levels[-1]])
    assert len(harvested) > 10
    for key, phrase in harvested:
        expected, x = [], key
        for _ in phrase:
            x = f(x)
            expected.append(x)
        assert list(phrase) == expected


def test_lookahead_accepts_on_repetitive_text_and_learns_the_pool():
    model = tiny_model("llama")
    prompt = repetitive_prompt(30, 5, 0)
    ref = reference_greedy(model, prompt, 48)
    drafter = build_drafter("lookahead", window_size=3, ngram_size=3, guess_set_size=3)
    out, stats = generate_ids(model, prompt, drafter, 48)
    assert out == ref
    assert len(drafter.pool) > 0
    assert stats.accepted_tokens > 0
    assert stats.target_forwards < 48


def test_options_refused():
    with pytest.raises(InvalidInputError, match="ngram_size"):
        Options(ngram_size=1)
    with pytest.raises(InvalidInputError, match="window_size"):
        Options(window_size=0)
    with pytest.raises(InvalidInputError, match="num_speculative_tokens"):
        build_drafter("lookahead", num_speculative_tokens=4)


# ---------------------------------------------------------------------------------- phrase pool


def test_pool_capacity_refresh_and_replacement():
    pool = PhrasePool(capacity=3)
    for phrase in [(1,), (2,), (3,)]:
        pool.add(7, phrase)
    assert pool.get(7) == [(3,), (2,), (1,)]  # newest first
    pool.add(7, (1,))  # refresh: moves to newest, nothing dropped
    assert pool.get(7) == [(1,), (3,), (2,)]
    pool.add(7, (4,))  # full: the oldest goes
    assert pool.get(7) == [(4,), (1,), (3,)]
    assert pool.get(7, limit=2) == [(4,), (1,)]
    assert pool.get(8) == [] and 8 not in pool
    assert len(pool) == 3


def test_pool_bounds_its_keys():
    pool = PhrasePool(capacity=2, max_keys=3)
    for key in range(3):
        pool.add(key, (key,))
    pool.add(0, (9,))  # key 0 updated: now the most recent
    pool.add(5, (5,))  # over the cap: the least recently updated key (1) goes
    assert sorted(pool.keys()) == [0, 2, 5]


def test_pool_from_text():
    pool = PhrasePool(capacity=4)
    pool.add_ngrams([1, 2, 3, 1, 2, 4], 2)
    assert pool.get(1) == [(2, 4), (2, 3)]
    assert pool.get(3) == [(1, 2)]
    assert 4 not in pool  # a phrase must lie inside the text


def test_pool_file_round_trip(tmp_path):
    pool = PhrasePool(capacity=3)
    pool.add_ngrams([1, 2, 3, 1, 2, 4, 5, 1, 9, 9], 2)
    path = tmp_path / "pool.json"
    pool.save(path, model_key="vocab-a")
    again = PhrasePool.load(path, model_key="vocab-a")
    assert again.capacity == 3
    assert {k: again.get(k) for k in again.keys()} == {k: pool.get(k) for k in pool.keys()}
    smaller = PhrasePool.load(path, model_key="vocab-a", capacity=1)
    assert smaller.get(1) == pool.get(1)[:1]


def _rewrite_body(path, body: bytes):
    import hashlib

    raw = path.read_bytes()
    header = json.loads(raw[: raw.index(b"\n")])
    header.update(body_bytes=len(body), body_sha256=hashlib.sha256(body).hexdigest())
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(p.read_bytes()[:-3]),
        lambda p: p.write_bytes(p.read_bytes().replace(b"[2,3]", b"[2,4]")),
        lambda p: _rewrite_body(p, b'{"entries": [[1, [[-2]]]]}'),
        lambda p: _rewrite_body(p, b'{"entries": [[1, []]]}'),
        lambda p: _rewrite_body(p, b'{"nothing": 1}'),
    ],
    ids=["empty", "truncated", "flipped", "negative-token", "empty-key", "no-entries"],
)
def test_corrupt_pool_file_refused(tmp_path, damage):
    path = tmp_path / "pool.json"
    pool = PhrasePool()
    pool.add_ngrams([1, 2, 3, 1, 2, 3], 2)
    pool.save(path, model_key="k")
    damage(path)
    with pytest.raises(PoolFileError):
        PhrasePool.load(path, model_key="k")


def test_pool_file_for_another_vocabulary_or_kind_refused(tmp_path):
    from speculum.drafters.ngram_table import NgramTable

    pool = PhrasePool()
    pool.add(1, (2, 3))
    pool.save(tmp_path / "p", model_key="vocab-a")
    with pytest.raises(PoolFileError, match="model_key"):
        PhrasePool.load(tmp_path / "p", model_key="vocab-b")
    with pytest.raises(PoolFileError, match="not a speculum n-gram pool"):
        NgramTable.load(tmp_path / "p", model_key="vocab-a")


def test_failed_pool_save_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "pool.json"
    pool = PhrasePool()
    pool.add(1, (2,))
    pool.save(path)
    before = path.read_bytes()
    pool.add(1, (3,))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(poolfile.os, "replace", boom)
    with pytest.raises(PoolFileError, match="disk full"):
        pool.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["pool.json"]


def test_lookahead_pool_persists_across_requests_and_files(tmp_path):
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(24, 5, 1)
    path = tmp_path / "lookahead.pool"
    drafter = build_drafter("lookahead", window_size=3, ngram_size=3, pool_path=str(path))
    generate_ids(model, prompt, drafter, 24)
    learned = {k: drafter.pool.get(k) for k in drafter.pool.keys()}
    assert learned
    generate_ids(model, prompt, drafter, 1)  # a one-step request: start() keeps the pool, nothing is added
    assert {k: drafter.pool.get(k) for k in drafter.pool.keys()} == learned
    fresh = build_drafter("lookahead", window_size=3, ngram_size=3)  # not persistent: each request starts empty
    generate_ids(model, prompt, fresh, 24)
    generate_ids(model, prompt, fresh, 1)
    assert len(fresh.pool) == 0
    drafter.save()
    warm = build_drafter("lookahead", window_size=3, ngram_size=3, pool_path=str(path))
    assert {k: warm.pool.get(k) for k in warm.pool.keys()} == {k: drafter.pool.get(k) for k in drafter.pool.keys()}
    out, _ = generate_ids(model, prompt, warm, 24)
    assert out == reference_greedy(model, prompt, 24)
    assert isinstance(warm, LookaheadDrafter)
