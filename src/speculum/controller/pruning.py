"""Which draft nodes to verify: each node's chance of being reached and accepted, and the keep-masks
that make the most committed tokens per second of it. Pure functions of what the controller knows
(:meth:`Controller.plan <speculum.controller.Controller.plan>` calls them), and the :class:`Plan`
they make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculum.controller.calibration import Calibration
from speculum.tree import Draft

EXPLORE_EVIDENCE = 8.0  # samples a bin needs before pruning its nodes is trusted without exploring


@dataclass
class Plan:
    """What the controller decided for one round."""

    keep: list[bool] | None  # per draft node; None: verify everything proposed
    expected_tokens: float  # committed tokens expected (bonus included)
    predicted_seconds: float  # the round's predicted verification time
    pruned: int = 0  # draft nodes within reach of the tokens left that it chose not to verify
    explored: bool = False  # verified whole to learn of nodes that pruning would have dropped


def node_reach(
    calibration: Calibration, draft: Draft, bins: tuple, max_depth: int, optimistic: bool = False
) -> list[float]:
    """P(node reached and accepted) for every node of ``draft``: the product of the calibrated
    chances along its path (``bins``: each node's depth, depth within its source's run, score and
    calibration label). Siblings are exclusive (at most one is accepted), so where their chances
    add up to more than one they are scaled down to one; nodes deeper than ``max_depth`` have none."""
    depths, runs, scores, labels = bins
    reach = [0.0] * len(draft)
    by_parent: dict[int, list[int]] = {}
    for i, parent in enumerate(draft.parents):
        by_parent.setdefault(parent, []).append(i)
    for parent, children in by_parent.items():  # parents before children: reach[parent] is final
        above = 1.0 if parent < 0 else reach[parent]
        chances = [calibration.estimate(scores[c], runs[c], labels[c], optimistic=optimistic)
                   if depths[c] <= max_depth else 0.0 for c in children]  # fmt: skip
        total = sum(chances)
        scale = 1.0 / total if total > 1.0 else 1.0  # siblings are exclusive: at most one is accepted
        for child, chance in zip(children, chances, strict=True):
            reach[child] = above * chance * scale
    return reach


def whole_nodes(draft: Draft, whole_sources: frozenset[str], depths: list[int], max_depth: int) -> list[bool]:
    """The nodes kept as proposed: a node of ``whole_sources`` below the root or below another one."""
    whole = [False] * len(draft)
    if whole_sources and draft.sources is not None:
        sources = draft.sources
        for i, parent in enumerate(draft.parents):
            whole[i] = sources[i] in whole_sources and depths[i] <= max_depth and (parent < 0 or whole[parent])
    return whole


def best_prefix_keep(
    reach: list[float],
    depths: list[int],
    whole: list[bool],
    cost: Callable[[int], float],
    base_tokens: float,
    spent: float,
) -> list[bool]:
    """Deterministic drafts: the ``whole`` nodes, then the prefix of the other nodes, most likely
    first, with the best expected tokens per second (``base_tokens``: what the round commits
    without a draft, the other rows' included; ``spent``: its seconds beyond the forward). Reach
    never grows along a path, so every prefix of that order (ties broken by depth, then draft
    order) holds each node's parent."""
    fixed = sum(whole)
    order = sorted(
        (i for i in range(len(reach)) if reach[i] > 0 and not whole[i]), key=lambda i: (-reach[i], depths[i], i)
    )
    gained = sum(r for r, w in zip(reach, whole, strict=True) if w)
    best_m, best_value = 0, (base_tokens + gained) / (cost(fixed + 1) + spent)
    for m, node in enumerate(order, start=1):
        gained += reach[node]
        value = (base_tokens + gained) / (cost(fixed + m + 1) + spent)
        if value > best_value:
            best_m, best_value = m, value
    keep = list(whole)
    for node in order[:best_m]:
        keep[node] = True
    return keep


def threshold_keep(
    draft: Draft, reach: list[float], depths: list[int], max_depth: int, whole: list[bool], threshold: float
) -> list[bool]:
    """Drafts with sampled nodes: each node kept when its parent is and its ``reach`` beats
    ``threshold``, which must come from what was known before the round (see
    :meth:`Controller._local_keep <speculum.controller.Controller._local_keep>`)."""
    keep = [False] * len(draft)
    for i, parent in enumerate(draft.parents):
        above = parent < 0 or keep[parent]
        keep[i] = whole[i] or (above and depths[i] <= max_depth and reach[i] > threshold)
    return keep


def has_unexplored_frontier(
    calibration: Calibration, draft: Draft, keep: list[bool], bins: tuple, max_depth: int
) -> bool:
    """Whether a node that pruning dropped, below a kept one (or the root), has a bin holding less
    than ``EXPLORE_EVIDENCE`` samples. Only the frontier of what pruning kept counts: a node below a
    dropped one is learnt of once its parent is (a node is calibrated only when its parent was
    accepted), so a phrase the target never takes costs exploring its first node's bin, not a whole
    tree every so often for ever. Only bins decide, never a node's token (sampled drafts stay exact)."""
    depths, runs, scores, labels = bins
    return any(
        not keep[i] and depths[i] <= max_depth and (parent < 0 or keep[parent])
        and calibration.evidence(scores[i], runs[i], labels[i]) < EXPLORE_EVIDENCE
        for i, parent in enumerate(draft.parents)
    )  # fmt: skip
