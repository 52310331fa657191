"""The drafter protocol: propose a token tree, observe what the target did with it.

A drafter never touches the target's KV cache and never decides acceptance; the engine and the
verifier do. Every drafter file defines one ``Drafter`` subclass and an ``Options`` dataclass
listing the parameters a user may set through ``SpeculativeConfig``. Its constructor takes
``(options, resources)``: :class:`Resources` lends it what it may need (the target's LM head and
embeddings, the tokenizer, a draft model and a runner for it).

A request runs ``start`` once, then ``propose`` / ``observe`` once per target forward, then
``finish``. ``observe`` receives an :class:`Outcome`: what was accepted and, read on demand, what
the target computed at every node of the verified tree (argmax, warped probabilities) and, for
drafters that set ``wants_hidden_states``, its last hidden state along the accepted path (and over
the prompt, in ``DraftContext.prefill_hidden``). Nothing is computed for a drafter that asks for
nothing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from speculum.errors import InvalidInputError
from speculum.runner import LazyLogits, ModelRunner, has_plain_head
from speculum.sampling import PositionNoise, SamplingParams, warp
from speculum.tree import MAX_DRAFT_NODES, Draft, TokenTree

if TYPE_CHECKING:
    from speculum.controller import ChainStop
    from speculum.costs import CostModel

__all__ = [
    "Draft",
    "DraftContext",
    "Drafter",
    "HiddenHistory",
    "Outcome",
    "Resources",
    "TargetOutputs",
    "check_options",
    "check_tree_size",
    "token_probability",
]


def check_options(method: str, options, ints: dict[str, int], bools: tuple[str, ...] = (), path: str = "") -> None:
    """Refuse bad ``Options`` values with one clear InvalidInputError: ``ints`` maps each integer
    parameter to its least value, ``bools`` names the flags, ``path`` a parameter holding a path."""
    for name, least in ints.items():
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InvalidInputError(f"{method}: {name} must be an integer >= {least}, got {value!r}")
    for name in bools:
        if not isinstance(getattr(options, name), bool):
            raise InvalidInputError(f"{method}: {name} must be true or false")
    value = getattr(options, path) if path else None
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise InvalidInputError(f"{method}: {path} must be a path, got {value!r}")


def check_tree_size(method: str, nodes: int, how: str) -> None:
    """Refuse options whose trees could exceed MAX_DRAFT_NODES draft nodes in one forward (``how``
    says which options make ``nodes``, e.g. "W*(N-1) + G*(N-1)"): a tree's masks and attention grow
    with its size squared, so one request could exhaust the machine."""
    if nodes > MAX_DRAFT_NODES:
        raise InvalidInputError(
            f"{method}: these settings verify up to {nodes} draft tokens in one forward ({how}); "
            f"at most {MAX_DRAFT_NODES} are allowed"
        )


@dataclass
class Resources:
    """What the engine lends a drafter; every field is optional, a drafter takes what it needs."""

    target: torch.nn.Module | None = None  # the target model (for its LM head and embeddings)
    draft_model: torch.nn.Module | None = None
    tokenizer: Any = None
    vocab_size: int | None = None  # width of the target's logits: draft distributions must match it
    model_key: str = ""  # identity of the tokenizer's vocabulary: saved pools are refused under another
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where sampling happens
    # Objects shared by every drafter of one Speculum (and so every request it serves), e.g. a phrase
    # pool that Ouroboros and lookahead keep across requests: ``shared.setdefault(key, factory())``.
    shared: MutableMapping = field(default_factory=dict)

    @property
    def lm_head(self) -> torch.nn.Module | None:
        return self.target.get_output_embeddings() if self.target is not None else None

    @property
    def embeddings(self) -> torch.nn.Module | None:
        return self.target.get_input_embeddings() if self.target is not None else None

    def runner(self, model: torch.nn.Module, lazy_head: bool = False) -> ModelRunner:
        """A runner of the drafter's own for ``model`` (its own cache, chains and trees).

        ``lazy_head``: compute LM-head rows only for the nodes read (a drafter that runs trees but
        reads few of their outputs), where the architecture allows it."""
        return ModelRunner(model, lazy_head=lazy_head and has_plain_head(model))


@dataclass
class DraftContext:
    """What a drafter may read about the request in flight."""

    tokens: list[int]  # every committed token: prompt + generated; tokens[-1] is the tree's root
    prompt_length: int
    sampling: SamplingParams
    generator: torch.Generator | None  # on ``device``: sample there
    max_depth: int  # deepest useful draft this step (tokens left to generate minus the bonus)
    eos_token_ids: frozenset[int] = frozenset()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the target's logits are
    # The target's last hidden states of tokens[:-1] from the prefill ([len - 1, hidden]), for
    # drafters with wants_hidden_states (None otherwise).
    prefill_hidden: torch.Tensor | None = None
    # Whether a controller reads Draft.scores (a drafter that pays something to compute them skips
    # that otherwise).
    wants_scores: bool = False
    # Rows in the batch this step (the engine sets it; 1: decoding alone).
    rows: int = 1
    # A seeded sampled request's noise: a drafter that samples picks the token at generated
    # position i with ``noise.choose(q, i)`` (i = len(tokens) - prompt_length + d, d = 0 for the
    # token right after the root).
    noise: PositionNoise | None = None
    # This round's stop for a chain drafted one forward at a time (``controller.ChainStop``; the
    # engine sets it for a request decoding alone under a controller): a drafter that grows a chain
    # ``add``s each node's score and, after each draft forward, ends the chain unless
    # ``worth_another`` (None: only the drafter's own length policy decides).
    chain_stop: ChainStop | None = None
    # The target's cost model under a controller (the engine sets it; None without one): what a
    # forward over B rows of n nodes costs, for drafters that weigh their own cost against it.
    cost: CostModel | None = None


def token_probability(logits: torch.Tensor, token: int) -> float:
    """softmax(logits)[token] without materialising the softmax."""
    logits = logits.float()
    return float(torch.exp(logits[token] - torch.logsumexp(logits, dim=-1)))


class TargetOutputs:
    """What the target computed over the verified tree, read on demand (nothing is computed unless asked).

    Nodes are the drafter's own draft indices, -1 being the root (as in ``Draft.parents``); the
    target's output *at* a node predicts the token *after* it.
    """

    def __init__(
        self,
        tree: TokenTree,
        logits,
        sampling: SamplingParams,
        hidden: torch.Tensor | None,
        argmax: list[int] | None = None,
    ):
        self.tree = tree
        self._logits = logits
        self._sampling = sampling
        self.hidden_states = hidden  # [1 + accepted, hidden]: root first, then the accepted nodes
        if argmax is not None:  # the greedy verifier's, already computed for every tree node
            self._tree_argmax = argmax

    def _tree_node(self, node: int) -> int:
        tree_node = 0 if node == -1 else self.tree.node_of[node]
        if tree_node < 0:
            raise IndexError(f"draft node {node} was not verified (deeper than the tokens left to generate)")
        return tree_node

    @cached_property
    def _tree_argmax(self) -> list[int]:
        logits = self._logits.materialize() if isinstance(self._logits, LazyLogits) else self._logits
        return logits.argmax(dim=-1).tolist()

    def argmax(self, node: int = -1) -> int:
        """The target's most likely token after ``node``."""
        return self._tree_argmax[self._tree_node(node)]

    def argmax_of(self, nodes: list[int]) -> list[int | None]:
        """The target's most likely token after each of ``nodes`` (None for a node not verified).

        Computes LM-head rows for these nodes only where the head is lazy."""
        tree_nodes = [0 if n == -1 else self.tree.node_of[n] for n in nodes]
        present = [n for n in tree_nodes if n >= 0]
        if "_tree_argmax" in self.__dict__ or not isinstance(self._logits, LazyLogits):
            best = self._tree_argmax
            return [best[n] if n >= 0 else None for n in tree_nodes]
        found = dict(zip(present, self._logits.take(present).argmax(dim=-1).tolist(), strict=True)) if present else {}
        return [found.get(n) for n in tree_nodes]

    def argmaxes(self) -> list[int]:
        """The target's most likely token after each draft node (-1 for nodes not verified)."""
        best = self._tree_argmax
        return [best[n] if n >= 0 else -1 for n in self.tree.node_of]

    def probs(self, node: int = -1) -> torch.Tensor:
        """The target's distribution after ``node``: warped as the request samples (temperature,
        top-k, top-p), or the plain softmax for a greedy request."""
        row = self._logits[self._tree_node(node)]
        if self._sampling.greedy:
            return torch.softmax(row.float(), dim=-1)
        return warp(row, self._sampling)[0]

    def renumbered(self, node_of: list[int]) -> TargetOutputs:
        """The same outputs for a drafter whose draft node j is held by tree node ``node_of[j]``
        (-1: not verified), e.g. one drafter's share of a merged draft. Nothing is recomputed: an
        argmax the verifier already computed for the tree is shared."""
        argmax = self.__dict__.get("_tree_argmax")
        return TargetOutputs(_NodeMap(node_of), self._logits, self._sampling, self.hidden_states, argmax)


class _NodeMap:
    """What TargetOutputs reads of a tree: which tree node holds each draft node (-1: not verified)."""

    def __init__(self, node_of: list[int]):
        self.node_of = node_of


@dataclass
class Outcome:
    """The verifier's decision for one step, as drafters see it."""

    accepted: list[int]  # draft tokens accepted (along the chosen path), in order
    accepted_nodes: list[int]  # their indices in the Draft
    next_token: int  # the target's own token after the accepted path (bonus or correction)
    drafted: int  # how many tree nodes were verified below the root (merged duplicates counted once)
    draft: Draft | None = None  # the draft as proposed
    target: TargetOutputs | None = None
    # what the engine measured of the step; in a batch, "row_seconds": the round's cost to this row
    # (its own drafting and its share of the forward); with a controller, "node_cost": n -> seconds
    # a forward over an n-node tree (root included) costs this row, by the controller's cost model
    stats: dict = field(default_factory=dict)


class Drafter:
    """Base class: a drafter that proposes nothing (plain decoding)."""

    name: ClassVar[str] = "autoregressive"
    # Set by drafters that read the target's last hidden state (heads): the engine then returns it
    # from the prefill (DraftContext.prefill_hidden) and from every step (Outcome.target.hidden_states).
    wants_hidden_states: bool = False
    # Whether the controller may verify only part of a draft. False for a drafter that needs the
    # target's output at every node it proposed (lookahead's Jacobi window).
    prunable: bool = True
    # Sources (``Draft.sources``) whose nodes the controller verifies as proposed, below a kept parent:
    # a draft model that stops on its own confidence has already paid for each token it drafted and
    # judged it worth verifying (``auto`` keeps its draft model's chain this way).
    whole_sources: frozenset[str] = frozenset()
    # Seconds of the last ``propose`` spent catching up: feeding the drafter's own model text that
    # was committed before the round, beyond the round's root (its prefill of the prompt when a
    # request starts, the tokens of plain rounds after a pause). That text is paid for once, not
    # again each round, so the controller and ``auto``'s gates judge a round without it (the
    # stats' draft time keeps it): a draft model's prefill charged to one round would make it
    # look like a loss on short requests, and the back-off it started would carry over.
    catch_up_seconds: float = 0.0
    # Whether a sampled request without a seed should still sample by a PositionNoise (of fresh
    # entropy): set by drafters whose draft picks its tokens by that noise where the standard rule
    # would have a deterministic draft token accepted only with p(token) (Ouroboros' draft).
    # draft_model leaves it off: its chain, sampled from q, is accepted a little more often under
    # speculative sampling's rule than by the noise (see docs/results.md).
    samples_by_noise: ClassVar[bool] = False

    def check(self, sampling: SamplingParams) -> None:
        """Refuse (InvalidInputError) a request this drafter cannot serve exactly; called when the request
        is made, before anything runs."""

    def start(self, ctx: DraftContext) -> None:
        """A new request: the prompt is ``ctx.tokens``."""

    def propose(self, ctx: DraftContext) -> Draft | None:
        """Return draft tokens below ``ctx.tokens[-1]``, or None to take a plain decode step."""
        return None

    def catch_up_estimate(self, ctx: DraftContext) -> float:
        """Seconds the next ``propose`` would spend catching up (see ``catch_up_seconds``), as
        estimated before asking: a draft model's prefill of the prompt at a request's first draft.
        The controller weighs it against what drafting would save over the tokens likely left
        (0: nothing to catch up, or not known yet)."""
        return 0.0

    @property
    def batch_key(self):
        """Rows of a batch whose drafters share a key (not None) propose together, through
        ``propose_rows`` (a draft model runs one forward per draft step for all of them)."""
        return None

    @classmethod
    def propose_rows(cls, drafters: list[Drafter], ctxs: list[DraftContext]) -> list[Draft | None]:
        """``propose`` for several rows at once (drafters with the same ``batch_key``, one per row)."""
        return [drafter.propose(ctx) for drafter, ctx in zip(drafters, ctxs, strict=True)]

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        """Learn from the step's result; ``ctx.tokens`` already holds the newly committed tokens.
        (Not called after the step that ends the request: ``finish`` is.) ``outcome.draft`` is None
        when nothing was drafted this step, also when ``propose`` was not called (the controller
        chose a plain step): state kept from an earlier ``propose`` is then stale."""

    def finish(self, ctx: DraftContext) -> None:
        """The request is over (``ctx.tokens`` holds every committed token): persistent pools learn the end."""

    def request_stats(self) -> dict:
        """What this drafter measured about the last request beyond the engine's Stats (benchmarks
        record it), e.g. the time spent turning head outputs into a tree."""
        return {}

    @property
    def forwards(self) -> int:
        """Draft-model forward passes spent so far in this request (0 for model-free drafters)."""
        return 0


class HiddenHistory:
    """The target's last hidden states over the most recent committed positions, for head drafters.

    Kept up to the token before the root (the root's own state comes with the next forward): from
    the prefill at ``start``, then from each step's accepted path (``Outcome.target.hidden_states``:
    the old root's state, then the accepted nodes').
    """

    def __init__(self, width: int):
        self.width = width
        self.states: torch.Tensor | None = None  # [<= width, hidden]

    def start(self, ctx: DraftContext) -> None:
        hidden = ctx.prefill_hidden
        self.states = hidden[-self.width :] if hidden is not None and len(hidden) else None

    def observe(self, outcome: Outcome) -> None:
        new = outcome.target.hidden_states if outcome.target is not None else None
        if new is None:
            raise RuntimeError("the engine returned no hidden states to a drafter that wants them")
        joined = new if self.states is None else torch.cat([self.states, new.to(self.states.dtype)])
        self.states = joined[-self.width :]

    @property
    def last(self) -> torch.Tensor | None:
        """The state at the position before the root, ``[hidden]``, or None before any."""
        return None if self.states is None else self.states[-1]


class HeadDrafter(Drafter):
    """Base of drafters that read the target's hidden states (Medusa heads, the CTC module): keeps
    the last ``history_width`` states and the time spent building trees from the heads' outputs."""

    wants_hidden_states = True

    def __init__(self, history_width: int):
        self.history = HiddenHistory(history_width)
        self.time_tree = 0.0  # seconds this request spent turning head outputs into trees

    def start(self, ctx: DraftContext) -> None:
        self.history.start(ctx)
        self.time_tree = 0.0

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        self.history.observe(outcome)

    def request_stats(self) -> dict:
        return {"time_tree": self.time_tree}
