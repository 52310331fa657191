"""Exact replay: the greedy acceptance a drafter gets, without running the target at every step.

Greedy verification accepts exactly the draft tokens that equal the target's greedy output. Once
that output (the *reference*) is recorded, the engine's own loop runs with the target replaced by
it: a tree node is *on the reference path* when it and all its ancestors hold the reference tokens
at their positions, the target's argmax there is the next reference token, and the verifier reads
only such nodes. So a deterministic drafter (n-gram, prompt lookup, a greedy draft model) gets,
without a target forward, the very acceptance of a real greedy run (timings aside). Used for
acceptance-only studies over many prompts and settings (``benchmarks/anpd_ablations.py``,
``benchmarks/ouroboros_studies.py``, ``speculum tune``).

Some drafters also read what the target predicted *off* that path: lookahead's Jacobi window and
Ouroboros' verification phrases learn from the target's argmax at rejected nodes, which no record
holds. Given ``model=`` (the target), the replay computes those rows when they are read: the target
runs once over prompt + reference (that KV cache is kept), then each step whose off-path rows are
read sends all of them through one forward after that cache, every node seeing the text up to its
deepest on-path ancestor plus its own off-path ancestors, at the position it has in the real tree
forward (equal to the real rows up to rounding: one prefill, not step-by-step forwards). Without a
model, reading such a row raises :class:`~speculum.errors.ReplayError`. A drafter that reads no
off-path row costs no target forward, model or not.

Head drafters (Medusa, CTC) also read the target's hidden states: given ``hidden`` (the target's
last hidden states over prompt + reference, from one teacher-forced forward), the replay hands
them the state of every committed position, as the real loop would (up to rounding, likewise).
"""

from __future__ import annotations

import time

import torch

from speculum import cache as cache_ops
from speculum import engine
from speculum.drafters.base import Drafter
from speculum.errors import ReplayError
from speculum.runner import LazyLogits, ModelRunner, StepOutput, with_cache
from speculum.sampling import SamplingParams
from speculum.stats import Stats
from speculum.tree import TokenTree


class ReplayRunner:
    """Stands in for the target's ModelRunner when its greedy output (``reference``) is known.

    ``model``: the target (a module or its ModelRunner), for drafters that read its outputs off
    the reference path. One ReplayRunner may replay many drafters on the same prompt (:meth:`run`):
    the target's cache over the sequence is made once, on first need.
    """

    max_positions = None
    output_device = torch.device("cpu")

    def __init__(
        self,
        prompt_ids: list[int],
        reference: list[int],
        hidden: torch.Tensor | None = None,
        model: torch.nn.Module | ModelRunner | None = None,
    ):
        self.sequence = list(prompt_ids) + list(reference)
        self.prompt_length = len(prompt_ids)
        self.hidden = hidden  # [len(sequence) (or one less), hidden size], for drafters that read it
        self.target = ModelRunner(model) if isinstance(model, torch.nn.Module) else model
        self.target_cache = None  # the target's keys/values over the whole sequence, once made
        self.target_forwards = 0  # forwards of the target so far (the prefill included)
        self.target_time = 0.0  # seconds they took

    def run(self, drafter: Drafter, eos_token_ids=frozenset()) -> Stats:
        """The greedy acceptance statistics ``drafter`` gets on this prompt.

        The timings leave out the target's forwards: they compute rows that a real run's
        verification forward gives for free (they would otherwise count as drafting time, since
        drafters read those rows in ``observe``)."""
        stats = Stats()
        reference_length = len(self.sequence) - self.prompt_length
        prompt = self.sequence[: self.prompt_length]
        spent = self.target_time
        for _ in engine.run(self, prompt, drafter, SamplingParams(), reference_length, eos_token_ids, None, stats):
            pass
        spent = self.target_time - spent
        stats.time_draft -= spent
        stats.wall_time -= spent
        return stats

    # ------------------------------------------------------------------ the ModelRunner interface

    def new_cache(self) -> list[int]:
        return [0]  # the number of committed positions, as a stand-in for a KV cache

    def prefill(self, cache, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        cache[0] = len(token_ids)
        return self._states(list(range(len(token_ids))), hidden) if token_ids else None

    def _states(self, positions: list[int], wanted: bool) -> torch.Tensor | None:
        if not wanted:
            return None
        if self.hidden is None:
            raise ReplayError("this drafter reads hidden states: replay it with hidden=...")
        return self.hidden[[min(p, len(self.hidden) - 1) for p in positions]]

    def commit(self, cache, past_length: int, path: list[int]) -> None:
        cache[0] = past_length + len(path)

    def forward(self, cache, tree: TokenTree, *, hidden: bool = False, last_only: bool = False) -> StepOutput:
        root = cache[0]  # index of the tree's root in the full sequence
        # a node on the reference path is the reference token at root + depth: its state is the
        # recorded one there (other nodes' states are never read: they are not committed)
        return StepOutput(_ReplayRows(self, tree, root), self._states([root + d for d in tree.depth], hidden))

    # ------------------------------------------------------------------ the target, off the path

    @torch.inference_mode()
    def off_path_argmax(self, tree: TokenTree, root: int, on_path: list[bool]) -> dict[int, int]:
        """The target's argmax after each node of ``tree`` not on the reference path, from one forward."""
        if self.target is None:
            raise ReplayError(
                "this drafter reads the target's outputs off the accepted path (lookahead's window, "
                "Ouroboros' verification phrases), which the recorded output does not hold: replay it with model="
            )
        start = time.perf_counter()
        target, past = self.target, len(self.sequence)
        if self.target_cache is None:
            self.target_cache = target.new_cache()
            target.prefill(self.target_cache, self.sequence)
            self.target_forwards += 1
        off = [node for node, on in enumerate(on_path) if not on]
        # each off-path node sees the text up to its deepest on-path ancestor (those rows of the
        # whole-sequence cache are the real tree's prefix and path), then its own off-path ancestors
        allowed = torch.zeros(len(off), past + len(off), dtype=torch.bool)
        allowed[:, past:] = tree.ancestor_mask[off][:, off]
        for row, node in enumerate(off):
            while not on_path[node]:
                node = tree.parents[node]
            allowed[row, : root + tree.depth[node] + 1] = True
        device = target.input_device
        positions = torch.tensor([root + tree.depth[node] for node in off], device=device)
        try:
            logits = target.model(
                input_ids=torch.tensor([[tree.tokens[node] for node in off]], device=device),
                **with_cache(target.model, self.target_cache),
                use_cache=True,
                attention_mask=target.attention_mask(allowed.to(device), positions),
                position_ids=positions[None],
            ).logits[0]
        finally:
            cache_ops.crop(self.target_cache, past)  # the whole sequence again, for the next step
        best = dict(zip(off, logits.argmax(dim=-1).tolist(), strict=True))
        self.target_forwards += 1
        self.target_time += time.perf_counter() - start
        return best


class _ReplayRows(LazyLogits):
    """Greedy-only stand-in for a tree's logits: row i's argmax, computed when read. On the reference
    path it is the next reference token; the rest come from the target, all in one forward, on the
    first read of any of them. A LazyLogits, so that the drafters' reads (``TargetOutputs``) ask for
    the rows they need only (materialising one-hot rows over a 150k vocabulary would cost more than
    the drafters studied)."""

    def __init__(self, runner: ReplayRunner, tree: TokenTree, root: int):
        self.runner, self.tree, self.root = runner, tree, root
        sequence, last = runner.sequence, len(runner.sequence) - 1
        self.best: dict[int, int] = {}  # node -> the target's argmax after it
        on_path = []
        for node, (token, depth) in enumerate(zip(tree.tokens, tree.depth, strict=True)):
            position = root + depth
            # (a node at the last position has no recorded successor: it counts as off the path)
            on = position < last and sequence[position] == token and (node == 0 or on_path[tree.parents[node]])
            on_path.append(on)
            if on:
                self.best[node] = sequence[position + 1]
        self.on_path = on_path

    def __len__(self) -> int:
        return len(self.tree)

    def _argmax(self, node: int) -> int:
        if node not in self.best:
            self.best.update(self.runner.off_path_argmax(self.tree, self.root, self.on_path))
        return self.best[node]

    def __getitem__(self, node: int) -> _ReplayRow:
        return _ReplayRow(self._argmax(node))

    def take(self, nodes: list[int]) -> _Argmaxes:
        return _Argmaxes(self._argmax(node) for node in nodes)

    def materialize(self) -> _Argmaxes:
        return self.take(list(range(len(self))))


class _Argmaxes(list):
    """Rows already reduced to their argmax: ``rows.argmax(dim=-1).tolist()`` is the list itself."""

    def argmax(self, dim: int = -1) -> _Argmaxes:
        return self

    def tolist(self) -> list[int]:
        return list(self)


class _ReplayRow:
    def __init__(self, token: int):
        self.token = token

    def argmax(self) -> int:
        return self.token


def replay(
    prompt_ids: list[int],
    reference: list[int],
    drafter: Drafter,
    eos_token_ids=frozenset(),
    hidden: torch.Tensor | None = None,
    model: torch.nn.Module | ModelRunner | None = None,
) -> Stats:
    """The greedy acceptance statistics ``drafter`` would get on a prompt whose greedy output is
    ``reference`` (``hidden``: the target's states over both, for drafters that read them;
    ``model``: the target, for drafters that read its outputs off the accepted path)."""
    return ReplayRunner(prompt_ids, reference, hidden, model).run(drafter, eos_token_ids)
