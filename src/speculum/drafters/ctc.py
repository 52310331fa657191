"""CTC-drafter (Wen, Gui, Feng 2024): one attention layer over the target's hidden states drafts
``slots`` frames at once; the CTC transform turns its top-k alignments into a token tree.

Each step: the module reads the target's last hidden states over the recent context (returned by
the previous verification forward, or the prefill) and the root token's embedding, and gives every
frame a distribution over the draft vocabulary plus a blank. The best alignments (one top-k choice
per frame, highest total log-probability first) each go through the CTC transform: adjacent
repeats merged, blanks dropped. The resulting sequences are inserted best first into a trie of at
most ``tree_nodes`` nodes: shared prefixes share nodes, and a node's depth in the collapsed
sequence gives its position id (the released code keeps the uncollapsed positions, one off after a
merge, and reads the bonus token from a masked node; both break exactness). The shared verifier
then accepts the longest matching path plus the target's own next token, greedy or sampled.
``tree="prefix"`` builds the trie from output prefixes instead, each scored by the probability of
every alignment that collapses to something starting with it (:func:`prefix_search`): a
half-trained module spreads a token over several frames, and no single alignment then carries it.

``ctc_transform=False`` (ablation) drafts the frames' best non-blank tokens as they are.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from speculum.drafters.base import Draft, DraftContext, HeadDrafter, Resources, check_options, check_tree_size
from speculum.errors import InvalidInputError
from speculum.heads import shared_draft_head
from speculum.models.compat import device_of

DEFAULT_TREE_NODES = 16


def ctc_collapse(frames: list[int], blank: int | None = None) -> list[int]:
    """The CTC transform of one alignment: merge adjacent repeats, then drop blanks
    (``[a, a, _, a, b, b] -> [a, a, b]``: a blank between two equal tokens keeps both)."""
    out: list[int] = []
    previous = None
    for frame in frames:
        if frame != previous and frame != blank:
            out.append(frame)
        previous = frame
    return out


def cut_at_eos(tokens: list[int], eos_token_ids) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token (nothing is drafted past it)."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def best_alignments(scores: list[list[float]], count: int) -> list[tuple[float, tuple[int, ...]]]:
    """The ``count`` best choices of one candidate per frame (``scores[t][c]``: log-probability of
    frame t's c-th candidate, sorted descending), best total first."""
    start = tuple(0 for _ in scores)
    heap = [(-sum(row[0] for row in scores), start)]
    seen = {start}
    best = []
    while heap and len(best) < count:
        negative, choice = heapq.heappop(heap)
        best.append((-negative, choice))
        for t, c in enumerate(choice):
            if c + 1 < len(scores[t]):
                nxt = (*choice[:t], c + 1, *choice[t + 1 :])
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, (negative + scores[t][c] - scores[t][c + 1], nxt))
    return best


def prefix_search(
    probs: np.ndarray, blank: int, candidates: np.ndarray, nodes: int, max_depth: int,
    stop: frozenset[int] = frozenset(), width: int | None = None,
) -> list[tuple[int, int, float]]:  # fmt: skip
    """The ``nodes`` output prefixes most likely under the frames' distributions ``probs [T, V+1]``,
    best first, as ``(parent's index or -1, token, probability)``. A prefix's probability is the
    chance that the collapsed output *starts with* it, summed exactly over every alignment (CTC
    prefix scoring: the forward algorithm over the frames), so the nodes chosen are the tree with
    the largest expected accepted length the module can promise. Enumerating the best alignments
    instead misses most of that mass when the frames hesitate between a token and the blank.
    A prefix is never likelier than its parent, so parents come first. ``candidates``: the tokens
    a prefix may be extended with; ``stop``: tokens never extended (end of sequence); ``width``:
    children kept per prefix (1: the greedy chain)."""
    frames = len(probs)
    emit, blank_prob = probs[:, candidates], probs[:, blank]
    chosen: list[tuple[int, int, float]] = []
    depth: list[int] = []
    heap: list[tuple[float, int, int, int, np.ndarray]] = []  # (-probability, tie, parent, candidate, first)
    ties = itertools.count()

    def extend(parent: int, ends_blank: np.ndarray, ends_token: np.ndarray, last: int | None, level: int) -> None:
        """Push the likeliest children of a prefix (``ends_*[t]``: frames 0..t collapse to it and
        frame t is a blank / its last token)."""
        if level >= max_depth:
            return
        start = [1.0 if level == 0 else 0.0]
        before = np.concatenate([start, (ends_blank + ends_token)[:-1]])  # frames 0..t-1 give the prefix
        previous = np.repeat(before[:, None], len(candidates), axis=1)
        if last is not None:  # a repeat of the last token is a new token only after a blank
            previous[:, candidates == last] = np.concatenate([start, ends_blank[:-1]])[:, None]
        first = previous * emit  # [T, K]: the candidate emitted first at frame t
        likelihood = first.sum(axis=0)
        for k in np.argsort(-likelihood)[: min(width or nodes, nodes - len(chosen))]:
            if likelihood[k] <= 0.0:
                break
            heapq.heappush(heap, (-float(likelihood[k]), next(ties), parent, int(k), first[:, k]))

    extend(-1, np.cumprod(blank_prob), np.zeros(frames), None, 0)
    while heap and len(chosen) < nodes:
        negative, _, parent, k, first = heapq.heappop(heap)
        token = int(candidates[k])
        chosen.append((parent, token, -negative))
        depth.append(1 if parent < 0 else depth[parent] + 1)
        if token in stop:
            continue
        ends_blank, ends_token = np.empty(frames), np.empty(frames)
        run = gap = 0.0
        for t in range(frames):  # the forward recursion of the new prefix
            run, gap = run * emit[t, k] + first[t], (gap + run) * blank_prob[t]
            ends_token[t], ends_blank[t] = run, gap
        extend(len(chosen) - 1, ends_blank, ends_token, token, depth[-1])
    return chosen


@dataclass
class Options:
    heads: str | None = None  # checkpoint directory (speculum train ctc-drafter); None: the one shipped for the model
    tree_nodes: int | None = None  # draft tree size; None: the checkpoint's recommendation (else 16)
    top_k: int = 4  # candidates per frame (the blank included); 4 chosen on the tuning prompts (Gemma 3 270M)
    candidates: int = 48  # alignments enumerated before the trie is cut at tree_nodes
    ctc_transform: bool = True  # False: each frame's best non-blank tokens as they are (ablation)
    # which tree_nodes nodes of the candidates' trie are drafted: "first", the best alignments'
    # (the paper's order); "mass", those with the most probability summed over the alignments
    # through them (every alignment that collapses to a prefix counts toward it)
    tree: str = "first"

    def __post_init__(self) -> None:
        check_options("ctc", self, {"top_k": 1, "candidates": 1}, ("ctc_transform",), path="heads")
        if self.tree not in ("first", "mass", "prefix"):
            raise InvalidInputError(f"ctc: tree must be 'first', 'mass' or 'prefix', got {self.tree!r}")
        if self.tree_nodes is not None:
            check_options("ctc", self, {"tree_nodes": 1})
            check_tree_size("ctc", self.tree_nodes, "tree_nodes")


class CTCDrafter(HeadDrafter):
    name = "ctc"

    def __init__(self, options: Options, resources: Resources):
        self.options = options
        # bf16 where native (a step costs a fraction of float32's there), else prepacked float32
        self.module = shared_draft_head("ctc", options.heads, resources)
        inference = self.module.checkpoint_config.get("inference", {})
        self.tree_nodes = options.tree_nodes or inference.get("tree_nodes", DEFAULT_TREE_NODES)
        self.embeddings = resources.embeddings
        super().__init__(self.module.context)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft | None:
        memory = self.history.states
        if memory is None:
            return None
        device = self.module.fuse.weight.device
        root = torch.tensor([ctx.tokens[-1]], device=device_of(self.embeddings))
        logits = self.module(memory[None].to(device), self.embed(root), embed=self.embed)[0]  # [slots, vocab + 1]
        logprobs = logits.float().log_softmax(dim=-1)
        blank = self.module.blank_index
        if not self.options.ctc_transform:
            logprobs[:, blank] = float("-inf")
        top = logprobs.topk(min(self.options.top_k, logprobs.shape[-1]), dim=-1)
        started = time.perf_counter()
        if self.options.tree == "prefix" and self.options.ctc_transform:
            draft = self.prefix_draft(logprobs, top.indices, ctx)
            self.time_tree += time.perf_counter() - started
            return draft if len(draft) else None
        scores, frames = top.values.tolist(), top.indices.tolist()
        vocab = self.module.projection.draft_vocab.tolist()
        paths, weights = [], []
        for logprob, choice in best_alignments(scores, self.options.candidates):
            alignment = [frames[t][c] for t, c in enumerate(choice)]
            sequence = ctc_collapse(alignment, blank) if self.options.ctc_transform else alignment
            tokens = [vocab[i] for i in sequence[: ctx.max_depth]]
            paths.append(cut_at_eos(tokens, ctx.eos_token_ids))
            weights.append(math.exp(logprob))  # the alignment's probability: a controller's estimates
        by_mass = self.options.tree == "mass"
        draft = Draft.from_paths(
            paths, self.tree_nodes, weights if ctx.wants_scores or by_mass else None, "mass" if by_mass else "first"
        )
        self.time_tree += time.perf_counter() - started
        return draft if len(draft) else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``tokens``, on the module's device."""
        return self.embeddings(tokens.to(device_of(self.embeddings))).to(self.module.fuse.weight.device)

    def prefix_draft(self, logprobs: torch.Tensor, top: torch.Tensor, ctx: DraftContext) -> Draft:
        """The tree of the likeliest output prefixes (:func:`prefix_search`), extended with every
        frame's ``top_k`` tokens; a node's score is its probability given its parent's."""
        blank = self.module.blank_index
        candidates = top.flatten().unique()
        candidates = candidates[candidates != blank].cpu().numpy()
        vocab = self.module.projection.draft_vocab
        ids = vocab[torch.from_numpy(candidates).to(vocab.device)].tolist()
        stop = frozenset(int(c) for c, token in zip(candidates, ids, strict=True) if token in ctx.eos_token_ids)
        chosen = prefix_search(logprobs.double().exp().cpu().numpy(), blank, candidates, self.tree_nodes,
                               ctx.max_depth, stop)  # fmt: skip
        tokens = vocab[[token for _, token, _ in chosen]].tolist()
        parents = [parent for parent, _, _ in chosen]
        scores = [p / (1.0 if parent < 0 else chosen[parent][2]) for parent, _, p in chosen]
        return Draft(tokens, parents, scores=[min(1.0, s) for s in scores])
