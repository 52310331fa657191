"""The chain stop: whether a drafter that grows a chain one draft forward at a time drafts on."""

from __future__ import annotations

from collections.abc import Callable

from speculum.controller.calibration import Calibration


class ChainStop:
    """Whether a drafter that grows a chain one draft forward at a time (a draft model, Ouroboros)
    should run one more forward this round, by the controller's own numbers: a forward costs
    ``step_seconds`` of drafting and the next node adds t(n + 2) - t(n + 1) to the verification; it
    gains that node's chance of being accepted, the reach of the chain so far (calibrated, as
    :meth:`speculum.controller.Controller.plan` computes it) times the calibrated acceptance of a node scored as the
    last one. It is worth it while that gain per second beats the round's expected tokens per
    second so far. Reach only falls along a chain, so the first node that does not pay ends it.

    A draft model's own stop (a confidence threshold) drafts on while the draft is sure of itself,
    whether or not the target agrees; where it is sure and wrong often (translations), the drafting
    eats the gain. Calibration learns how far its confidence is believed on this request, and the
    draft step's measured cost says what a node must bring. Stopping after a drafted token, on what
    was drafted up to it, is a stopping time: sampled drafts stay exact (the token itself is kept;
    only whether another is drafted depends on it)."""

    def __init__(
        self,
        calibration: Calibration,
        cost: Callable[[int], float],
        source: str,
        *,
        optimistic: bool = False,
        overhead: float = 0.0,
    ):
        """The controller's ``calibration`` and cost model t(n), the chain's ``source``; ``optimistic``:
        a probe round (it drafts as its drafter believes); ``overhead``: seconds per round beyond the
        forward and the drafting."""
        self.calibration, self.cost, self.source = calibration, cost, source
        self.optimistic = optimistic
        self.base = overhead
        self.reach = 1.0  # P(every chain node so far accepted)
        self.expected = 1.0  # committed tokens expected so far (bonus included)
        self.nodes = 0
        self.drafting = 0.0  # seconds of draft forwards so far (catching up left out)
        self.last_score: float | None = None
        self.stopped = False

    def add(self, score: float | None) -> None:
        """The chain grew by a node the drafter scored ``score``."""
        self.nodes += 1
        self.reach *= self.calibration.estimate(score, self.nodes, self.source, optimistic=self.optimistic)
        self.expected += self.reach
        self.last_score = score

    def worth_another(self, step_seconds: float | None) -> bool:
        """After a draft forward of ``step_seconds`` (None: not timed yet, draft on): whether the
        next one pays."""
        if step_seconds is None or self.nodes == 0:
            return True
        self.drafting += step_seconds
        n = self.nodes
        gain = self.reach * self.next_chance(n + 1)
        extra = step_seconds + max(self.cost(n + 2) - self.cost(n + 1), 0.0)
        rate = self.expected / (self.cost(n + 1) + self.drafting + self.base)
        if gain > extra * rate:
            return True
        self.stopped = True
        return False

    def next_chance(self, depth: int) -> float:
        """The calibrated acceptance of the node at ``depth`` not drafted yet: as a node scored like
        the last one (its own score is not known before the forward that makes it)."""
        return self.calibration.estimate(self.last_score, depth, self.source, optimistic=self.optimistic)
