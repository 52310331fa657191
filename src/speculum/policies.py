"""Length policies: how far an autoregressive drafter goes this round.

Any policy works with any autoregressive drafter (draft model, self-draft, ...). A policy
answers two questions: how many tokens at most this round (``budget``, called once at the start
of each round) and, after each drafted token, whether to stop early (``should_stop``, which sees
a :class:`DraftStep`: the token, the draft's logits and distribution, and, for policies that set
``needs_hidden``, the draft's last hidden state), then learns from the verifier (``update``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum.errors import InvalidInputError

POLICIES = ("fixed", "heuristic", "confidence")


@dataclass
class DraftStep:
    """One drafted token, as a length policy sees it."""

    position: int  # 0 for the first token of this round's draft
    token: int
    logits: torch.Tensor  # [vocab]: the draft's logits that produced ``token``
    probs: torch.Tensor | None = None  # the warped distribution ``token`` was sampled from (None when greedy)
    hidden: torch.Tensor | None = None  # [hidden]: the draft's last hidden state at the position that gave
    # ``logits`` (its input was the previous token); only for policies with needs_hidden

    @property
    def confidence(self) -> float:
        """The draft's probability of its own token."""
        dist = self.probs if self.probs is not None else torch.softmax(self.logits.float(), dim=-1)
        return float(dist[self.token])


class LengthPolicy:
    needs_hidden = False  # whether should_stop() reads DraftStep.hidden (the drafter then computes it)

    def __init__(self, num_speculative_tokens: int):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise InvalidInputError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.initial = num_speculative_tokens
        self.length = num_speculative_tokens

    def reset(self) -> None:
        self.length = self.initial

    def budget(self, max_depth: int) -> int:
        return min(self.length, max_depth)

    def should_stop(self, step: DraftStep) -> bool:
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

    def __init__(self, num_speculative_tokens: int, threshold: float = 0.4):
        super().__init__(num_speculative_tokens)
        if not 0.0 <= threshold < 1.0:
            raise InvalidInputError(f"confidence_threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold

    def should_stop(self, step: DraftStep) -> bool:
        return step.confidence < self.threshold


def make_policy(name: str, num_speculative_tokens: int, confidence_threshold: float = 0.4) -> LengthPolicy:
    if name == "fixed":
        return FixedLength(num_speculative_tokens)
    if name == "heuristic":
        return HeuristicLength(num_speculative_tokens)
    if name == "confidence":
        return ConfidenceStop(num_speculative_tokens, confidence_threshold)
    raise InvalidInputError(f"unknown length policy {name!r}; choose one of {', '.join(POLICIES)}")
