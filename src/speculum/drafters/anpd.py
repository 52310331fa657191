"""ANPD: Adaptive N-gram Parallel Decoding (Ou, Chen, Tian, NAACL 2024), plus improvements.

Faithful part (``adaptive=False, tree=False``): a multi-level n-gram table (levels
``n = 2..max_ngram_size``) is built from the prompt's token ids and updated with every committed
token (``runtime_update``). A draft is made by querying the table autoregressively
``num_speculative_tokens`` times from the last ``n - 1`` committed tokens, the largest ``n``
first (first hit wins; ``multi_level=False`` keeps only ``n = max_ngram_size``); drafting stops
early when no level matches, and an empty draft is a plain decode step. The table itself is
:class:`~speculum.drafters.ngram_table.NgramTable` (its docstring gives the deterministic
tie-break, higher count then most recent occurrence, and the eviction policy).

Additions:

- ``tree=True``: propose a token tree instead of a chain (top ``tree_top_k`` continuations at each
  node, best-first by estimated path probability, at most ``max_tree_nodes`` nodes).
- ``adaptive=True`` (default):
  * weak evidence stops the draft: a continuation seen fewer than ``min_count`` times, or holding
    less than ``min_agreement`` of its context's total count, is not proposed (nor anything after
    it);
  * the draft length follows recent acceptance: full acceptance of the last draft -> K += 2 (up
    to ``num_speculative_tokens``), nothing accepted -> K halves, partial acceptance -> K stays
    (verifying a few more tokens costs little once weights are prepacked, and shrinking on
    every partial acceptance would lose long copy runs; see docs/results.md); K never drops below 1.
  * a draft never continues past an EOS token.
  On text with nothing to copy the table rarely matches, so most steps are plain decode steps.
- ``persist=True``: the table is kept across requests (``start`` adds each new prompt to it),
  can be shared by passing ``table=`` and saved with :meth:`AnpdDrafter.save`. ``pool_path``
  (implies ``persist``) is loaded at construction when the file exists. Files are tied to
  ``model_key`` (the caller's tokenizer/vocabulary identity, e.g. a hash of the vocab).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, Resources, check_options, check_tree_size
from speculum.drafters.ngram_table import DEFAULT_MAX_ENTRIES, NgramTable
from speculum.errors import InvalidInputError, PoolFileError

__all__ = ["AnpdDrafter", "Options"]


@dataclass
class Options:
    """Parameters of the ``anpd`` method (names as in transformers / vLLM)."""

    num_speculative_tokens: int = 7  # K: longest draft (tree depth)
    max_ngram_size: int = 5  # N: largest n-gram (contexts of N - 1 tokens)
    runtime_update: bool = True  # add committed tokens to the table while generating
    multi_level: bool = True  # levels 2..N (False: only N)
    tree: bool = False  # propose a token tree instead of a chain
    tree_top_k: int = 3  # children per tree node at most
    max_tree_nodes: int = 16  # tree size budget
    adaptive: bool = True  # evidence thresholds + acceptance-driven draft length
    min_count: int = 1  # adaptive: least count for a proposed continuation
    min_agreement: float = 0.1  # adaptive: least count(best) / total count of its context
    max_entries: int = DEFAULT_MAX_ENTRIES  # table size cap (contexts, all levels)
    persist: bool = False  # keep the table across requests
    pool_path: str | None = None  # load at construction if present; default path of save()

    def __post_init__(self) -> None:
        ints = {
            "num_speculative_tokens": 1,
            "max_ngram_size": 2,
            "tree_top_k": 1,
            "max_tree_nodes": 1,
            "min_count": 1,
            "max_entries": 1,
        }
        bools = ("runtime_update", "multi_level", "tree", "adaptive", "persist")
        check_options("anpd", self, ints, bools, path="pool_path")
        if self.tree:
            check_tree_size("anpd", self.max_tree_nodes, "max_tree_nodes")
        check_tree_size("anpd", self.num_speculative_tokens, "num_speculative_tokens")
        agreement = self.min_agreement
        if isinstance(agreement, bool) or not isinstance(agreement, (int, float)):
            raise InvalidInputError(f"anpd: min_agreement must be a number, got {agreement!r}")
        if not 0.0 <= agreement <= 1.0:
            raise InvalidInputError(f"anpd: min_agreement must be in [0, 1], got {agreement}")

    @property
    def min_ngram_size(self) -> int:
        return 2 if self.multi_level else self.max_ngram_size


class AnpdDrafter(Drafter):
    """Adaptive multi-level n-gram drafter (see the module docstring).

    ``AnpdDrafter(options, resources, *, table=None)``: ``resources.model_key`` identifies the
    tokenizer/vocabulary for pool files; ``table`` shares an existing :class:`NgramTable` across
    drafters (implies persistence; its levels must match the options).
    """

    name: ClassVar[str] = "anpd"
    Options: ClassVar[type] = Options

    def __init__(
        self,
        options: Options | None = None,
        resources: Resources | None = None,
        *,
        table: NgramTable | None = None,
    ) -> None:
        options = Options() if options is None else options
        if not isinstance(options, Options):
            raise InvalidInputError(f"anpd: expected anpd Options, got {type(options).__name__}")
        model_key = resources.model_key if resources is not None else ""
        self.options = options
        self.model_key = model_key
        self._persist = options.persist or options.pool_path is not None or table is not None
        if table is not None:
            if not isinstance(table, NgramTable):
                raise InvalidInputError("anpd: table must be an NgramTable")
            if (table.min_n, table.max_n) != (options.min_ngram_size, options.max_ngram_size):
                raise InvalidInputError(
                    f"anpd: shared table has levels {table.min_n}..{table.max_n}, options ask for "
                    f"{options.min_ngram_size}..{options.max_ngram_size}"
                )
        elif options.pool_path is not None and os.path.exists(options.pool_path):
            table = NgramTable.load(options.pool_path, model_key=model_key, max_entries=options.max_entries)
            if (table.min_n, table.max_n) != (options.min_ngram_size, options.max_ngram_size):
                raise PoolFileError(
                    f"{str(options.pool_path)!r} holds n-gram levels {table.min_n}..{table.max_n}"
                    f", options ask for {options.min_ngram_size}..{options.max_ngram_size}"
                )
        self._table = table if table is not None else self._new_table()
        self._ingested = 0  # positions of the current request's sequence already in the table
        self._k = options.num_speculative_tokens  # current adaptive draft length
        self._last_depth = 0  # depth of the last non-empty draft

    def _new_table(self) -> NgramTable:
        o = self.options
        return NgramTable(max_n=o.max_ngram_size, min_n=o.min_ngram_size, max_entries=o.max_entries)

    @property
    def table(self) -> NgramTable:
        return self._table

    @property
    def current_k(self) -> int:
        """The draft length the next proposal may use (before ``ctx.max_depth``)."""
        return self._k if self.options.adaptive else self.options.num_speculative_tokens

    # ------------------------------------------------------------------ protocol

    def start(self, ctx: DraftContext) -> None:
        """A new request: a fresh table from the prompt (or the prompt added, if persistent)."""
        if not self._persist:
            self._table = self._new_table()
        self._table.add_sequence(ctx.tokens)
        self._ingested = len(ctx.tokens)
        self._k = self.options.num_speculative_tokens
        self._last_depth = 0

    def _sync(self, tokens: list[int]) -> None:
        """Ingest exactly the committed tokens not yet in the table (never one twice).

        ``tokens`` is the request's whole committed sequence; ``self._ingested`` positions of it
        are already counted, so only n-grams ending at the new positions are added (their
        contexts may reach back into the old ones).
        """
        n = len(tokens)
        if n > self._ingested:
            if self.options.runtime_update:
                self._table.add_sequence(tokens, start=self._ingested)
            self._ingested = n
        elif n < self._ingested:  # the sequence shrank: not one we have been following
            self._ingested = n

    def propose(self, ctx: DraftContext) -> Draft | None:
        """A chain (or tree) below ``ctx.tokens[-1]``; reads the table, never changes it."""
        o = self.options
        depth = min(self.current_k, ctx.max_depth)
        if depth < 1:
            return None
        if o.adaptive:
            min_count, min_agreement, stops = o.min_count, o.min_agreement, ctx.eos_token_ids
        else:
            min_count, min_agreement, stops = 1, 0.0, frozenset()
        # each token's share of its context's count: what a controller reads as the drafter's belief
        agreement: list[float] | None = [] if ctx.wants_scores else None
        if o.tree:
            tokens, parents, reached = self._table.draft_tree(
                ctx.tokens,
                depth,
                o.max_tree_nodes,
                o.tree_top_k,
                min_count=min_count,
                min_agreement=min_agreement,
                stop_tokens=stops,
                agreement=agreement,
            )
            if not tokens:
                return None
            self._last_depth = reached
            return Draft(tokens, parents, scores=agreement)
        tokens = self._table.draft_chain(
            ctx.tokens, depth, min_count=min_count, min_agreement=min_agreement, stop_tokens=stops, agreement=agreement
        )
        if not tokens:
            return None
        self._last_depth = len(tokens)
        return Draft.chain(tokens, scores=agreement)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        """Add the newly committed tokens to the table; adapt the draft length."""
        self._sync(ctx.tokens)
        if not self.options.adaptive or outcome.drafted <= 0:
            return
        accepted = len(outcome.accepted)
        k_max = self.options.num_speculative_tokens
        if accepted >= self._last_depth:
            self._k = min(k_max, self._k + 2)
        elif accepted == 0:
            self._k = max(1, self._k // 2)

    def finish(self, ctx: DraftContext) -> None:
        """The request is over: the tokens of its last step reach the table too (observe never saw them)."""
        self._sync(ctx.tokens)

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Save the table (atomically) to ``path`` or ``options.pool_path``."""
        path = self.options.pool_path if path is None else path
        if path is None:
            raise InvalidInputError("anpd: save() needs a path (or options.pool_path)")
        self._table.save(path, model_key=self.model_key)
