"""Cache ops: the one module that edits the target's KV cache between steps.

Works on transformers' own ``DynamicCache``. The cache is created *without* a model config so
that every layer, including Gemma 3's sliding-window layers, keeps its full history: rolling
back a rejected draft needs the rows a sliding window would already have dropped. The sliding
window itself is then enforced by the attention mask (see ``engine.TargetRunner``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions."""
    excess = cache_length(cache) - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if excess:
        cache.crop(-excess)  # transformers 5.x: a negative count removes that many positions


@torch.inference_mode()
def keep_path(cache: DynamicCache, past_length: int, nodes: list[int]) -> None:
    """After a tree forward, keep the rows of ``nodes`` (tree indices, ascending) after the prefix.

    The tree's rows start at ``past_length``. A chain's accepted nodes are a prefix of the tree,
    so cropping is enough; otherwise the accepted rows are gathered into place first. Their keys
    were computed with the positions they keep (``past_length + depth``), so no re-rotation is
    needed.
    """
    if nodes == list(range(len(nodes))):
        crop(cache, past_length + len(nodes))
        return
    index = torch.tensor(nodes, dtype=torch.long) + past_length
    for layer in cache.layers:
        for name in ("keys", "values"):
            rows = getattr(layer, name)
            gathered = rows.index_select(-2, index.to(rows.device))
            rows[..., past_length : past_length + len(nodes), :] = gathered
    crop(cache, past_length + len(nodes))
