"""Exact replay: the greedy acceptance a drafter gets, without running the target at every step.

Greedy verification accepts exactly the draft tokens that equal the target's greedy output. Once
that output (the *reference*) is recorded, the engine's own loop runs with the target replaced by
it: a tree node is *on the reference path* when it and all its ancestors hold the reference tokens
at their positions, the target's argmax there is the next reference token, and the verifier reads
only such nodes. So a deterministic drafter (n-gram, prompt lookup, a greedy draft model) gets,
without a target forward, the very acceptance of a real greedy run (timings aside). Used for
acceptance-only studies over many prompts and settings (``speculum tune`` and the studies in
docs/history/studies.md).

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

A seeded sampled request replays the same way. Its text is a function of the seed alone, whatever
is drafted (:class:`~speculum.sampling.PositionNoise`), and a draft token is accepted exactly when
it is the text's token at its position: with ``reference`` the text plain sampling gave with that
seed, :meth:`ReplayRunner.run` given the sampling and the seed runs the drafter with that seed's
noise (a draft model samples its chain by it, as in the real run) and the verifier chooses, at
each node on the reference path, the reference's next token (a row that puts all its mass there).
"""

from __future__ import annotations

import math
import time

import torch

from speculum import cache as cache_ops
from speculum import engine
from speculum.drafters.base import Drafter
from speculum.errors import ReplayError
from speculum.runner import LazyLogits, ModelRunner, StepOutput, with_cache
from speculum.sampling import PositionNoise, SamplingParams
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
        vocab_size: int | None = None,
    ):
        self.sequence = list(prompt_ids) + list(reference)
        self.prompt_length = len(prompt_ids)
        self.hidden = hidden  # [len(sequence) (or one less), hidden size], for drafters that read it
        self.target = ModelRunner(model) if isinstance(model, torch.nn.Module) else model
        self.target_cache = None  # the target's keys/values over the whole sequence, once made
        self.target_forwards = 0  # forwards of the target so far (the prefill included)
        self.target_time = 0.0  # seconds they took
        if vocab_size is None and self.target is not None:
            vocab_size = self.target.model.config.get_text_config().vocab_size
        self.vocab_size = vocab_size  # the width of the target's rows (a sampled replay writes whole rows)
        self.sampled = False  # whether the run in progress is a seeded sampled one
        self.sequence_argmax: list[int] | None = None  # the target's argmax at each position (sampled)

    def run(
        self,
        drafter: Drafter,
        eos_token_ids=frozenset(),
        sampling: SamplingParams | None = None,
        seed: int | None = None,
    ) -> Stats:
        """The acceptance statistics ``drafter`` gets on this prompt: greedy, or under ``sampling``
        with ``seed`` when the reference is the text plain sampling gave with that seed.

        The timings leave out the target's forwards: they compute rows that a real run's
        verification forward gives for free (they would otherwise count as drafting time, since
        drafters read those rows in ``observe``)."""
        sampling = sampling or SamplingParams()
        noise = None
        if not sampling.greedy:
            if seed is None:
                raise ReplayError("a sampled run replays only with its seed (the reference is that seed's text)")
            if self.vocab_size is None:
                raise ReplayError("a sampled replay writes the target's rows: give model= or vocab_size=")
            device = self.target.output_device if self.target is not None else torch.device("cpu")
            noise = PositionNoise(torch.Generator(device=device).manual_seed(seed))  # as speculum.load's requests
        stats = Stats()
        reference_length = len(self.sequence) - self.prompt_length
        prompt = self.sequence[: self.prompt_length]
        spent = self.target_time
        self.sampled = noise is not None
        generator = noise.generator if noise is not None else None
        steps = engine.run(
            self, prompt, drafter, sampling, reference_length, eos_token_ids, generator, stats, None, noise
        )
        for _ in steps:
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

    def _require_target(self) -> None:
        if self.target is None:
            raise ReplayError(
                "this drafter reads the target's outputs off the accepted path (lookahead's window, "
                "Ouroboros' verification phrases), which the recorded output does not hold: replay it with model="
            )

    @torch.inference_mode()
    def _cache_the_sequence(self) -> None:
        """The target's cache over prompt + reference (one forward, once); in a sampled replay also
        its argmax at every position, which drafters read on the path and the reference does not
        hold (it holds the sampled tokens)."""
        if self.target_cache is not None and (self.sequence_argmax is not None or not self.sampled):
            return
        start = time.perf_counter()
        cache = self.target.new_cache()
        states = self.target.prefill(cache, self.sequence, hidden=self.sampled)
        if self.target_cache is None:
            self.target_cache = cache
        if self.sampled:
            head = self.target.model.get_output_embeddings()
            argmax = [head(chunk).argmax(dim=-1).cpu() for chunk in states.split(64)]  # (not all rows at once)
            self.sequence_argmax = torch.cat(argmax).tolist()
        self.target_forwards += 1
        self.target_time += time.perf_counter() - start

    def argmax_at(self, position: int) -> int:
        """The target's argmax after the sequence's first ``position + 1`` tokens (sampled replays)."""
        self._require_target()
        self._cache_the_sequence()
        return self.sequence_argmax[position]

    @torch.inference_mode()
    def off_path_argmax(self, tree: TokenTree, root: int, on_path: list[bool]) -> dict[int, int]:
        """The target's argmax after each node of ``tree`` not on the reference path, from one forward."""
        self._require_target()
        start = time.perf_counter()
        target, past = self.target, len(self.sequence)
        self._cache_the_sequence()
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
        self.next_token: dict[int, int] = {}  # node on the reference path -> the reference's next token
        on_path = []
        for node, (token, depth) in enumerate(zip(tree.tokens, tree.depth, strict=True)):
            position = root + depth
            # (a node at the last position has no recorded successor: it counts as off the path)
            on = position < last and sequence[position] == token and (node == 0 or on_path[tree.parents[node]])
            on_path.append(on)
            if on:
                self.next_token[node] = sequence[position + 1]
        self.on_path = on_path
        # node -> the target's argmax after it: greedy, the reference's next token on its path
        self.best: dict[int, int] = {} if runner.sampled else dict(self.next_token)

    def __len__(self) -> int:
        return len(self.tree)

    def _argmax(self, node: int) -> int:
        if node not in self.best:
            if self.on_path[node]:  # (sampled: the reference holds the sampled token, not the argmax)
                self.best[node] = self.runner.argmax_at(self.root + self.tree.depth[node])
            else:
                self.best.update(self.runner.off_path_argmax(self.tree, self.root, self.on_path))
        return self.best[node]

    def __getitem__(self, node: int) -> _ReplayRow | torch.Tensor:
        if self.runner.sampled:  # for the sampled verifier, which warps the row: all its mass on the text's token
            row = torch.full((self.runner.vocab_size,), -math.inf)
            row[self.next_token[node] if node in self.next_token else self._argmax(node)] = 0.0
            return row
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
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    vocab_size: int | None = None,
) -> Stats:
    """The acceptance statistics ``drafter`` would get on a prompt whose greedy output (or, with
    ``sampling`` and ``seed``, whose seeded sampled text) is ``reference`` (``hidden``: the target's
    states over both, for drafters that read them; ``model``: the target, for drafters that read its
    outputs off the accepted path, and the width of its rows for a sampled replay, else ``vocab_size``)."""
    runner = ReplayRunner(prompt_ids, reference, hidden, model, vocab_size)
    return runner.run(drafter, eos_token_ids, sampling, seed)
