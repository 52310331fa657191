"""The controller: each round, how much speculation pays on this machine, for any drafter.

Speculation is a bet: drafting costs time, verifying n tree nodes costs t(n) instead of t(1), and
what comes back is the tokens the target accepts. The controller makes the bet each round with
measured numbers instead of fixed settings, so a method is never meaningfully slower than plain
decoding:

- **Draft or not.** It keeps the realised goodput (committed tokens per second, drafting time
  included) of the rounds where the drafter was asked, and compares it with a plain step's. When
  asking stops paying, it takes plain rounds (a plain round costs what plain decoding does: the
  drafter is not called), and asks again after a back-off of 1, 2, 4, ... rounds, at most
  ``max_backoff``: a drafter that becomes good again is noticed within that many rounds, and one
  that stays bad costs one probe (``min_evidence`` asked rounds) per ``max_backoff`` rounds. Where
  a probe loses much (a lookahead window verified at T=1 costs 1.5 plain steps and gains nothing),
  the back-off grows past ``max_backoff`` until probing loses at most ``exploration`` of the time.
  Every three verdicts in a row that asking pays halve the next back-off (rounds that keep paying
  bring it to one; a single lucky probe does not restart the ramp). What a plain step costs is
  measured on the plain rounds themselves; a drafter that always pays gets one now and then (after
  16, 64, then every 256 drafting rounds), so the bar it must clear is never only the cost model's
  t(1), a measurement of a few forwards.
  Acceptance comes in bursts (a copied phrase, a boilerplate line), so no verdict rests on fewer
  than ``min_evidence`` rounds, and a round where the drafter had nothing to verify and cost next
  to nothing (an n-gram table with no match) counts neither way. Control is on goodput, not on
  acceptance: acceptance can stay high while speculation stops paying.
- **What to verify.** Each draft node gets an estimate of P(accepted | its parent accepted) from
  what its drafter says of it (``Draft.scores``: the draft's probability, n-gram agreement, a
  head's score) calibrated online against what the target accepted (:class:`Calibration`: per bin,
  and per drafter over all its bins, which corrects a drafter's optimistic priors in a few dozen
  nodes instead of a few hundred). The
  chance a node is reached is the product along its path; the controller keeps the sub-tree of the
  most likely nodes whose expected committed tokens per second, under the cost model t(n), is
  highest, and hands the engine a keep-mask (pruning is lossless: dropped nodes are simply not
  verified). Nothing kept means a plain step.
- **Exploration.** A probe round (after a back-off) prunes with optimistic estimates (no node
  below its drafter's own belief), so calibration keeps learning even when it says nothing pays,
  without paying for a whole tree. Nodes that pruning would always drop are never verified, so
  nothing would ever be learnt of them (Ouroboros' phrases hang below its chain and their reach is
  small before any evidence, so pruning would drop every one of them, however many tokens they
  would bring): while a pruned node's bin has less than ``EXPLORE_EVIDENCE`` samples and its parent
  is kept, a round verifies the whole proposal whenever a budget, filled at ``explore_share`` of
  the time spent, covers what the extra nodes cost under t(n). Such a round is
  judged as the plan it overrode would have gone (its budget pays for the extra nodes; judged
  whole, exploring also backed asking off).
- **Batches.** In a batch the rows of a configuration draft or not together, step by step
  (:class:`BatchVerdict`: one per batch size, shared by the rows' controllers and kept across
  requests): a draft model then runs for all of them or none, and where drafting does not pay at
  that batch size no row pays for proposing. Each row is judged on its share of the step against a
  plain batched step's share; a new batch size starts from what the nearest smaller one learned.
  Which nodes a row verifies stays the row's own plan, weighed against the whole batch's output.
- **Greedy and sampled requests** get a controller each (P(accepted | score) differs between them).
  A greedy request starts its back-off afresh, since what an n-gram drafter can copy depends on the
  prompt; a sampled one carries it over from the last request, since at T=1 the temperature
  decides more than the prompt (restarting it would make every sampled request climb the ramp
  1, 2, 4, ... again, asking drafters that lose at T=1 in many of its rounds).

Exactness is untouched: the controller only decides which draft nodes are verified, or whether to
draft at all. A sampled node's score must not depend on its own token (see ``Draft``): pruning on a
sampled token's value would bias the distribution the verifier corrects for.

Where each piece lives: :mod:`~speculum.controller.core` (the :class:`Controller`),
:mod:`~speculum.controller.calibration` (what a node's chance is), :mod:`~speculum.controller.pruning`
(which nodes to verify), :mod:`~speculum.controller.goodput` and :mod:`~speculum.controller.backoff`
(whether drafting pays, and how long to stop), :mod:`~speculum.controller.batch` (batch verdicts),
:mod:`~speculum.controller.catch_up` (whether a draft model's catch-up pays) and
:mod:`~speculum.controller.chain_stop` (whether a chain drafts on).
"""

from speculum.controller.backoff import WINS_PER_HALVING, Backoff
from speculum.controller.batch import BatchVerdict, by_batch_size
from speculum.controller.calibration import (
    BINS,
    DEPTH_BINS,
    SCORED_DEPTH_BINS,
    Calibration,
    calibration_labels,
    source_depths,
)
from speculum.controller.catch_up import CATCH_UP_PROBE_SHARE, LENGTH_SMOOTHING, CatchUpRule
from speculum.controller.chain_stop import ChainStop
from speculum.controller.core import Controller
from speculum.controller.goodput import LONG_SMOOTHING, Goodput
from speculum.controller.pruning import EXPLORE_EVIDENCE, Plan

__all__ = [
    "BINS",
    "CATCH_UP_PROBE_SHARE",
    "DEPTH_BINS",
    "EXPLORE_EVIDENCE",
    "LENGTH_SMOOTHING",
    "LONG_SMOOTHING",
    "SCORED_DEPTH_BINS",
    "WINS_PER_HALVING",
    "Backoff",
    "BatchVerdict",
    "Calibration",
    "CatchUpRule",
    "ChainStop",
    "Controller",
    "Goodput",
    "Plan",
    "by_batch_size",
    "calibration_labels",
    "source_depths",
]
