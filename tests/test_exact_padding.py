"""A batch's padding nodes (``ModelRunner.forward_rows``): a row whose tree is smaller than the step's
largest is padded with nodes that see only themselves (docs/batching.md), so that in exact mode they
are cheap short queries rather than one attention call each per layer over the row's whole cache, and
the rows' outputs stay the same bits as each tree's alone."""

import pytest
import torch

from speculum import cache as cache_ops
from speculum import exact, exact_attention
from speculum.runner import ModelRunner
from speculum.tree import TokenTree

from tiny_models import repetitive_prompt, tiny_model

BIG_TREE = TokenTree([5, 9, 11, 13, 17, 19, 23, 29], [-1, 0, 0, 1, 1, 2, 3, 3])  # the step's largest


def batch(runner: ModelRunner, prompts: list[list[int]]):
    """Each prompt but its last token prefilled alone and joined into one batch cache (the engine's layout)."""
    cache = runner.new_cache()
    for r, prompt in enumerate(prompts):
        row = runner.new_cache()
        runner.prefill(row, prompt[:-1])
        cache_ops.join(cache, r, row)
    return cache, [len(p) - 1 for p in prompts]


def rows_of(prompts: list[list[int]]) -> list[TokenTree]:
    """Row 0 verifies the big tree, the others take plain steps (one node: their last token)."""
    return [BIG_TREE] + [TokenTree([p[-1]], [-1]) for p in prompts[1:]]


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Which keys an additive ``[rows, 1, n, keys]`` mask lets each query see."""
    return mask[:, 0] > torch.finfo(mask.dtype).min / 2


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_padding_nodes_see_only_themselves(monkeypatch, arch):
    """In every layer kind's mask (sliding windows included), a padding node sees its own column and
    nothing else, while a real node still sees its row's cache and its ancestors."""
    runner = ModelRunner(tiny_model(arch))
    prompts = [repetitive_prompt(n, 5, n) for n in (30, 12, 25)]
    cache, lengths = batch(runner, prompts)
    columns = cache_ops.cache_length(cache)
    masks = []
    build = runner.attention_mask
    monkeypatch.setattr(runner, "attention_mask", lambda *a: masks.append(build(*a)) or masks[-1])
    trees = rows_of(prompts)
    runner.forward_rows(cache, trees, lengths)
    kinds = masks[0] if isinstance(masks[0], dict) else {"all": masks[0]}
    n = len(BIG_TREE)
    for kind, mask in kinds.items():
        seen = visible(mask)
        assert seen.shape == (len(trees), n, columns + n), kind
        assert seen.any(-1).all(), kind  # no query sees nothing (a NaN in SDPA)
        for r, tree in enumerate(trees):
            for j in range(len(tree), n):
                assert seen[r, j].nonzero()[:, 0].tolist() == [columns + j], (kind, r, j)
            assert seen[r, 0, lengths[r] - 1], (kind, r)  # a root sees the last cached key of its row


def test_exact_padding_nodes_take_no_attention_call_of_their_own(monkeypatch):
    """Past SHORT_KEYS positions, exact attention makes one call per query that sees its row's
    cache: in a batch of one 8-node tree and three plain rows, that is the tree's 8 nodes and the
    plain rows' roots, not the 7 padding nodes of each plain row."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    exact.make_exact(model)
    runner = ModelRunner(model)
    prompts = [repetitive_prompt(n, 7, n) for n in (530, 560, 545, 600)]  # every row past 512 keys
    cache, lengths = batch(runner, prompts)
    assert min(lengths) > exact_attention.SHORT_KEYS
    calls = []
    one_query_calls = exact_attention._one_query_calls
    monkeypatch.setattr(
        exact_attention,
        "_one_query_calls",
        lambda out, plan, *a: calls.append(sorted(plan.long)) or one_query_calls(out, plan, *a),
    )
    runner.forward_rows(cache, rows_of(prompts), lengths)
    expected = [(0, j) for j in range(len(BIG_TREE))] + [(r, 0) for r in range(1, len(prompts))]
    assert calls == [expected] * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_batched_rows_equal_each_tree_alone_past_the_float64_line(monkeypatch, arch):
    """Each row's logits in the batched forward are the same bits as its tree's in a forward of its
    own, on both sides of SHORT_KEYS (lowered so the tiny rows cross it), with sliding windows, and
    with a row whose cache is empty."""
    monkeypatch.setattr(exact_attention, "SHORT_KEYS", 24)
    model = tiny_model(arch, dtype=torch.bfloat16)
    exact.make_exact(model)
    runner = ModelRunner(model, lazy_head=False)
    prompts = [repetitive_prompt(40, 5, 0), repetitive_prompt(12, 4, 1), [7], repetitive_prompt(33, 6, 2)]
    cache, lengths = batch(runner, prompts)
    trees = rows_of(prompts)
    batched = runner.forward_rows(cache, trees, lengths)
    for r, (prompt, tree) in enumerate(zip(prompts, trees, strict=True)):
        alone = runner.new_cache()
        runner.prefill(alone, prompt[:-1])
        logits = runner.forward(alone, tree).logits
        assert torch.isfinite(batched[r].logits).all(), r
        assert torch.equal(batched[r].logits, logits), r
