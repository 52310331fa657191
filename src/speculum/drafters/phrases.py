"""Ouroboros' context and history phrases without its draft model: a chain read from the phrase pool.

The pool is Ouroboros' and LADE's (:class:`~speculum.drafters.phrase_pool.PhrasePool`: key token ->
the newest phrases of N - 1 tokens that followed it). It gets every n-gram of the prompt and of the
committed output (Ouroboros' ``context_phrases``), and one pool serves every request of its owner
(Ouroboros' ``reuse_history``), so a phrase seen in one request is drafted in the next. Without a
draft model to check phrases, a round takes the phrase whose context matches two tokens where one
exists (a phrase under the second-to-last token that starts with the last one), else the newest
phrase under the last token, and repeats from the chain's own end while room is left. Phrases carry
no score: the controller calibrates them by depth (their source is ``phrases``, as Ouroboros' are).

Lossless as every drafter: the verifier decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, check_options, check_tree_size
from speculum.drafters.phrase_pool import DEFAULT_MAX_KEYS, PhrasePool

__all__ = ["Options", "PhrasesDrafter"]


@dataclass
class Options:
    num_speculative_tokens: int = 8  # the longest chain a round
    ngram_size: int = 5  # N: phrases are N - 1 tokens after their key (Ouroboros' default)
    guess_set_size: int = 15  # G: phrases kept per key (Ouroboros' default)
    max_pool_keys: int = DEFAULT_MAX_KEYS

    def __post_init__(self) -> None:
        check_options(
            "phrases", self, {"num_speculative_tokens": 1, "ngram_size": 2, "guess_set_size": 1, "max_pool_keys": 1}
        )
        check_tree_size("phrases", self.num_speculative_tokens, "num_speculative_tokens")

    @property
    def phrase_length(self) -> int:
        return self.ngram_size - 1


class PhrasesDrafter(Drafter):
    name = "phrases"

    def __init__(self, options: Options | None = None, pool: PhrasePool | None = None):
        """``pool``: one shared with other requests' drafters (their history); None: a pool of its own."""
        self.options = options = Options() if options is None else options
        self.pool = pool if pool is not None else PhrasePool(options.guess_set_size, options.max_pool_keys)
        self._added = 0  # keys of the context up to here are in the pool

    def start(self, ctx: DraftContext) -> None:
        self._added = 0
        self._add_context(ctx.tokens)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        self._add_context(ctx.tokens)

    def _add_context(self, tokens: list[int]) -> None:
        length = self.options.phrase_length
        self.pool.add_ngrams(tokens, length, start=self._added)
        self._added = max(self._added, len(tokens) - length)

    def _next_phrase(self, before: int | None, last: int) -> tuple[int, ...]:
        if before is not None:
            for phrase in self.pool.get(before):
                if phrase[0] == last and len(phrase) > 1:
                    return phrase[1:]
        newest = self.pool.get(last, 1)
        return newest[0] if newest else ()

    def propose(self, ctx: DraftContext) -> Draft | None:
        room = min(self.options.num_speculative_tokens, ctx.max_depth)
        chain: list[int] = []
        context = ctx.tokens[-2:]
        while len(chain) < room:
            tail = (context + chain)[-2:]
            phrase = self._next_phrase(tail[0] if len(tail) == 2 else None, tail[-1])
            if not phrase:
                break
            for token in phrase[: room - len(chain)]:
                if token in ctx.eos_token_ids:
                    return Draft.chain(chain) if chain else None
                chain.append(token)
        return Draft.chain(chain) if chain else None
