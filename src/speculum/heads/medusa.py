"""Medusa-1 heads (Cai et al. 2024): K heads on the frozen target, head k guessing the token k
places after the next one from the target's last hidden state alone.

Each head is a residual block ``x + SiLU(Linear(x))`` (zero-initialised, so an untrained head
starts as the target's own LM head) followed by the projection. Medusa gives every head its own
``Linear(H, vocab)`` initialised from the LM head; here every head shares the target's frozen LM
head over a draft vocabulary (:mod:`speculum.heads.projection`): on a CPU a 262k-token projection
per head would cost more than the draft saves, and K copies of it would not ship.

In the loop, the root of the draft tree is the target's own token after position t-1 (already
known); head k (1-based) reads the hidden state at t-1 and guesses the token at t+k.
"""

from __future__ import annotations

import heapq

import torch
from torch import nn

from speculum.heads.projection import DraftVocabProjection


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, draft_vocab: torch.Tensor, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"bad Medusa shape: num_heads={num_heads}, num_layers={num_layers}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        for block in self.modules():
            if isinstance(block, ResBlock):  # start as the target's own head (Medusa's init)
                nn.init.zeros_(block.linear.weight)
                nn.init.zeros_(block.linear.bias)
        self.projection = DraftVocabProjection(draft_vocab, hidden_size)

    def shape(self) -> dict:
        """Constructor arguments besides the draft vocabulary (saved in the checkpoint's config)."""
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads, "num_layers": self.num_layers}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]`` -> logits ``[..., num_heads, len(draft_vocab)]``."""
        x = hidden.to(self.heads[0][0].linear.weight.dtype)
        states = torch.stack([head(x) for head in self.heads], dim=-2)
        return self.projection(states)


def sparse_tree(accuracy: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree (its Appendix C): the ``nodes`` choice paths with the highest expected
    acceptance, a path ``(c1, ..., cd)`` (take head i's ``ci``-th most likely token at depth i)
    scoring the product of the heads' measured top-``ci`` hit rates ``accuracy[i][ci]``. Children
    score no more than their parent, so the result is prefix-closed; it comes best first."""
    heap = [(-accuracy[0][c], (c,)) for c in range(len(accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        negative, path = heapq.heappop(heap)
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for c in range(len(accuracy[depth])):
                heapq.heappush(heap, (negative * accuracy[depth][c], (*path, c)))
    return chosen
