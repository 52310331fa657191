"""TokenTree masks/positions, tree forward vs per-path forwards, cache crop and keep-path."""

import pytest
import torch

from speculum import cache as cache_ops
from speculum.runner import ModelRunner
from speculum.tree import Draft, TokenTree

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
        Draft([5, 6], [-1, 1])  # a draft node cannot hang below itself
    with pytest.raises(ValueError):
        Draft([5, 6], [-1, 0], probs=torch.ones(1, 4))  # one distribution per node


def test_repeated_siblings_merged_and_indices_kept():
    """Two phrases sharing a prefix (``7 8 9`` and ``7 8 5``) and a repeated guess (``7``) become one
    tree; whatever path is accepted is reported in the drafter's own numbering."""
    draft = Draft([7, 8, 9, 7, 8, 5, 7], [-1, 0, 1, -1, 3, 4, -1])
    tree = TokenTree.from_draft(1, draft)
    assert tree.tokens == [1, 7, 8, 9, 5] and tree.parents == [-1, 0, 1, 2, 2]
    assert tree.node_of == [1, 2, 3, 1, 2, 4, 1]
    assert tree.draft_path([0, 1, 2, 4], draft) == [3, 4, 5]  # the second phrase, end to end
    assert tree.draft_path([0, 1, 2, 3], draft) == [0, 1, 2]
    assert tree.draft_path([0, 1], draft) == [0]
    assert tree.draft_path([0], draft) == []
    # sampled siblings are independent draws: equal tokens are kept apart (SpecInfer)
    q = torch.full((4,), 0.25)
    sampled = TokenTree.from_draft(1, Draft([2, 2], [-1, -1], [q, q]))
    assert sampled.tokens == [1, 2, 2]
    # a deterministic sibling after a sampled one with its token merges into it (once the verifier
    # rejects the sampled 2, the residual has no mass on 2), its subtree hanging below
    mixed = TokenTree.from_draft(1, Draft([2, 2, 2, 3], [-1, -1, -1, 2], [q, None, None, None]))
    assert mixed.tokens == [1, 2, 3] and mixed.parents == [-1, 0, 1] and mixed.q(1) is q
    assert mixed.node_of == [1, 1, 1, 2] and mixed.q(2) is None
    # before it, the deterministic one is tried first and stays apart
    first = TokenTree.from_draft(1, Draft([2, 2], [-1, -1], [None, q]))
    assert first.tokens == [1, 2, 2] and first.q(1) is None and first.q(2) is q


def test_tree_truncated_keeps_draft_indices():
    draft = Draft([1, 2, 3, 4], [-1, 0, 1, -1])
    tree = TokenTree.from_draft(9, draft, max_depth=2)
    assert tree.tokens == [9, 1, 2, 4] and tree.parents == [-1, 0, 1, 0]
    assert tree.source == [-1, 0, 1, 3] and tree.node_of == [1, 2, -1, 3]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_each_path(arch):
    """One tree forward gives, at every node, the logits of running that node's path on its own."""
    model = tiny_model(arch)
    runner = ModelRunner(model)
    prefix = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = sample_tree()
    tree_cache = cache_ops.new_cache()
    runner.prefill(tree_cache, prefix)
    tree_logits = runner.forward(tree_cache, tree).logits
    for path in tree.paths():
        with torch.no_grad():
            out = model(torch.tensor([prefix + [tree.tokens[i] for i in path]], device=model.device))
        torch.testing.assert_close(tree_logits[path], out.logits[0, len(prefix) :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@pytest.mark.parametrize("prefix_length", [2, 5, 9, 30])
def test_tree_logits_respect_sliding_windows(arch, prefix_length):
    """Around and far past the window (6), every layer attends exactly as the modeling code does:
    Gemma 3 per layer type, Mistral (no layer_types) on every layer."""
    model = tiny_model(arch)
    runner = ModelRunner(model)
    prefix = torch.randint(3, VOCAB, (prefix_length,), generator=torch.Generator().manual_seed(5)).tolist()
    tree = sample_tree()
    cache = cache_ops.new_cache()
    runner.prefill(cache, prefix)
    logits = runner.forward(cache, tree).logits
    for path in tree.paths():
        with torch.no_grad():
            out = model(torch.tensor([prefix + [tree.tokens[i] for i in path]], device=model.device))
        torch.testing.assert_close(logits[path], out.logits[0, len(prefix) :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_keep_path_equals_recompute(arch):
    """After keeping one path of a tree, the cache equals a cache built from scratch on prefix + path."""
    model = tiny_model(arch)
    runner = ModelRunner(model)
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
    runner = ModelRunner(model)
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
    full_runner, lazy_runner = ModelRunner(model, lazy_head=False), ModelRunner(model, lazy_head=True)
    full_cache, lazy_cache = cache_ops.new_cache(), cache_ops.new_cache()
    full_runner.prefill(full_cache, prefix)
    lazy_runner.prefill(lazy_cache, prefix)
    tree = sample_tree()
    full = full_runner.forward(full_cache, tree).logits
    lazy = lazy_runner.forward(lazy_cache, tree).logits
    assert not isinstance(lazy, torch.Tensor)
    for node in range(len(tree)):
        torch.testing.assert_close(lazy[node], full[node], atol=1e-5, rtol=1e-5)


def test_from_draft_keeps_at_most_max_nodes_and_stays_a_tree():
    draft = Draft([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 3, -1])
    tree = TokenTree.from_draft(1, draft, max_nodes=3)
    assert tree.tokens == [1, 5, 6, 7] and tree.parents == [-1, 0, 1, 1]
    assert tree.node_of == [1, 2, 3, -1, -1, -1]  # the rest: not verified


class _HugeTreeDrafter:
    """Proposes far more nodes than one forward may verify: the right chain first, then junk."""

    name = "huge"
    wants_hidden_states = False
    forwards = 0

    def __init__(self, truth, nodes):
        self.truth, self.nodes = truth, nodes

    def check(self, sampling):
        pass

    def start(self, ctx):
        self.prompt_length = ctx.prompt_length

    def propose(self, ctx):
        done = len(ctx.tokens) - self.prompt_length
        right = self.truth[done : done + 4]
        tokens, parents = list(right), list(range(-1, len(right) - 1))
        for first in range(VOCAB):  # then a wide junk tree two deep (distinct siblings: nothing merges)
            tokens.append(first)
            parents.append(-1)
            parent = len(tokens) - 1
            for second in range(VOCAB):
                tokens.append(second)
                parents.append(parent)
        return Draft(tokens[: self.nodes], parents[: self.nodes])

    def observe(self, ctx, outcome):
        self.largest = max(getattr(self, "largest", 0), outcome.drafted)

    def finish(self, ctx):
        pass


def test_the_engine_verifies_at_most_max_draft_nodes():
    """Whatever a drafter proposes, one forward verifies at most MAX_DRAFT_NODES draft nodes (the
    rest is dropped, which is lossless)."""
    from speculum.tree import MAX_DRAFT_NODES

    from helpers import generate_ids
    from tiny_models import reference_greedy

    model = tiny_model("llama")
    prompt = [3, 4, 5, 6]
    truth = reference_greedy(model, prompt, 12)
    drafter = _HugeTreeDrafter(truth, MAX_DRAFT_NODES + 500)
    out, stats = generate_ids(model, prompt, drafter, 12)
    assert out == truth
    assert max(stats.draft_sizes) == MAX_DRAFT_NODES and stats.accepted_tokens > 0
