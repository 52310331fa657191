"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024): the target drafts for itself, no draft model.

One target forward carries both of the paper's branches as ONE token tree below the last
committed token (the root), so the shared verifier and cache ops do everything else:

- **lookahead branch**: a 2D Jacobi window of W columns and up to N - 1 levels. Level 0 is a chain
  of W guessed tokens continuing the text; the token at level l, column j hangs below level l - 1,
  column j. So it sees the text, level 0 up to column j and its own column above it, and sits at
  position ``root + 1 + j + l``: each column is a guessed continuation, one token per level. The
  target's argmax after a column's top token is one Jacobi step for that column. It becomes the
  new top level; once N - 1 levels exist the oldest is dropped each step, and each column's tokens
  (level 0 .. top, then the new token) form an n-gram that goes into the pool under its first
  token. Level 0 starts as tokens drawn from the text (LADE's initialisation); the window moves
  one level per step, as LADE's does.
- **verification branch**: up to G (``guess_set_size``) pool phrases starting after the root, each
  a chain below it (repeated prefixes are merged by the tree builder).

The verifier walks the whole tree, so a pool phrase or the window's own level 0 may be accepted.
Lossless for greedy decoding and sampling alike: every branch is deterministic, verified by the
sample-and-match rule. The pool is :class:`~speculum.drafters.phrase_pool.PhrasePool` (per-key
LRU of capacity G, as LADE's ``token_map``); ``persist``/``pool_path`` keep it across requests
(LADE starts each request empty), ``pool_from_prompt`` seeds it with the prompt's n-grams
(LADE's ``POOL_FROM_PROMPT``).

Cost: the tree has W·(N-1) + G·(N-1) nodes (56 with LADE's defaults N=5, W=7, G=7). That is
cheap on a GPU; on a CPU verification cost grows past ~8 tokens, so small windows pay better
there (see docs/methods/lookahead.md).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, Resources, check_options, check_tree_size
from speculum.drafters.phrase_pool import DEFAULT_MAX_KEYS, PhrasePool
from speculum.errors import InvalidInputError, PoolFileError

__all__ = ["JacobiWindow", "LookaheadDrafter", "Options"]


@dataclass
class Options:
    """Parameters of the ``lookahead`` method (LADE's W, N, G)."""

    window_size: int = 7  # W: Jacobi window columns (LADE WINDOW_SIZE)
    ngram_size: int = 5  # N: n-gram length, key included; the window has N - 1 levels (LADE LEVEL)
    guess_set_size: int = 7  # G: phrases kept per key, and most guesses verified per step (LADE GUESS_SET_SIZE)
    pool_from_prompt: bool = False  # seed the pool with the prompt's n-grams (LADE POOL_FROM_PROMPT)
    persist: bool = False  # keep the pool across requests
    pool_path: str | None = None  # load at construction if present; default path of save()
    max_pool_keys: int = DEFAULT_MAX_KEYS

    def __post_init__(self) -> None:
        ints = {"window_size": 1, "ngram_size": 2, "guess_set_size": 0, "max_pool_keys": 1}
        check_options("lookahead", self, ints, ("pool_from_prompt", "persist"), path="pool_path")
        levels = self.ngram_size - 1
        nodes = (self.window_size + self.guess_set_size) * levels
        check_tree_size("lookahead", nodes, f"window W*(N-1) + guesses G*(N-1) = {nodes}")


class JacobiWindow:
    """The lookahead branch: ``width`` columns, up to ``max_levels`` levels (see the module docstring).

    Used by the ``lookahead`` drafter over the target and by Ouroboros over its draft model.
    """

    def __init__(self, width: int, max_levels: int, seed: int = 10):
        self.width = width
        self.max_levels = max_levels
        self.seed = seed
        self.levels: list[list[int]] = []
        self.grid: list[list[int]] = []  # draft node index of (level, column) in the last draft
        self._source: Sequence[int] = ()
        self._rng = random.Random(seed)

    def reset(self, text: Sequence[int]) -> None:
        """A new sequence: level 0 drawn from ``text`` (read live: later draws see later tokens)."""
        self._rng.seed(self.seed)
        self._source = text
        self.levels = [self._fresh(self.width)]

    def _fresh(self, n: int) -> list[int]:
        return [self._rng.choice(self._source) for _ in range(n)] if self._source else [0] * n

    def add_to(self, tokens: list[int], parents: list[int], root: int = -1) -> None:
        """Append the window's nodes to a draft (``root``: the draft node they hang below)."""
        self.grid = []
        for level, row in enumerate(self.levels):
            ids = []
            for column, token in enumerate(row):
                if level == 0:
                    parent = root if column == 0 else ids[-1]
                else:
                    parent = self.grid[level - 1][column]
                ids.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
            self.grid.append(ids)

    @property
    def top_nodes(self) -> list[int]:
        """Draft nodes of the top level: the model's output after each gives the next Jacobi level."""
        return self.grid[-1] if self.grid else []

    def step(self, outputs: list[int] | None) -> list[tuple[int, tuple[int, ...]]]:
        """One Jacobi step: ``outputs`` (the model's token after each top-level node; None when they
        are not available) becomes the new top level, and once the window is full its oldest level
        goes. Returns the completed column n-grams as ``(key, phrase)``.

        As in LADE, the window moves one level per step whatever the verifier accepted: every
        column stays a trajectory of the model (each level computed from the column below), which
        is what makes its n-grams worth keeping; refilling columns with fresh tokens to re-align
        positions after a long acceptance would break exactly that."""
        if outputs is None:
            return []
        ngrams: list[tuple[int, tuple[int, ...]]] = []
        if len(self.levels) == self.max_levels:
            for j in range(self.width):
                column = [row[j] for row in self.levels] + [outputs[j]]
                ngrams.append((column[0], tuple(column[1:])))
        self.levels.append(list(outputs))
        if len(self.levels) > self.max_levels:
            del self.levels[0]
        return ngrams


class LookaheadDrafter(Drafter):
    """Lookahead decoding over the target itself (see the module docstring)."""

    name: ClassVar[str] = "lookahead"
    Options: ClassVar[type] = Options
    prunable = False  # the window moves by the target's output at every one of its nodes

    def __init__(self, options: Options | None = None, resources: Resources | None = None, *, pool=None):
        self.options = options = Options() if options is None else options
        self.model_key = resources.model_key if resources is not None else ""
        self._persist = options.persist or options.pool_path is not None or pool is not None
        if pool is None and options.pool_path is not None and os.path.exists(options.pool_path):
            pool = PhrasePool.load(
                options.pool_path, model_key=self.model_key, capacity=self._capacity, max_keys=options.max_pool_keys
            )
        elif pool is not None and not isinstance(pool, PhrasePool):
            raise InvalidInputError("lookahead: pool must be a PhrasePool")
        self.pool = pool if pool is not None else self._new_pool()
        self.window = JacobiWindow(options.window_size, options.ngram_size - 1)

    @property
    def _capacity(self) -> int:
        return max(self.options.guess_set_size, 1)

    def _new_pool(self) -> PhrasePool:
        return PhrasePool(self._capacity, self.options.max_pool_keys)

    def start(self, ctx: DraftContext) -> None:
        if not self._persist:
            self.pool = self._new_pool()
        if self.options.pool_from_prompt:
            self.pool.add_ngrams(ctx.tokens, self.options.ngram_size - 1)
        self.window.reset(ctx.tokens)

    def propose(self, ctx: DraftContext) -> Draft | None:
        tokens: list[int] = []
        parents: list[int] = []
        self.window.add_to(tokens, parents)
        for phrase in self.pool.get(ctx.tokens[-1], self.options.guess_set_size):
            parent = -1
            for token in phrase:
                parents.append(parent)
                parent = len(tokens)
                tokens.append(token)
        return Draft(tokens, parents)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        outputs = None
        if outcome.draft is not None and outcome.target is not None:
            outputs = outcome.target.argmax_of(self.window.top_nodes)  # None where a node was cut
            if any(o is None for o in outputs):
                outputs = None
        self.pool.add_all(self.window.step(outputs))

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the phrase pool (default: ``pool_path``) atomically."""
        path = path if path is not None else self.options.pool_path
        if path is None:
            raise PoolFileError("lookahead: no path given and no pool_path set")
        self.pool.save(path, model_key=self.model_key)
