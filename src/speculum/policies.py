"""Length policies: how far an autoregressive drafter goes this round.

Any policy works with any autoregressive drafter (draft model, self-draft, ...). A policy
answers two questions: how many tokens at most this round (``budget``) and, after each drafted
token, whether to stop early (``should_stop``), then learns from the verifier (``update``).
"""

from __future__ import annotations

from speculum.errors import InvalidInputError

POLICIES = ("fixed", "heuristic", "confidence")


class LengthPolicy:
    uses_confidence = False  # whether should_stop() needs the draft's probability of its token

    def __init__(self, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise InvalidInputError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.initial = num_speculative_tokens
        self.length = num_speculative_tokens

    def reset(self) -> None:
        self.length = self.initial

    def budget(self, max_depth: int) -> int:
        return min(self.length, max_depth)

    def should_stop(self, draft_confidence: float) -> bool:
        return False

    def update(self, accepted: int, drafted: int) -> None:
        pass


class FixedLength(LengthPolicy):
    """Always K tokens."""


class HeuristicLength(LengthPolicy):
    """transformers' schedule: +2 after a fully accepted draft, -1 (not below 1) otherwise."""

    def update(self, accepted: int, drafted: int) -> None:
        if drafted and accepted == drafted:
            self.length += 2
        else:
            self.length = max(1, self.length - 1)


class ConfidenceStop(LengthPolicy):
    """Up to K tokens; stop as soon as the draft's probability of its own token falls below a threshold.

    (transformers' ``assistant_confidence_threshold``.) The threshold is not adapted.
    """

    uses_confidence = True

    def __init__(self, num_speculative_tokens: int, threshold: float = 0.4):
        super().__init__(num_speculative_tokens)
        if not 0.0 <= threshold < 1.0:
            raise InvalidInputError(f"confidence_threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold

    def should_stop(self, draft_confidence: float) -> bool:
        return draft_confidence < self.threshold


def make_policy(name: str, num_speculative_tokens: int, confidence_threshold: float = 0.4) -> LengthPolicy:
    if name == "fixed":
        return FixedLength(num_speculative_tokens)
    if name == "heuristic":
        return HeuristicLength(num_speculative_tokens)
    if name == "confidence":
        return ConfidenceStop(num_speculative_tokens, confidence_threshold)
    raise InvalidInputError(f"unknown length policy {name!r}; choose one of {', '.join(POLICIES)}")
