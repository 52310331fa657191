"""``auto``'s merged draft: several drafters' proposals as one token tree, and the step as each
drafter would have seen it had it drafted alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculum.drafters.base import Draft, Drafter, Outcome

__all__ = ["Part", "merge", "outcome_for"]


@dataclass
class Part:
    """One drafter inside ``auto``: its proposal this round and where its nodes went in the merge."""

    name: str
    drafter: Drafter
    draft: Draft | None = None
    nodes: list[int] = field(default_factory=list)  # index in the merged draft of each of this draft's nodes


def merge(parts: list[Part]) -> Draft | None:
    """One draft of every part's, in the order of ``parts`` (siblings are tried in that order at
    T > 0). A deterministic node (n-gram, heads) becomes one with an earlier node holding its token
    below the same parent; sampled branches stay apart (each is an independent sample, which the
    verifier's multi-candidate rule needs); every node remembers its drafter (``Draft.sources``).
    Sets each part's ``nodes``."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[torch.Tensor | None] = []
    scores: list[float | None] = []
    sources: list[str] = []
    first: dict[tuple[int, int], int] = {}  # (merged parent, token) -> the first merged node holding it
    for part in parts:
        part.nodes = []
        draft = part.draft
        if draft is None:
            continue
        # a part that says which of its sources to verify whole (Ouroboros: its chain, labelled
        # the draft model's; its phrases apart) keeps its own labels; the others get their name
        labels = draft.sources if part.drafter.whole_sources and draft.sources is not None else None
        for j, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
            above = -1 if parent < 0 else part.nodes[parent]
            q = draft.q(j)
            # a deterministic node may join a sampled one (see ``Draft``): exact in ``auto``, where
            # the draft model is the only sampled drafter and its chain is verified whole, so no
            # sampled node's verification depends on its own token or on a later sibling's
            node = first.get((above, token)) if q is None else None
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(above)
                probs.append(q)
                scores.append(draft.scores[j] if draft.scores is not None else None)
                sources.append(labels[j] if labels is not None else part.name)
                first.setdefault((above, token), node)
            part.nodes.append(node)
    if not tokens:
        return None
    sampled = any(q is not None for q in probs)
    return Draft(tokens, parents, probs if sampled else None, scores, sources)


def outcome_for(part: Part, outcome: Outcome) -> Outcome:
    """The step as ``part``'s drafter would have seen it alone: its own node numbering, its own
    share of the accepted path, its own nodes' target outputs."""
    target = outcome.target
    if part.draft is None or outcome.draft is None or target is None:
        return Outcome([], [], outcome.next_token, 0, None, target)
    own = {merged: j for j, merged in enumerate(part.nodes)}
    nodes = []
    for merged in outcome.accepted_nodes:
        if merged not in own:
            break
        nodes.append(own[merged])
    tree = target.tree
    node_of = [tree.node_of[merged] if merged < len(tree.node_of) else -1 for merged in part.nodes]
    drafted = sum(1 for n in node_of if n >= 0)
    accepted = [part.draft.tokens[j] for j in nodes]
    return Outcome(accepted, nodes, outcome.next_token, drafted, part.draft, target.renumbered(node_of))
