"""TokenTree: the one shape every draft takes (a chain is a tree with one child per node).

Node 0 is the root: the last committed token, whose key/values are not in the cache yet. Each
other node is a draft token below its parent. From the parallel arrays ``tokens``/``parents``
come everything the target forward and the verifier need: depths (position ids), the ancestor
matrix (attention mask), children lists and root-to-leaf paths.
"""

from __future__ import annotations

from functools import cached_property

import torch

from speculum.drafters.base import Draft


class TokenTree:
    def __init__(self, tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None = None):
        if not tokens or parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents must have the same length")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
        self.tokens = list(tokens)
        self.parents = list(parents)
        # draft_probs[i] is the distribution node i's token was sampled from (stochastic drafts);
        # row 0 (the root) is unused.
        self.draft_probs = draft_probs

    @classmethod
    def from_draft(cls, root_token: int, draft: Draft | None) -> TokenTree:
        if draft is None or len(draft) == 0:
            return cls([root_token], [-1])
        parents = [-1] + [p + 1 for p in draft.parents]  # shift: draft index -1 is the root (0)
        probs = None
        if draft.probs is not None:
            probs = torch.cat([draft.probs[:1] * 0, draft.probs], dim=0)
        tree = cls([root_token, *draft.tokens], parents, probs)
        for node, kids in enumerate(tree.children):
            toks = [tree.tokens[k] for k in kids]
            if probs is None and len(set(toks)) != len(toks):
                raise ValueError(f"node {node} has repeated child tokens {toks}; merge them in the drafter")
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depth(self) -> list[int]:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[n, n]`` bool: entry (i, j) is True when node j is node i itself or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]  # parents come first, so their row is complete
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self.children) if not kids]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def position_ids(self, past_length: int) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long) + past_length
