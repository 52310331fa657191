"""TokenTree masks/positions, tree forward vs per-path forwards, cache crop and keep-path."""

import pytest
import torch

from speculum import cache as cache_ops
from speculum.drafters.base import Draft
from speculum.engine import TargetRunner
from speculum.tree import TokenTree

from tiny_models import ARCHS, VOCAB, tiny_model


def sample_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    return TokenTree([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])


def test_depth_children_paths():
    tree = sample_tree()
    assert tree.depth == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children[1] == [3, 4]
    assert tree.paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert tree.position_ids(100).tolist() == [100, 101, 101, 102, 102, 102, 103]
    assert not tree.is_chain
    assert TokenTree.from_draft(5, Draft.chain([1, 2, 3])).is_chain


def test_ancestor_mask():
    mask = sample_tree().ancestor_mask
    assert mask[6].tolist() == [True, True, False, True, False, False, True]
    assert mask[5].tolist() == [True, False, True, False, False, True, False]
    assert mask.diagonal().all()
    assert not mask.triu(1).any()  # parents come before children


def test_bad_trees_refused():
    with pytest.raises(ValueError):
        TokenTree([1, 2], [-1, 1])  # a node cannot be its own parent
    with pytest.raises(ValueError):
        TokenTree.from_draft(1, Draft([5, 5], [-1, -1]))  # repeated siblings of a deterministic draft


def test_draft_truncated():
    draft = Draft([1, 2, 3, 4], [-1, 0, 1, -1])
    cut = draft.truncated(2)
    assert cut.tokens == [1, 2, 4] and cut.parents == [-1, 0, -1]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_each_path(arch):
    """One tree forward gives, at every node, the logits of running that node's path on its own."""
    model = tiny_model(arch)
    runner = TargetRunner(model)
    prefix = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = sample_tree()
    tree_cache = cache_ops.new_cache()
    runner.prefill(tree_cache, prefix)
    tree_logits = runner.forward(tree_cache, tree)
    for path in tree.paths():
        with torch.no_grad():
            out = model(torch.tensor([prefix + [tree.tokens[i] for i in path]]))
        torch.testing.assert_close(tree_logits[path], out.logits[0, len(prefix) :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_keep_path_equals_recompute(arch):
    """After keeping one path of a tree, the cache equals a cache built from scratch on prefix + path."""
    model = tiny_model(arch)
    runner = TargetRunner(model)
    prefix = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    tree = sample_tree()
    for path in tree.paths():
        cache = cache_ops.new_cache()
        runner.prefill(cache, prefix)
        runner.forward(cache, tree)
        cache_ops.keep_path(cache, len(prefix), path)
        fresh = cache_ops.new_cache()
        runner.prefill(fresh, prefix + [tree.tokens[i] for i in path] + [0])  # prefill skips nothing: add a dummy
        cache_ops.crop(fresh, len(prefix) + len(path))
        assert cache_ops.cache_length(cache) == len(prefix) + len(path)
        for kept, ref in zip(cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)


def test_crop():
    model = tiny_model("qwen2")
    runner = TargetRunner(model)
    cache = cache_ops.new_cache()
    runner.prefill(cache, list(range(3, 20)))
    assert cache_ops.cache_length(cache) == 17
    cache_ops.crop(cache, 10)
    assert cache_ops.cache_length(cache) == 10
    with pytest.raises(ValueError):
        cache_ops.crop(cache, 11)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_lazy_head_rows_equal_full_logits(arch):
    model = tiny_model(arch)
    prefix = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    full_runner, lazy_runner = TargetRunner(model, lazy_head=False), TargetRunner(model, lazy_head=True)
    full_cache, lazy_cache = cache_ops.new_cache(), cache_ops.new_cache()
    full_runner.prefill(full_cache, prefix)
    lazy_runner.prefill(lazy_cache, prefix)
    tree = sample_tree()
    full = full_runner.forward(full_cache, tree)
    lazy = lazy_runner.forward(lazy_cache, tree)
    assert not isinstance(lazy, torch.Tensor)
    for node in range(len(tree)):
        torch.testing.assert_close(lazy[node], full[node], atol=1e-5, rtol=1e-5)


def test_lazy_head_auto_only_for_half_precision_cpu():
    assert not TargetRunner(tiny_model("llama")).lazy_head
    assert TargetRunner(tiny_model("llama", dtype=torch.bfloat16)).lazy_head
    assert not TargetRunner(tiny_model("gpt2", dtype=torch.bfloat16)).lazy_head  # not a known plain-head model
