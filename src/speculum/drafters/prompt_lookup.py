"""Prompt lookup decoding, as transformers does it (``prompt_lookup_num_tokens``).

Find the last n tokens (n = ``max_matching_ngram_size`` down to 1) earlier in the sequence
(prompt + generated), take the earliest match that has a continuation, and propose the next
``num_speculative_tokens`` tokens after it, cut before an end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speculum.drafters.base import Draft, DraftContext, Drafter, Resources, check_tree_size
from speculum.errors import InvalidInputError


@dataclass
class Options:
    num_speculative_tokens: int = 10  # transformers' prompt_lookup_num_tokens
    max_matching_ngram_size: int = 2  # transformers' default

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise InvalidInputError("num_speculative_tokens must be >= 1")
        if self.max_matching_ngram_size < 1:
            raise InvalidInputError("max_matching_ngram_size must be >= 1")
        check_tree_size("prompt_lookup", self.num_speculative_tokens, "num_speculative_tokens")


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"

    def __init__(self, options: Options, resources: Resources | None = None):
        self.options = options

    def propose(self, ctx: DraftContext) -> Draft | None:
        sequence = np.asarray(ctx.tokens)
        length = len(sequence)
        for n in range(min(self.options.max_matching_ngram_size, length - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(sequence, n)
            starts = np.flatnonzero((windows == sequence[-n:]).all(axis=1)) + n
            starts = starts[starts < length]  # the trailing self-match has no continuation
            if starts.size:
                first = int(starts[0])
                proposal = sequence[first : first + min(self.options.num_speculative_tokens, ctx.max_depth)].tolist()
                for i, token in enumerate(proposal):
                    if token in ctx.eos_token_ids:
                        proposal = proposal[:i]
                        break
                return Draft.chain(proposal) if proposal else None
        return None
