"""Batches: whether a configuration's rows draft this step, one verdict per batch size."""

from __future__ import annotations

import copy

from speculum.controller.backoff import Backoff
from speculum.controller.goodput import Goodput
from speculum.costs import size_bucket


class BatchVerdict:
    """Whether the rows of one configuration draft this step, at one batch size (shared by their
    controllers, kept across requests): the goodput of the rows that drafted, each on its share of
    the step, against a plain batched step's share. A step is one decision for every row (a draft
    model then runs for all of them or none, and rows that would not draft cost no proposing);
    when drafting stops paying, plain steps for a back-off of 1, 2, 4, ... steps, grown as the
    controller's is until a probe loses at most ``exploration`` of the time."""

    def __init__(self, max_backoff: int, exploration: float, goodput: Goodput, margin: float):
        self.margin = margin
        self.asked = goodput
        self.backoff = Backoff(max_backoff, exploration)
        self._skip, self._probe = 0, False
        self._step: object = None
        self._decision = True
        self._pending = [0.0, 0.0, 0.0, 0]  # this step's drafting rows: tokens, seconds, plain seconds, rows

    def copied(self) -> BatchVerdict:
        twin = copy.deepcopy(self)
        twin._pending, twin._step = [0.0, 0.0, 0.0, 0], None
        return twin

    def asks(self, step: object) -> bool:
        """Whether rows draft in ``step`` (the same answer for every row of one step)."""
        if step != self._step:
            self._step = step
            self._fold()
            self._decision = self._skip == 0
            if self._skip:
                self._skip -= 1
                self._probe = self._skip == 0
        return self._decision

    def record(self, tokens: int, seconds: float, plain_seconds: float) -> None:
        """A drafting row's round: its tokens, its share of the step, and what a plain share costs."""
        pending = self._pending
        pending[0] += tokens
        pending[1] += seconds
        pending[2] += plain_seconds
        pending[3] += 1

    def _fold(self) -> None:
        tokens, seconds, plain_seconds, rows = self._pending
        self._pending = [0.0, 0.0, 0.0, 0]
        if not rows:
            return
        self.asked.add(tokens / rows, seconds / rows, fresh=self._probe, rows=rows)
        loss = (seconds / plain_seconds - tokens / rows) if plain_seconds > 0 else 0.0  # plain steps lost a row
        self.backoff.note(loss, self._probe, self.asked.min_evidence)
        self._probe = False
        if not self.asked.judged:
            return
        if self.asked.rate < (rows / plain_seconds) * (1.0 + self.margin):
            self._skip = self.backoff.lost()
        else:
            self.backoff.won()


def by_batch_size(learned: dict, rows: int, new):
    """What is learned for batches of ``rows`` rows, in ``learned`` (by size bucket). A size not
    seen yet starts as a copy of the nearest smaller one's (``new()`` if none): the forward only
    gets dearer per row as the batch grows, so drafting that did not pay at 4 rows will not at 8,
    and a server whose batch grows step by step does not learn it all again at each size (what
    ``learned`` holds has ``copied()``: a copy without the round in progress)."""
    bucket = size_bucket(rows)
    if bucket not in learned:
        smaller = [b for b in learned if b < bucket]
        learned[bucket] = learned[max(smaller)].copied() if smaller else new()
    return learned[bucket]
