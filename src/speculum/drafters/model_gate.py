"""``auto``'s model gates: whether a group of costly drafters (a draft model, or heads) runs this
round, judged on the rounds that ran it against the same rounds without it, and, at a batch size
where the group has not run yet, predicted by the target's cost model."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from speculum.controller import LONG_SMOOTHING, Backoff, CatchUpRule, Goodput
from speculum.costs import CostModel

__all__ = ["PRIOR_ACCEPTANCE", "PRIOR_HEADS_GAIN", "BatchRound", "ModelGate", "RoundShape"]

# What a batch's prediction assumes before rounds decoded alone say: a draft model's token's chance
# of acceptance once its parent was accepted (a geometric chain), its draft forwards a round, and
# the tokens heads add to a round
PRIOR_ACCEPTANCE = 0.7
PRIOR_FORWARDS = 4.0
PRIOR_HEADS_GAIN = 0.5 + 0.25 + 0.125
SHAPE_SMOOTHING = 0.1  # weight of a round in RoundShape's averages (after the first ten)
# a prediction must say the group wins by this share: running it wrongly costs the rows' catch-up
# and a step or more, not running it wrongly a few percent
PREDICTION_MARGIN = 0.15


@dataclass
class RoundShape:
    """What a round that ran the group looks like alone (moving averages): its draft forwards (a
    draft model's), its drafting's seconds, the nodes it verified, and the nodes the other drafters
    had verified without the group."""

    forwards: float = PRIOR_FORWARDS
    drafting: float = 0.0
    nodes_with: float = PRIOR_FORWARDS + 2.0
    nodes_without: float = 2.0
    rounds: int = 0
    # second moments of forwards and nodes_with: a batch runs as many draft forwards as its longest
    # chain takes and pads every row's tree to the largest, so what counts there is the largest of B
    forwards_sq: float = PRIOR_FORWARDS**2
    nodes_with_sq: float = (PRIOR_FORWARDS + 2.0) ** 2

    def add(self, forwards: float, drafting: float, nodes_with: float, nodes_without: float) -> None:
        self.rounds += 1
        weight = max(1.0 / self.rounds, SHAPE_SMOOTHING)
        self.forwards += weight * (forwards - self.forwards)
        self.forwards_sq += weight * (forwards**2 - self.forwards_sq)
        self.drafting += weight * (drafting - self.drafting)
        self.nodes_with += weight * (nodes_with - self.nodes_with)
        self.nodes_with_sq += weight * (nodes_with**2 - self.nodes_with_sq)
        self.nodes_without += weight * (nodes_without - self.nodes_without)

    def largest_forwards(self, rows: int) -> float:
        """About the most draft forwards of ``rows`` rounds (mean + sd * sqrt(2 ln rows))."""
        return _largest(self.forwards, self.forwards_sq, rows)

    def largest_nodes_with(self, rows: int) -> float:
        """About the largest tree of ``rows`` rounds that run the group."""
        return _largest(self.nodes_with, self.nodes_with_sq, rows)


def _largest(mean: float, mean_sq: float, rows: int) -> float:
    spread = math.sqrt(max(mean_sq - mean * mean, 0.0))
    return mean + spread * math.sqrt(2.0 * math.log(rows)) if rows > 1 else mean


@dataclass
class BatchRound:
    """A batch step the group might run in, as its prediction needs it."""

    cost: CostModel  # the target's
    rows: int  # rows of the target's forward
    own_rows: int  # of them, the rows this gate decides for
    drafting: float  # seconds the group's drafting adds to a step for the own rows
    catch_up: float  # seconds the own rows' catching up would take first
    tokens_left: float  # tokens the own rows likely have left, together
    prior_gain: float  # tokens the group adds to a row's round before rounds decoded alone say


class ModelGate:
    """Whether to run a group of costly drafters (a draft model, or heads) this round: while rounds with them pay
    more per second than rounds without them; after they stop paying they are tried again after 1,
    2, 4, ... ``max_backoff`` rounds (grown past it, as the controller's back-off is, until a probe
    loses at most ``exploration`` of the time), for a probe of a few rounds.

    "Without them" is measured on the same rounds where it can be (``record``'s ``without``: what
    the round would have committed had only the other drafters' nodes been verified, and what it
    would have cost without the group's drafting and its nodes' share of the forward): paired,
    so a burst of n-gram copies lifts both sides alike. Comparing rounds with the heads against
    other rounds without them lets chance decide: greedy n-gram rounds are too bursty for the two
    averages to settle in a few rounds. Without that estimate, one round in ``refresh`` goes without them,
    to keep that side's measure fresh.

    A round is one decision (``use``) and what it gave (``record``), summed over the rows it was
    made for: in a batch, one gate decides for every row of the configuration at once (their draft
    model runs batched, so its cost is the group's, not a row's), and each row is a sample."""

    def __init__(self, max_backoff: int = 32, refresh: int = 16, margin: float = 0.03, exploration: float = 0.015):
        self.refresh = refresh
        self.margin = margin  # they must beat rounds without them by this share (see Controller.margin)
        self.with_model, self.without_model = Goodput(), Goodput()
        # the same rounds over a longer memory, never restarted, for the catch-up rule: the gate stops
        # the group right after a window of rounds that lost, and a rule reading that very window
        # would keep the draft model off for whole requests
        self.with_model_long, self.without_model_long = Goodput(LONG_SMOOTHING), Goodput(LONG_SMOOTHING)
        self.backoff = Backoff(max_backoff, exploration)  # its losses: rounds without the model each lost
        self._skip, self._probe = 0, False
        self._refreshing = False  # the rounds skipped are a refresh of the other side, not a back-off
        self._since_refresh = 0
        # used -> [tokens, seconds, rows, tokens without, seconds without, rows with that estimate]
        self._pending: dict[bool, list[float]] = {}
        # alone, a request's first use of the group may start with a catch-up (a draft model's
        # prefill): see worth_catching_up
        self.catch_up_rule = CatchUpRule()
        self.shape = RoundShape()  # what a round that ran the group looks like alone
        self.measured_rows = 0  # rows of rounds that ran the group at this batch size

    def worth_catching_up(self, catch_up: float, generated: int, tokens_left: int) -> bool:
        """Whether using the group now, when it must first catch up for ``catch_up`` seconds, pays
        over what the request likely has left (``CatchUpRule``, on the rounds with the group
        against those without, over the longer memory)."""
        with_rate, without_rate = self.with_model_long.rate, self.without_model_long.rate
        known = with_rate is not None and without_rate is not None and self.with_model_long.judged
        saving = 1.0 / without_rate - 1.0 / with_rate if known else None  # seconds per token
        step = 1.0 / without_rate if known else 0.0
        return self.catch_up_rule.pays(catch_up, saving, generated, tokens_left, step)

    def copied(self) -> ModelGate:
        """A copy without the round in progress (a larger batch size starts from it, measured
        there by nothing yet)."""
        twin = copy.deepcopy(self)
        twin._pending = {}
        twin.measured_rows = 0
        return twin

    @property
    def measured(self) -> bool:
        """Whether the group has run at this batch size on enough rows to judge it there."""
        return self.measured_rows >= self.with_model.min_evidence

    def predicts_paying(self, batch: BatchRound) -> bool:
        """Before the group has run at this batch size (``measured``): whether running it pays for
        ``batch``'s rows by the target's cost model, on what this gate learned of the group's
        rounds alone (``shape``, and their tokens once judged; priors before), the catch-up it
        would start with included: in a batch a draft forward, every verified node and the rows'
        catch-up cost real compute, so a group that pays alone may not pay beside other rows."""
        shape, cost, rows, own = self.shape, batch.cost, batch.rows, batch.own_rows
        if self.with_model_long.judged and self.without_model_long.tokens is not None:
            with_tokens, without_tokens = self.with_model_long.tokens, self.without_model_long.tokens
        else:
            without_tokens = 1.0
            with_tokens = without_tokens + batch.prior_gain
        others = rows - own  # rows of other configurations: a plain token each
        step_with = batch.drafting + cost.batch(rows, max(1, round(shape.largest_nodes_with(rows))))
        step_without = cost.batch(rows, max(1, round(shape.nodes_without)))
        per_token_with = step_with / (own * with_tokens + others)
        per_token_without = step_without / (own * without_tokens + others)
        tokens = batch.tokens_left + others * batch.tokens_left / own
        return tokens * per_token_with + batch.catch_up < tokens * per_token_without / (1.0 + PREDICTION_MARGIN)

    def catch_up_pays(self, batch: BatchRound) -> bool:
        """Once the group has run at this batch size (``measured``): whether what it saves there per
        token, over the tokens the rows likely have left, pays for the catch-up it would start
        with. Its rounds are judged without their catch-up, but in a server rows keep joining with
        a whole prompt to catch up, which a batch pays side by side each time the group runs."""
        if batch.catch_up <= 0.0:
            return True
        with_rate, without_rate = self.with_model.rate, self.without_model.rate
        if with_rate is None or without_rate is None:
            return True
        saving = 1.0 / without_rate - 1.0 / with_rate  # seconds per token of the batch's output
        return saving * batch.tokens_left > batch.catch_up

    def use(self) -> bool:
        self._fold()
        if self._skip > 0:
            self._skip -= 1
            self._probe = self._skip == 0 and not self._refreshing
            return False
        self._refreshing = False
        return True

    def record(
        self,
        used: bool,
        tokens: int,
        seconds: float,
        without: tuple[float, float] | None = None,
        catch_up: float = 0.0,
    ) -> None:
        """One row's part of the round decided last (learned from at the next decision);
        ``without``: for a round that ran the group, (tokens, seconds) the round would have given
        without it (see the class docstring); ``catch_up``: in a batch, the row's share of the
        group's catching up, which the round is not judged by but a probe's loss counts (it is
        what trying the group again costs the batch)."""
        pending = self._pending.setdefault(used, [0.0, 0.0, 0, 0.0, 0.0, 0, 0.0])
        pending[0] += tokens
        pending[1] += seconds
        pending[2] += 1
        pending[6] += catch_up
        if used and without is not None:
            pending[3] += without[0]
            pending[4] += without[1]
            pending[5] += 1

    def _fold(self) -> None:
        pending, self._pending = self._pending, {}
        for used, (tokens, seconds, rows, tokens_without, seconds_without, paired, catch_up) in pending.items():
            without = (tokens_without / paired, seconds_without / paired, paired) if paired else None
            self._learn(used, tokens / rows, seconds / rows, rows, without, catch_up / rows)

    def _learn(
        self,
        used: bool,
        tokens: float,
        seconds: float,
        rows: int,
        without: tuple[float, float, int] | None,
        catch_up: float = 0.0,
    ) -> None:
        if not used:
            self.without_model.add(tokens, seconds, rows=rows)
            self.without_model_long.add(tokens, seconds, rows=rows)
            return
        if without is not None:
            # measured on these very rounds (a probe restarts both sides alike)
            self.without_model.add(without[0], without[1], fresh=self._probe, rows=without[2])
            self.without_model_long.add(without[0], without[1], rows=without[2])
        self.measured_rows += rows
        self.with_model.add(tokens, seconds, fresh=self._probe, rows=rows)
        self.with_model_long.add(tokens, seconds, rows=rows)
        cheap = self.without_model.rate
        if cheap is not None:  # rounds without the model this one round lost, per row
            self.backoff.note((seconds + catch_up) * cheap - tokens, self._probe, self.with_model.min_evidence)
        self._probe = False
        if not self.with_model.judged:
            return
        if cheap is not None and self.with_model.rate < cheap * (1.0 + self.margin):
            self._skip, self._refreshing = self.backoff.lost(), False
            self._since_refresh = 0
            return
        self.backoff.won()
        if without is not None:
            return  # the other side was measured on this very round: none need go without them
        self._since_refresh += 1
        if cheap is None or self._since_refresh >= self.refresh:
            # one round without them: measure that side (again)
            self._skip, self._since_refresh, self._refreshing = 1, 0, True
