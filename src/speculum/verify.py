"""The verifier: the only place where acceptance is decided.

Given a TokenTree and the target's logits at every node (row i predicts the token after node i),
walk down from the root and return the accepted path plus one token from the target (the bonus
token after a fully accepted path, or the correction at the first rejection).

Rules, all lossless:
- greedy: follow the child whose token equals the target's argmax;
- sampling, every child of the current node deterministic (n-gram, phrases, heads): sample y from
  the warped target distribution p and follow the child holding y (equivalent to rejection
  sampling with one-hot drafts);
- sampling, some child sampled from a draft distribution q: try the children in order, accepting
  child x with probability min(1, p(x)/q(x)); after a rejection p <- norm(max(p - q, 0)). A
  deterministic child is the same rule with a one-hot q (accept with p(x), then zero p(x)). For a
  chain this is Leviathan/Chen speculative sampling; for a tree, SpecInfer's multi-candidate rule,
  which stays exact for any mix as long as each child was drawn independently of its siblings;
- sampling with a seed (``PositionNoise``): the target's token at each node is the one the noise of
  that position picks from p, whatever the tree holds; follow the child holding it. The text is
  then plain sampling's with the same seed, for every method and every controller decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum.sampling import PositionNoise, SamplingParams, sample, warp
from speculum.tree import TokenTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting with the root (0)
    next_token: int  # the target's token after the last accepted node
    argmax: list[int] | None = None  # the target's argmax at every node, when the verifier computed it

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify(
    tree: TokenTree,
    logits,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    noise: PositionNoise | None = None,
    position: int = 0,
) -> Verdict:
    """``noise``: a seeded request's, with ``position`` the generated position of the token after
    the root (tokens generated so far)."""
    if sampling.greedy:
        return _verify_greedy(tree, logits)
    if noise is not None:
        return _verify_coupled(tree, logits, sampling, noise, position)
    return _verify_sampled(tree, logits, sampling, generator)


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
            return Verdict(path, best[path[-1]], best if isinstance(best, list) else None)
        path.append(child)


class _LazyArgmax:
    def __init__(self, logits):
        self.logits = logits

    def __getitem__(self, node: int) -> int:
        return int(self.logits[node].argmax())


def _verify_coupled(tree: TokenTree, logits, sampling: SamplingParams, noise: PositionNoise, position: int) -> Verdict:
    path = [0]
    while True:
        token = noise.choose(warp(logits[path[-1]], sampling)[0], position + len(path) - 1)
        child = _child_with_token(tree, path[-1], token)
        if child is None:
            return Verdict(path, token)
        path.append(child)


def _verify_sampled(tree: TokenTree, logits, sampling: SamplingParams, generator: torch.Generator | None) -> Verdict:
    path = [0]
    while True:
        node = path[-1]
        p = warp(logits[node], sampling)[0]
        children = tree.children[node]
        if all(tree.q(child) is None for child in children):
            token = sample(p, generator)
            child = _child_with_token(tree, node, token)
            if child is None:
                return Verdict(path, token)
            path.append(child)
            continue
        accepted = None
        for child in children:
            x, q = tree.tokens[child], tree.q(child)
            u = torch.rand((), generator=generator, device=p.device)
            if q is None:  # one-hot draft
                if (u < p[x]).item():
                    accepted = child
                    break
                p = p.clone()
                p[x] = 0.0  # p(x) < 1 here (u < 1), so something is left
                p = p / p.sum()
            else:
                q = q.to(p.device, torch.float32)
                if (u * q[x] < p[x]).item():  # u < p(x)/q(x) without dividing by zero
                    accepted = child
                    break
                residual = torch.clamp(p - q, min=0)
                total = residual.sum()
                # p == q leaves nothing, but then x was accepted with probability 1: keep p as is
                p = torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)
        if accepted is None:
            return Verdict(path, sample(p, generator))
        path.append(accepted)
