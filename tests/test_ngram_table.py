"""Unit tests of the multi-level n-gram table (pure Python, no torch)."""

from __future__ import annotations

import json
import os
import random

import pytest

from speculum import poolfile
from speculum.drafters import ngram_table as nt
from speculum.drafters.ngram_table import NgramTable
from speculum.errors import InvalidInputError, PoolFileError

from helpers import brute_counts, repetitive


def snapshot(table):
    return table.clock, [(ctx, e[0], e[1], dict(e[2])) for ctx, e in table._data.items()]


# ---------------------------------------------------------------- building


def test_counts_equal_brute_force_recount_no_double_counting():
    rng = random.Random(1)
    seq = repetitive(rng, 300)
    table = NgramTable(max_n=5)
    table.add_sequence(seq)
    assert table.counts() == brute_counts([seq])
    # totals are the sums of the counts
    for ctx in table.contexts():
        entry = table._data[ctx]
        assert entry[0] == sum(c for _, c in table.continuations(ctx))


def test_no_wrap_around_ngram_from_end_of_prompt_to_start():
    table = NgramTable(max_n=3)
    table.add_sequence([7, 8, 9])
    assert table.counts() == {(7, 8): 1, (8, 9): 1, (7, 8, 9): 1}
    assert table.predict([9]) is None  # (9 -> 7) would be the wrap-around n-gram
    assert table.predict([8, 9]) is None
    # two sequences (two requests) never form an n-gram across their boundary
    table.add_sequence([1, 2])
    assert table.predict([9]) is None
    assert (9, 1) not in table.counts()


def test_incremental_update_equals_building_from_scratch():
    rng = random.Random(2)
    seq = repetitive(rng, 400)
    whole = NgramTable(max_n=5)
    whole.add_sequence(seq)
    inc = NgramTable(max_n=5)
    pos = 0
    while pos < len(seq):
        end = min(len(seq), pos + rng.randrange(1, 9))
        inc.add_sequence(seq[:end], start=pos)
        pos = end
    assert snapshot(inc) == snapshot(whole)
    # adding the same positions again *would* change the counts: the check above can fail
    inc.add_sequence(seq, start=len(seq) - 3)
    assert inc.counts() != whole.counts()


def test_multi_level_prefers_largest_n_and_falls_back():
    seq = [1, 2, 3, 4, 5, 9, 4, 6, 8, 4, 6, 8, 4, 6]
    table = NgramTable(max_n=4)
    table.add_sequence(seq)
    assert table.continuations([4]) == [(6, 3), (5, 1)]
    assert table.predict([2, 3, 4]) == 5  # 4-gram (2, 3, 4) -> 5 beats the bigram 4 -> 6
    assert table.predict([0, 3, 4]) == 5  # trigram (3, 4) -> 5
    assert table.predict([0, 0, 4]) == 6  # only the bigram matches
    assert table.predict([0, 0, 0]) is None
    only_top = NgramTable(max_n=4, min_n=4)
    only_top.add_sequence(seq)
    assert only_top.predict([2, 3, 4]) == 5
    assert only_top.predict([0, 0, 4]) is None
    assert all(len(ctx) == 3 for ctx in only_top.contexts())


def test_tie_break_higher_count_then_most_recent():
    t = NgramTable(max_n=2)
    t.add_sequence([1, 5, 1, 6])  # equal counts: the most recent (6) wins
    assert t.predict([1]) == 6
    t.add_sequence([1, 5])  # now 5 is the most recent of equal counts
    assert t.predict([1]) == 5
    t2 = NgramTable(max_n=2)
    t2.add_sequence([1, 5, 1, 5, 1, 6])  # higher count beats recency
    assert t2.predict([1]) == 5
    assert t2.continuations([1]) == [(5, 2), (6, 1)]
    # the cached best always agrees with a full sort, on random data
    rng = random.Random(3)
    t3 = NgramTable(max_n=3)
    t3.add_sequence([rng.randrange(4) for _ in range(500)])
    for ctx in t3.contexts():
        assert t3._data[ctx][1] == t3.continuations(ctx)[0][0]


def test_constructor_validation():
    for kwargs in ({"max_n": 1, "min_n": 1}, {"max_n": 3, "min_n": 4}, {"max_entries": 0}):
        with pytest.raises(InvalidInputError):
            NgramTable(**kwargs)
    with pytest.raises(InvalidInputError):
        NgramTable(max_n=True)


# ---------------------------------------------------------------- drafting


def test_chain_up_to_k_and_early_stop():
    table = NgramTable(max_n=3)
    table.add_sequence(list(range(1, 10)))
    assert table.draft_chain([1, 2, 3], 3) == [4, 5, 6]
    assert table.draft_chain([1, 2, 3], 20) == [4, 5, 6, 7, 8, 9]  # nothing follows 9
    assert table.draft_chain([42], 5) == []
    assert table.draft_chain([3, 7], 2, stop_tokens={8}) == [8]  # stop right after EOS


def test_chain_stops_on_weak_evidence():
    table = NgramTable(max_n=2)
    table.add_sequence([1, 2, 1, 3, 1, 4, 4, 9, 4, 9])
    assert table.draft_chain([1], 1) == [4]  # three tied continuations: the most recent
    assert table.draft_chain([1], 1, min_agreement=0.5) == []  # 1/3 agreement
    assert table.draft_chain([1], 1, min_agreement=0.3) == [4]
    assert table.draft_chain([1], 3, min_agreement=0.6) == []
    assert table.draft_chain([4], 3) == [9, 4, 9]
    assert table.draft_chain([4], 3, min_count=2) == [9]  # 9 -> 4 was seen only once
    assert table.draft_chain([4], 3, min_count=3) == []


def check_tree(table, history, tokens, parents, depth, max_depth, max_nodes, top_k):
    assert len(tokens) == len(parents) <= max_nodes
    depths, children = [], {}
    for i, p in enumerate(parents):
        assert -1 <= p < i  # parents before children
        depths.append(1 if p == -1 else depths[p] + 1)
        children.setdefault(p, []).append(tokens[i])
    assert max(depths, default=0) == depth <= max_depth
    for p, kids in children.items():
        assert len(set(kids)) == len(kids) <= top_k  # distinct siblings
        path = []
        while p != -1:
            path.append(tokens[p])
            p = parents[p]
        window = list(history) + path[::-1]
        entry = table.lookup(window)
        allowed = {tok for tok, _ in sorted(entry[2].items(), key=lambda kv: -kv[1])[:top_k]}
        assert set(kids) <= allowed


def test_tree_small_example():
    table = NgramTable(max_n=3)
    table.add_sequence([1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 1, 2, 3, 7])
    tokens, parents, depth = table.draft_tree([1, 2], 2, 16, 2)
    # best-first by path probability: 3 (2/4), then its child 7 (2/4 * 2/2), then 5 (1/4)
    assert tokens[:3] == [3, 7, 5] and parents[:3] == [-1, 0, -1]
    root_kids = [t for t, p in zip(tokens, parents, strict=True) if p == -1]
    assert root_kids == [3, 5]  # count 2 first, then the most recent of the count-1 ties
    assert depth == 2
    check_tree(table, [1, 2], tokens, parents, depth, 2, 16, 2)
    tokens, parents, depth = table.draft_tree([1, 2], 5, 3, 3)
    assert len(tokens) == 3
    assert table.draft_tree([99], 5, 16, 3) == ([], [], 0)
    assert table.draft_tree([1, 2], 0, 16, 3) == ([], [], 0)


@pytest.mark.parametrize("seed", range(6))
def test_tree_invariants_random(seed):
    rng = random.Random(seed)
    seq = repetitive(rng, 300, vocab=6)
    table = NgramTable(max_n=rng.choice([2, 3, 5]))
    table.add_sequence(seq)
    for _ in range(20):
        history = seq[: rng.randrange(1, len(seq))]
        max_depth, max_nodes, top_k = rng.randrange(1, 8), rng.randrange(1, 25), rng.randrange(1, 4)
        tokens, parents, depth = table.draft_tree(history, max_depth, max_nodes, top_k)
        check_tree(table, history, tokens, parents, depth, max_depth, max_nodes, top_k)
        # a top-1 tree is the chain
        chain = table.draft_chain(history, max_depth)
        assert table.draft_tree(history, max_depth, 64, 1)[0] == chain


def test_tree_respects_evidence_thresholds():
    table = NgramTable(max_n=2)
    table.add_sequence([1, 2, 1, 2, 1, 2, 1, 3])
    assert table.draft_tree([1], 1, 8, 3)[0] == [2, 3]
    assert table.draft_tree([1], 1, 8, 3, min_agreement=0.5)[0] == [2]
    assert table.draft_tree([1], 1, 8, 3, min_count=4)[0] == []


# ---------------------------------------------------------------- memory


def test_eviction_keeps_size_under_cap_least_recently_updated_first():
    rng = random.Random(4)
    seq = [rng.randrange(1000) for _ in range(500)]
    table = NgramTable(max_n=3, max_entries=50)
    for end in range(0, len(seq), 7):
        table.add_sequence(seq[: end + 7], start=end)
        assert len(table) <= 50
    assert table.evictions > 0
    assert (seq[-2],) in table._data and (seq[-3], seq[-2]) in table._data  # the newest stay
    assert (seq[0],) not in table._data  # the oldest went first
    # an update refreshes a context: it survives the next evictions
    table2 = NgramTable(max_n=2, max_entries=3)
    table2.add_sequence([1, 2, 3, 4])  # contexts (1,), (2,), (3,)
    table2.add_sequence([1, 5])  # refreshes (1,)
    table2.add_sequence([6, 7])  # evicts the least recently updated: (2,)
    assert list(table2.contexts()) == [(3,), (1,), (6,)]


# ---------------------------------------------------------------- files


def make_table(seed=5):
    table = NgramTable(max_n=4)
    table.add_sequence(repetitive(random.Random(seed), 200, vocab=9))
    return table


def test_save_load_round_trip(tmp_path):
    table = make_table()
    path = tmp_path / "pool.json"
    table.save(path, model_key="vocab-abc")
    loaded = NgramTable.load(path, model_key="vocab-abc")
    assert snapshot(loaded) == snapshot(table)
    assert (loaded.min_n, loaded.max_n) == (table.min_n, table.max_n)
    rng = random.Random(6)
    for _ in range(20):
        history = [rng.randrange(9) for _ in range(4)]
        assert loaded.draft_chain(history, 7) == table.draft_chain(history, 7)
        assert loaded.draft_tree(history, 4, 10, 3) == table.draft_tree(history, 4, 10, 3)
    more = [3, 1, 4, 1, 5, 9, 2, 6]
    table.add_sequence(more)
    loaded.add_sequence(more)
    assert snapshot(loaded) == snapshot(table)
    assert os.listdir(tmp_path) == ["pool.json"]


def test_load_applies_entry_cap(tmp_path):
    table = make_table()
    table.save(tmp_path / "p", model_key="k")
    small = NgramTable.load(tmp_path / "p", model_key="k", max_entries=10)
    assert len(small) == 10
    assert list(small.contexts()) == list(table.contexts())[-10:]


@pytest.mark.parametrize("target", ["replace", "dumps", "fsync"])
def test_failed_save_leaves_old_file_and_no_temp_files(tmp_path, monkeypatch, target):
    path = tmp_path / "pool.json"
    make_table(1).save(path, model_key="k")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk on fire") if target != "dumps" else RuntimeError("boom")

    if target == "dumps":
        monkeypatch.setattr(poolfile.json, "dumps", boom)
    else:
        monkeypatch.setattr(poolfile.os, target, boom)
    with pytest.raises(PoolFileError if target != "dumps" else RuntimeError):
        make_table(2).save(path, model_key="k")
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["pool.json"]
    NgramTable.load(path, model_key="k")


def test_save_into_missing_directory_is_a_pool_file_error(tmp_path):
    with pytest.raises(PoolFileError):
        make_table().save(tmp_path / "no" / "such" / "dir.json")


def rewrite(path, header_update=None, body=None):
    raw = path.read_bytes()
    nl = raw.index(b"\n")
    header = json.loads(raw[:nl])
    old_body = raw[nl + 1 :]
    if body is not None:
        import hashlib

        header["body_bytes"] = len(body)
        header["body_sha256"] = hashlib.sha256(body).hexdigest()
    header.update(header_update or {})
    path.write_bytes(json.dumps(header).encode() + b"\n" + (old_body if body is None else body))


BAD_FILES = {
    "empty": lambda p: p.write_bytes(b""),
    "text": lambda p: p.write_text("hello world\nnot a pool\n"),
    "plain_json": lambda p: p.write_text('{"entries": []}'),
    "other_format": lambda p: rewrite(p, {"format": "something-else"}),
    "new_version": lambda p: rewrite(p, {"version": 99}),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "truncated_header": lambda p: p.write_bytes(p.read_bytes()[:30]),
    "flipped_byte": lambda p: p.write_bytes(
        p.read_bytes()[:-5] + bytes([p.read_bytes()[-5] ^ 1]) + p.read_bytes()[-4:]
    ),
    "bad_levels": lambda p: rewrite(p, {"min_n": 1}),
    "bad_structure": lambda p: rewrite(p, body=b'{"clock": 3, "entries": [[[1], [[2, 0, 1]]]]}'),
    "bad_context_len": lambda p: rewrite(p, body=b'{"clock": 3, "entries": [[[1,2,3,4,5], []]]}'),
    "not_json_body": lambda p: rewrite(p, body=b"\x80\x81 nope"),
    "stamp_from_future": lambda p: rewrite(p, body=b'{"clock": 1, "entries": [[[1], [[2, 1, 5]]]]}'),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_files_are_refused(tmp_path, kind):
    path = tmp_path / "pool.json"
    make_table().save(path, model_key="k")
    NgramTable.load(path, model_key="k")  # fine before the damage
    BAD_FILES[kind](path)
    with pytest.raises(PoolFileError):
        NgramTable.load(path, model_key="k")


def test_valid_handmade_body_loads(tmp_path):
    # the "bad_structure" style edits above only fail because of their contents
    path = tmp_path / "pool.json"
    make_table().save(path, model_key="k")
    rewrite(path, body=b'{"clock": 3, "entries": [[[1], [[2, 1, 0], [3, 1, 2]]]]}')
    table = NgramTable.load(path, model_key="k")
    assert table.predict([1]) == 3 and table.continuations([1]) == [(3, 1), (2, 1)]


def test_foreign_model_key_and_missing_file_are_refused(tmp_path):
    path = tmp_path / "pool.json"
    make_table().save(path, model_key="llama-vocab")
    with pytest.raises(PoolFileError, match="model_key"):
        NgramTable.load(path, model_key="qwen-vocab")
    with pytest.raises(PoolFileError):
        NgramTable.load(tmp_path / "missing.json", model_key="llama-vocab")


def test_benchmark_helper_runs(capsys):
    nt._benchmark(n_tokens=300)
    out = capsys.readouterr().out
    assert "us per propose+update" in out and "chain" in out and "tree" in out
