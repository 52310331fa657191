"""Draft and TokenTree: the one shape every draft takes (a chain is a tree with one child per node).

A drafter returns a :class:`Draft` (its tokens below the last committed token, in its own
numbering). The engine turns it into a :class:`TokenTree` for one target forward: node 0 is the
root (the last committed token, whose key/values are not in the cache yet), nodes deeper than the
tokens left to generate are dropped, and deterministic siblings holding the same token are merged
(lookahead guesses and phrase branches often share prefixes). The tree remembers which draft node
each of its nodes came from, so everything reported back to the drafter uses the drafter's own
indices. From the parallel arrays ``tokens``/``parents`` come everything the target forward and the
verifier need: depths (position ids), the ancestor matrix (attention mask), children, paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# The most draft nodes one forward verifies (below the root). A tree's masks and attention grow with
# n x (past + n): options that could build a bigger tree are refused up front (every drafter checks
# its worst case with ``check_tree_size``), and the tree builder drops nodes beyond it, for any
# drafter. 1024 is eight times the largest tree any published method uses (Medusa's 64, LADE's 120
# on GPUs).
MAX_DRAFT_NODES = 1024


@dataclass
class Draft:
    """Draft tokens hanging below the last committed token (the root of the tree).

    ``parents[i]`` is the index of node i's parent in this list, or -1 when node i is a child of
    the root; parents come before children.

    ``probs`` says how each token was chosen:

    - ``None``: every node is *deterministic* (n-gram, prompt lookup, phrases, heads, greedy drafts);
    - a tensor ``[len(tokens), vocab]``: node i was *sampled* from ``probs[i]`` (the draft's warped
      distribution at its parent, over the target's vocabulary);
    - a list with one entry per node, a ``[vocab]`` tensor or ``None``: a mix, node by node (a
      sampled draft lengthened by deterministic phrases). A one-hot row is the same as ``None``.

    Sampled siblings must be independent samples (of the same or different distributions), so
    equal sampled siblings stay apart. A deterministic node is merged by the tree builder into an
    earlier sibling holding its token, deterministic or sampled: the verifier tries siblings in
    order, and a sampled y it rejects has no mass left in the residual (p(y) < q(y) there), so
    trying the same token again could never succeed; merged, the deterministic node's subtree
    hangs below y instead, where it is verified if y is accepted. (Whether a deterministic
    candidate is tried may depend on earlier siblings' values: the rule stays exact.)
    """

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | list[torch.Tensor | None] | None = None
    # What the drafter believes of each node, in [0, 1]: how likely it is accepted given its parent
    # is (the draft's probability of the token, an n-gram's agreement, a head's score), or None
    # where it has no idea. Used only to choose what to verify (the controller calibrates it
    # against what the target accepts). A sampled node's score must not depend on its own token:
    # dropping a sampled token because of its value would bias the output.
    scores: list[float | None] | None = None
    # Which drafter proposed each node, for a draft composed from several (``auto``): the controller
    # calibrates each one's scores apart, and the stats count accepted tokens by drafter.
    sources: list[str] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError("probs must have one entry per draft node")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError("scores must have one entry per draft node")
        if self.sources is not None and len(self.sources) != len(self.tokens):
            raise ValueError("sources must have one entry per draft node")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"draft node {i} has parent {parent}: parents must come before their children")

    @classmethod
    def chain(
        cls,
        tokens: list[int],
        probs: torch.Tensor | list | None = None,
        scores: list | None = None,
        source: str | None = None,
    ) -> Draft:
        """A chain below the root; ``source``: the drafter every node is labelled with (``sources``)."""
        sources = [source] * len(tokens) if source is not None else None
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs, scores, sources)

    @classmethod
    def from_paths(
        cls,
        paths: list[list[int]],
        max_nodes: int | None = None,
        weights: list[float] | None = None,
        keep: str = "first",
    ) -> Draft:
        """A deterministic draft holding every path (token sequences below the root) as a trie:
        shared prefixes become shared nodes, so each node's depth, and with it its position id, is
        its place in the sequence.

        ``weights`` (each path's probability, as its drafter sees it) give every node a score: the
        share of its parent's probability mass that goes through it. Which nodes ``max_nodes``
        keeps (``keep``): ``"first"``, the paths in order (best first; once the budget is spent,
        later paths only keep the prefix already in the trie); ``"mass"`` (needs ``weights``), the
        nodes with the most probability mass through them. A node's mass is at most its parent's,
        so those form a sub-tree, and the one whose expected accepted length (the sum of its
        nodes' masses, when the weights are calibrated) is the largest."""
        if keep not in ("first", "mass"):
            raise ValueError(f"keep must be 'first' or 'mass', not {keep!r}")
        if keep == "mass" and weights is None:
            raise ValueError("keep='mass' needs the paths' weights")
        budget = None if keep == "mass" else max_nodes
        tokens: list[int] = []
        parents: list[int] = []
        mass: list[float] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for p, path in enumerate(paths):
            parent = -1
            for token in path:
                node = node_of.get((parent, token))
                if node is None:
                    if budget is not None and len(tokens) >= budget:
                        break
                    node = node_of[(parent, token)] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                    mass.append(0.0)
                if weights is not None:
                    mass[node] += weights[p]
                parent = node
        if keep == "mass" and max_nodes is not None and len(tokens) > max_nodes:
            depth = [0] * len(tokens)
            for i, parent in enumerate(parents):
                depth[i] = 1 if parent < 0 else depth[parent] + 1
            # a parent sorts before its children (more mass, or as much and shallower): the kept set is a sub-tree
            kept = sorted(sorted(range(len(tokens)), key=lambda i: (-mass[i], depth[i], i))[:max_nodes])
            index = {old: new for new, old in enumerate(kept)}
            tokens, mass = [tokens[i] for i in kept], [mass[i] for i in kept]
            parents = [-1 if parents[i] < 0 else index[parents[i]] for i in kept]
        if weights is None:
            return cls(tokens, parents)
        total = sum(weights[p] for p, path in enumerate(paths) if path)
        scores = [
            m / max(total if parent < 0 else mass[parent], 1e-30) for m, parent in zip(mass, parents, strict=True)
        ]
        return cls(tokens, parents, scores=[min(1.0, s) for s in scores])

    def __len__(self) -> int:
        return len(self.tokens)

    def q(self, node: int) -> torch.Tensor | None:
        """The distribution draft node ``node`` was sampled from, or None when it is deterministic."""
        return None if self.probs is None else self.probs[node]

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the root)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth


class TokenTree:
    """A token tree ready for one forward: ``tokens[0]`` is the root, ``parents[0] == -1``.

    ``draft_probs[i]`` is the distribution node i's token was sampled from, or None for a
    deterministic node (and for the root); ``draft_probs`` itself is None when no node was sampled.
    ``source[i]`` is the draft index node i came from (-1 for the root); ``node_of[j]`` is the tree
    node of draft node j (-1 when it was dropped as too deep).
    """

    def __init__(
        self,
        tokens: list[int],
        parents: list[int],
        draft_probs: list[torch.Tensor | None] | None = None,
        source: list[int] | None = None,
    ):
        if not tokens or parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents must have the same length")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
        self.tokens = list(tokens)
        self.parents = list(parents)
        self.draft_probs = draft_probs
        self.source = list(source) if source is not None else list(range(-1, len(tokens) - 1))
        self.node_of = [-1] * (max(self.source) + 1)
        for node, j in enumerate(self.source):
            if j >= 0:
                self.node_of[j] = node

    @classmethod
    def from_draft(
        cls,
        root_token: int,
        draft: Draft | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
        keep: list[bool] | None = None,
    ) -> TokenTree:
        """The tree for ``draft`` below ``root_token``: nodes deeper than ``max_depth`` dropped,
        a deterministic node merged (with its subtree) into an earlier sibling holding its token,
        sampled or not (see ``Draft``), draft nodes beyond the
        first ``max_nodes`` kept dropped (parents come first, so what is kept is still a tree), and,
        given ``keep`` (one flag per draft node), the nodes it says not to keep with their subtrees."""
        if draft is None or len(draft) == 0:
            return cls([root_token], [-1])
        tokens, parents, probs, source, depth = [root_token], [-1], [None], [-1], [0]
        node_of = [-1] * len(draft)
        first_child: dict[tuple[int, int], int] = {}  # (parent node, token) -> the first node holding it
        for j, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
            parent_node = 0 if parent < 0 else node_of[parent]
            if parent_node < 0 or (max_depth is not None and depth[parent_node] >= max_depth):
                continue  # below a dropped node, or too deep
            if keep is not None and not keep[j]:
                continue  # pruned (and so is its subtree: its children find no parent node)
            q = draft.q(j)
            if q is None and (parent_node, token) in first_child:
                node_of[j] = first_child[(parent_node, token)]
                continue
            if max_nodes is not None and len(tokens) > max_nodes:
                break  # dropping draft nodes is always lossless: they are simply not verified
            node_of[j] = len(tokens)
            first_child.setdefault((parent_node, token), len(tokens))
            tokens.append(int(token))
            parents.append(parent_node)
            probs.append(q)
            source.append(j)
            depth.append(depth[parent_node] + 1)
        tree = cls(tokens, parents, probs if any(q is not None for q in probs) else None, source)
        tree.node_of = node_of  # merged draft nodes map to the node that kept their token
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    def q(self, node: int) -> torch.Tensor | None:
        return None if self.draft_probs is None else self.draft_probs[node]

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
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]  # parents come first, so their row is complete
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def draft_path(self, path: list[int], draft: Draft) -> list[int]:
        """The draft indices along a tree path (root excluded), in the drafter's own numbering.

        Where merged draft nodes share a tree node, the draft path ending at the deepest node is
        the one reported, so consecutive indices are parent and child in ``draft``.
        """
        if len(path) < 2:
            return []
        nodes = [self.source[path[-1]]]
        while len(nodes) < len(path) - 1:
            nodes.append(draft.parents[nodes[-1]])
        return nodes[::-1]

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self.children) if not kids]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def position_ids(self, past_length: int) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long) + past_length
