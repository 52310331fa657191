"""The verifier: the only place where acceptance is decided.

Given a TokenTree and the target's logits at every node (row i predicts the token after node i),
walk down from the root and return the accepted path plus one token from the target (the bonus
token after a fully accepted path, or the correction at the first rejection).

Three rules, all lossless:
- greedy: follow the child whose token equals the target's argmax;
- sampling, deterministic draft: sample y from the warped target distribution at the current
  node and follow the child holding y (equivalent to rejection sampling with a one-hot draft);
- sampling, stochastic draft: try each child x (an i.i.d. sample of the draft's q) with
  probability min(1, p(x)/q(x)); after a rejection continue with p <- norm(max(p - q, 0)).
  For a chain this is Leviathan/Chen speculative sampling; for a tree it is SpecInfer's
  multi-candidate rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum.sampling import SamplingParams, sample, warp
from speculum.tree import TokenTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting with the root (0)
    next_token: int  # the target's token after the last accepted node

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify(
    tree: TokenTree,
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    if sampling.greedy:
        return _verify_greedy(tree, logits)
    if tree.draft_probs is None:
        return _verify_sampled_deterministic(tree, logits, sampling, generator)
    return _verify_sampled_stochastic(tree, logits, sampling, generator)


def _child_with_token(tree: TokenTree, node: int, token: int) -> int | None:
    for child in tree.children[node]:
        if tree.tokens[child] == token:
            return child
    return None


def _verify_greedy(tree: TokenTree, logits) -> Verdict:
    if isinstance(logits, torch.Tensor):
        best = logits.argmax(dim=-1).tolist()  # one batched argmax when all rows exist anyway
    else:
        best = _LazyArgmax(logits)  # rows computed only along the walked path
    path = [0]
    while True:
        child = _child_with_token(tree, path[-1], best[path[-1]])
        if child is None:
            return Verdict(path, best[path[-1]])
        path.append(child)


class _LazyArgmax:
    def __init__(self, logits):
        self.logits = logits

    def __getitem__(self, node: int) -> int:
        return int(self.logits[node].argmax())


def _verify_sampled_deterministic(
    tree: TokenTree, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    path = [0]
    while True:
        token = sample(warp(logits[path[-1]], sampling)[0], generator)
        child = _child_with_token(tree, path[-1], token)
        if child is None:
            return Verdict(path, token)
        path.append(child)


def _verify_sampled_stochastic(
    tree: TokenTree, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    path = [0]
    while True:
        node = path[-1]
        p = warp(logits[node], sampling)[0]
        accepted = None
        for child in tree.children[node]:
            q = tree.draft_probs[child].to(p.device, torch.float32)
            x = tree.tokens[child]
            u = torch.rand((), generator=generator, device=p.device).item()
            if u * q[x].item() < p[x].item():  # u < p(x)/q(x) without dividing by zero
                accepted = child
                break
            residual = torch.clamp(p - q, min=0)
            total = residual.sum()
            if total.item() > 0:  # p == q leaves nothing, but then x was accepted with prob. 1
                p = residual / total
        if accepted is None:
            return Verdict(path, sample(p, generator))
        path.append(accepted)
