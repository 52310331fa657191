"""The back-off: how many plain rounds to take once drafting stops paying, before trying again."""

from __future__ import annotations

# verdicts in a row that asking pays per halving of the next back-off: one burst lifts the goodput
# average for several rounds, and each of them is a verdict
WINS_PER_HALVING = 3


class Backoff:
    """Plain rounds after drafting stopped paying: 1, 2, 4, ... ``max_backoff`` (a drafter that
    becomes good again is noticed within that many rounds), grown past it, up to 8 times it, until
    a probe's loss is at most ``exploration`` of the rounds between probes. The controller, the
    batch verdicts and ``auto``'s model gate all back off this way."""

    def __init__(self, max_backoff: int, exploration: float, patient: bool = False):
        self.max_backoff = max_backoff
        self.exploration = exploration
        # patient: a win halves the next back-off once per WINS_PER_HALVING wins in a row (the
        # controller's); otherwise a win starts it again at one round (the batch verdicts and auto's
        # model gates: patience there would keep costly drafters off for rounds where they pay)
        self.patient = patient
        self.length = 1  # the next back-off's rounds
        self.wins = 0  # verdicts in a row that asking pays
        self.losses: list[float] = []  # plain rounds each recent drafting round lost (negative: gained)

    def note(self, loss: float, fresh: bool, keep: int) -> None:
        """A drafting round's loss; ``fresh``: a probe's (the rounds before the back-off are forgotten)."""
        self.losses = (([] if fresh else self.losses) + [loss])[-keep:]

    def lost(self) -> int:
        """Drafting does not pay: the rounds to go plain now (and the next back-off doubled, capped)."""
        rounds, self.wins = self.length, 0
        cap = max(self.max_backoff, min(8 * self.max_backoff, round(sum(self.losses) / self.exploration)))
        self.length = min(2 * self.length, cap)
        return rounds

    def won(self) -> None:
        """Drafting paid on the evidence so far. Patient: every ``WINS_PER_HALVING`` such verdicts in
        a row halve the next back-off, so rounds that keep paying bring it back to one round, and
        one probe that a burst made look good does not restart the ramp 1, 2, 4, ...: a drafter
        whose probes verify dear trees (a lookahead window at T=1) and now and then catch a
        lucky round would otherwise be asked in most rounds at a loss."""
        self.wins += 1
        if not self.patient:
            self.length = 1
        elif self.wins % WINS_PER_HALVING == 0:
            self.length = max(1, self.length // 2)

    def reset(self) -> None:
        """A new request whose prompt decides what drafting gives: back-offs start at one round (a
        back-off carried over from the last request would keep a drafter off in the requests
        where it pays)."""
        self.length, self.wins = 1, 0
