"""Goodput: committed tokens per second of the rounds a decision is judged on."""

from __future__ import annotations

# weight of a round in the catch-up rule's memory of what drafting gives (about 30 rounds; the
# verdicts to draft or not weigh one by 0.15, about 7). A drafter is stopped right after a window of
# rounds that lost, and a catch-up rule reading that very window would keep a draft model off for
# whole requests where it pays
LONG_SMOOTHING = 0.03


class Goodput:
    """Committed tokens and seconds per round, averaged evenly over the first ``min_evidence`` rounds
    of a fresh start and as moving averages after (their ratio is the goodput). The controller keeps
    one for the rounds that asked the drafter; ``auto`` one each for rounds with and without its
    costly drafters."""

    def __init__(self, smoothing: float = 0.15, min_evidence: int = 3):
        self.smoothing = smoothing
        self.min_evidence = min_evidence
        self.tokens: float | None = None
        self.seconds = 0.0
        self.rounds = 0  # since the last fresh start

    def add(self, tokens: float, seconds: float, fresh: bool = False, rows: int = 1) -> None:
        """One round's tokens and seconds; ``rows`` > 1: the mean of that many rows' rounds taken
        together (a batch), each a sample (rows acceptance does not tie together)."""
        for i in range(rows):
            if (fresh and i == 0) or self.tokens is None:
                self.tokens, self.seconds, self.rounds = float(tokens), seconds, 1
                continue
            self.rounds += 1
            weight = 1.0 / self.rounds if self.rounds <= self.min_evidence else self.smoothing
            self.tokens += weight * (tokens - self.tokens)
            self.seconds += weight * (seconds - self.seconds)

    @property
    def judged(self) -> bool:
        """Enough rounds since the fresh start for a verdict (acceptance comes in bursts)."""
        return self.rounds >= self.min_evidence

    @property
    def rate(self) -> float | None:
        return None if self.tokens is None else self.tokens / max(self.seconds, 1e-9)
