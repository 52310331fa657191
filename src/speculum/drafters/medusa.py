"""Medusa-1 (Cai et al. 2024): K heads on the frozen target guess the next K tokens from its last
hidden state; their top-k guesses form a sparse token tree, verified in one target forward.

The heads read the target's hidden state at the position before the root (returned by the
previous verification forward, or the prefill: nothing extra is computed). The tree's shape is a
list of choice paths (Medusa's ``medusa_choices``): by default the ``tree_nodes`` paths of highest
expected acceptance given the top-k hit rates measured on the validation text when the heads
were trained (:func:`speculum.heads.medusa.sparse_tree`). Drafts are deterministic, so greedy and
sampled decoding both stay exact through the shared verifier (not Medusa's typical acceptance,
which is not lossless). ``ctc_transform=True`` merges adjacent repeated tokens on each path first
(the CTC-drafter paper's Table 2 ablation).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from speculum.drafters.base import Draft, DraftContext, HeadDrafter, Resources, check_options, check_tree_size
from speculum.drafters.ctc import ctc_collapse, cut_at_eos
from speculum.errors import InvalidInputError
from speculum.heads import shared_draft_head
from speculum.heads.medusa import sparse_tree

DEFAULT_TREE_NODES = 16


@dataclass
class Options:
    heads: str | None = None  # checkpoint directory (speculum train medusa); None: the heads shipped for the model
    tree_nodes: int | None = None  # draft tree size; None: the checkpoint's recommendation (else 16)
    tree_choices: list | None = None  # explicit Medusa choices, e.g. [[0], [1], [0, 0]]; overrides tree_nodes
    top_k: int = 10  # candidates per head the default tree may use
    ctc_transform: bool = False  # merge adjacent repeats on every path (ablation)

    def __post_init__(self) -> None:
        check_options("medusa", self, {"top_k": 1}, ("ctc_transform",), path="heads")
        if self.tree_nodes is not None:
            check_options("medusa", self, {"tree_nodes": 1})
            check_tree_size("medusa", self.tree_nodes, "tree_nodes")
        if self.tree_choices is not None:
            ok = isinstance(self.tree_choices, (list, tuple)) and all(
                isinstance(c, (list, tuple)) and c and all(isinstance(i, int) and i >= 0 for i in c)
                for c in self.tree_choices
            )
            if not ok or not self.tree_choices:
                raise InvalidInputError("medusa: tree_choices must be a list of non-empty lists of indices >= 0")
            check_tree_size("medusa", len(self.tree_choices), "tree_choices")


class MedusaDrafter(HeadDrafter):
    name = "medusa"

    def __init__(self, options: Options, resources: Resources):
        self.options = options
        self.heads = shared_draft_head("medusa", options.heads, resources)
        inference = self.heads.checkpoint_config.get("inference", {})
        if options.tree_choices is not None:
            choices = [tuple(c) for c in options.tree_choices]
            deepest, widest = max(map(len, choices)), max(max(c) for c in choices)
            if deepest > self.heads.num_heads or widest >= options.top_k:
                raise InvalidInputError(
                    f"medusa: tree_choices need {deepest} heads and top_k > {widest}; "
                    f"these heads are {self.heads.num_heads} (top_k {options.top_k})"
                )
            self.choices = sorted(set(choices), key=lambda c: (len(c), c))
        else:
            nodes = options.tree_nodes or inference.get("tree_nodes", DEFAULT_TREE_NODES)
            accuracy = inference.get("topk_accuracy") or [
                [0.6 * 0.5**c for c in range(options.top_k)] for _ in range(self.heads.num_heads)
            ]
            self.choices = sparse_tree([row[: options.top_k] for row in accuracy], nodes)
        self.top_k = max(max(c) for c in self.choices) + 1
        super().__init__(1)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft | None:
        hidden = self.history.last
        if hidden is None:
            return None
        logits = self.heads(hidden[None].to(self.heads.projection.weight.device))[0]  # [heads, draft vocab]
        top = logits.topk(self.top_k, dim=-1)
        guesses = self.heads.projection.to_vocab(top.indices).tolist()
        started = time.perf_counter()
        paths = [[guesses[d][c] for d, c in enumerate(choice)] for choice in self.choices]
        weights = None
        if ctx.wants_scores:  # each path's probability under the heads, for a controller's estimates
            probs = (top.values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp().tolist()
            weights = [math.prod(probs[d][c] for d, c in enumerate(choice)) for choice in self.choices]
        if self.options.ctc_transform:
            paths = [ctc_collapse(path) for path in paths]
        paths = [cut_at_eos(path[: ctx.max_depth], ctx.eos_token_ids) for path in paths]
        draft = Draft.from_paths(paths, weights=weights)
        self.time_tree += time.perf_counter() - started
        return draft
