"""The drafter protocol: propose a token tree, observe what was accepted.

A drafter never touches the target's KV cache and never decides acceptance; the engine and the
verifier do. Every drafter file defines one ``Drafter`` subclass and an ``Options`` dataclass
listing the parameters a user may set through ``SpeculativeConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from speculum.sampling import SamplingParams


@dataclass
class Draft:
    """Draft tokens hanging below the last committed token (the root of the tree).

    ``parents[i]`` is the index of node i's parent in this list, or -1 when node i is a child of
    the root. Parents come before children. Siblings must hold distinct tokens.
    ``probs`` (optional, ``[len(tokens), vocab]``) marks a *stochastic* draft: node i's token was
    sampled from ``probs[i]`` (the draft's warped distribution at its parent). Siblings of a
    stochastic tree are i.i.d. samples of the same distribution. Without ``probs`` the draft is
    deterministic (n-gram, prompt lookup, phrases, heads).
    """

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> Draft:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the root)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def truncated(self, max_depth: int) -> Draft:
        """The same draft without nodes deeper than ``max_depth``."""
        depth = self.depths()
        if not depth or max(depth) <= max_depth:
            return self
        keep = [i for i, d in enumerate(depth) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [new_index.get(self.parents[i], -1) for i in keep]
        probs = self.probs[keep] if self.probs is not None else None
        return Draft([self.tokens[i] for i in keep], parents, probs)


@dataclass
class DraftContext:
    """What a drafter may read about the request in flight."""

    tokens: list[int]  # every committed token: prompt + generated; tokens[-1] is the tree's root
    prompt_length: int
    sampling: SamplingParams
    generator: torch.Generator | None
    max_depth: int  # deepest useful draft this step (tokens left to generate minus the bonus)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class Outcome:
    """The verifier's decision for one step, as drafters see it."""

    accepted: list[int]  # draft tokens accepted (along the chosen path), in order
    accepted_nodes: list[int]  # their indices in the Draft
    next_token: int  # the target's own token after the accepted path (bonus or correction)
    drafted: int  # how many draft tokens were proposed this step
    stats: dict = field(default_factory=dict)


class Drafter:
    """Base class: a drafter that proposes nothing (plain decoding)."""

    name: ClassVar[str] = "autoregressive"

    def start(self, ctx: DraftContext) -> None:
        """A new request: the prompt is ``ctx.tokens``."""

    def propose(self, ctx: DraftContext) -> Draft | None:
        """Return draft tokens below ``ctx.tokens[-1]``, or None to take a plain decode step."""
        return None

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        """Learn from the step's result; ``ctx.tokens`` already holds the newly committed tokens."""

    @property
    def forwards(self) -> int:
        """Draft-model forward passes spent so far in this request (0 for model-free drafters)."""
        return 0
