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
  nothing would ever be learnt of them (issue #18: Ouroboros' phrases hang below its chain, their
  reach is small before any evidence, and the controller pruned all of them while they gave 1.6 of
  every 4 accepted tokens uncontrolled): while a pruned node's bin has less than
  ``EXPLORE_EVIDENCE`` samples and its parent is kept, a round verifies the whole proposal whenever a budget, filled at
  ``explore_share`` of the time spent, covers what the extra nodes cost under t(n). Such a round is
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
  decides more than the prompt (issue #18: restarting it made every sampled request climb the ramp
  1, 2, 4, ... again, and kept heads and lookahead asked in 21-40% of rounds at a loss).

Exactness is untouched: the controller only decides which draft nodes are verified, or whether to
draft at all. A sampled node's score must not depend on its own token (see ``Draft``): pruning on a
sampled token's value would bias the distribution the verifier corrects for.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from speculum.costs import CostModel, size_bucket
from speculum.tree import Draft, TokenTree

BINS = 10  # calibration bins over a drafter's score in [0, 1]
DEPTH_BINS = 8  # for unscored nodes: one bin per depth, the last for everything deeper
SCORED_DEPTH_BINS = 3  # for scored nodes: depth 1, 2, and 3 or deeper
EXPLORE_EVIDENCE = 8.0  # samples a bin needs before pruning its nodes is trusted without exploring
# verdicts in a row that asking pays per halving of the next back-off: one burst lifts the goodput
# average for several rounds, and each of them is a verdict
WINS_PER_HALVING = 3
LENGTH_SMOOTHING = 0.3  # weight of the last finished request in the typical request length
# a drafter whose catch-up (a draft model's prefill) would not pay on the evidence is tried again
# once the tokens decoded without it since it last ran are worth this share of a probe's cost: the
# catch-up and about one plain step of rounds that may lose. Counting tokens, not requests: after a
# workload switch (chat, where drafting lost, then code) long requests probe within one or two of
# them, where a count of requests had left 4 MBPP requests undrafted (issue #18, eighteenth pass)
CATCH_UP_PROBE_SHARE = 0.02
# weight of a round in the catch-up rule's memory of what drafting gives (about 30 rounds; the
# verdicts to draft or not weigh one by 0.15, about 7). A drafter is stopped right after a window of
# rounds that lost, and a catch-up rule reading that very window kept the Qwen 0.5B draft off for
# whole requests at T=1 where it pays (issue #18, twenty-fifth pass)
LONG_SMOOTHING = 0.03


@dataclass
class Calibration:
    """P(node accepted | parent accepted) per bin of what the drafter says (its score, or the node's
    depth within its source's run when it gives none: see :func:`source_depths`): a Beta posterior
    per bin, its prior centred on the score itself (the drafter's own belief) or on 0.5, with old
    evidence slowly forgotten so the estimate follows the request in flight; times a correction per
    source, learnt from all of that source's nodes at once (see ``by_source``)."""

    prior_strength: float = 2.0
    forget: float = 0.995  # evidence weight kept per update (~200 verified nodes of memory)
    counts: dict[tuple, list[float]] = field(default_factory=dict)  # bin -> [accepted, rejected]
    # per source, its verified nodes' [accepted, estimated] (decayed by ``source_forget``): how far the
    # bins' estimates of that source run from what the target accepts. There are ~30 bins a source,
    # each starting from the drafter's belief (or 0.5), and a bin learns only from its own nodes, so
    # for a request's first hundred nodes most estimates are priors, and bins learnt on one kind of
    # text (code) speak for another (chat) for ~200 of their nodes. Every node the source gets
    # verified corrects all its bins at once, by the ratio (issue #18, Qwen pair on MT-bench, AVX2:
    # auto verified 4-6 nodes a round expecting 2.4 tokens and committed 2.1, its n-gram and head
    # nodes accepted ~5% of the time where their estimates were over 10%)
    source_forget: float = 0.98
    by_source: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def _bin(score: float | None, depth: int, source: str) -> tuple:
        if score is None:
            return (source, "depth", min(depth, DEPTH_BINS))
        # scored nodes are binned by depth too (1, 2, 3 and deeper): given its parent was accepted, a
        # deep node of a copied phrase is accepted far more often than a first one with the same score
        score_bin = min(BINS - 1, int(max(0.0, min(1.0, score)) * BINS))
        return (source, "score", score_bin, min(depth, SCORED_DEPTH_BINS))

    def estimate(self, score: float | None, depth: int, source: str = "", optimistic: bool = False) -> float:
        """The bin's posterior mean times its source's correction (``source_factor``); ``optimistic``:
        never below the prior (the drafter's own belief)."""
        posterior, prior = self._posterior(score, depth, source)
        estimate = min(posterior * self.source_factor(source), 0.99)
        return max(estimate, prior) if optimistic else estimate

    def _posterior(self, score: float | None, depth: int, source: str) -> tuple[float, float]:
        key = self._bin(score, depth, source)
        prior = 0.5 if score is None else (key[2] + 0.5) / BINS
        accepted, rejected = self.counts.get(key, (0.0, 0.0))
        strength = self.prior_strength
        return (accepted + prior * strength) / (accepted + rejected + strength), prior

    def source_factor(self, source: str) -> float:
        """What ``source``'s verified nodes were accepted, over what their bins estimated (one
        pseudo-node each side: 1.0 before any evidence), in [0.05, 2]."""
        accepted, estimated = self.by_source.get(source, (0.0, 0.0))
        return min(max((accepted + 1.0) / (estimated + 1.0), 0.05), 2.0)

    def evidence(self, score: float | None, depth: int, source: str = "") -> float:
        """How many (decayed) samples the node's bin holds."""
        return sum(self.counts.get(self._bin(score, depth, source), (0.0, 0.0)))

    def update(self, score: float | None, depth: int, accepted: bool, source: str = "") -> None:
        seen = self.by_source.setdefault(source, [0.0, 0.0])
        seen[0] = seen[0] * self.source_forget + (1.0 if accepted else 0.0)
        seen[1] = seen[1] * self.source_forget + self._posterior(score, depth, source)[0]
        key = self._bin(score, depth, source)
        counts = self.counts.setdefault(key, [0.0, 0.0])
        counts[0] = counts[0] * self.forget + (1.0 if accepted else 0.0)
        counts[1] = counts[1] * self.forget + (0.0 if accepted else 1.0)


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
        # model gates: with patience, auto ran its Medusa heads for a third fewer tokens at T=1)
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
        one probe that a burst made look good does not restart the ramp 1, 2, 4, ... (issue #18:
        lookahead at T=1, whose probes verify whole windows at 1.3-1.5 plain steps, was asked in
        57% of a request's rounds at a 14% loss while one probe in three caught a 3-token round
        and started it over)."""
        self.wins += 1
        if not self.patient:
            self.length = 1
        elif self.wins % WINS_PER_HALVING == 0:
            self.length = max(1, self.length // 2)

    def reset(self) -> None:
        """A new request whose prompt decides what drafting gives: back-offs start at one round.
        (Starting at a quarter of the last request's back-off cost greedy lookahead in float32 the
        requests where its windows pay: 0.97x plain on HumanEval and GSM8K against 1.13x and
        1.57x, issue #18.)"""
        self.length, self.wins = 1, 0


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


@dataclass
class Plan:
    """What the controller decided for one round."""

    keep: list[bool] | None  # per draft node; None: verify everything proposed
    expected_tokens: float  # committed tokens expected (bonus included)
    predicted_seconds: float  # the round's predicted verification time
    pruned: int = 0  # draft nodes within reach of the tokens left that it chose not to verify
    explored: bool = False  # verified whole to learn of nodes that pruning would have dropped


class Controller:
    """Decides, round by round, whether to draft and what to verify (see the module docstring).

    One per drafter configuration and sampling regime, kept across requests (calibration and
    goodput carry over; the back-off restarts with each request unless ``carry_backoff``: sampled
    requests). ``cost`` is the target's cost model, shared and refined by every verification
    forward.
    """

    def __init__(
        self,
        cost: CostModel,
        *,
        max_backoff: int = 32,
        smoothing: float = 0.3,
        goodput_smoothing: float = 0.15,
        min_evidence: int = 3,
        negligible: float = 0.05,
        margin: float = 0.03,
        exploration: float = 0.015,
        explore_share: float = 0.02,
        carry_backoff: bool = False,
        plain_probe_every: int = 256,
    ):
        self.cost = cost
        self.max_backoff = max_backoff
        # the share of plain steps a losing probe may cost: the back-off grows past max_backoff
        # (up to 8 times it) until one probe's loss is at most this share of the rounds between probes
        self.exploration = exploration
        self.carry_backoff = carry_backoff
        # the share of the time spent that may go to verifying nodes pruning would drop, while too
        # little is known of them (see the module docstring)
        self.explore_share = explore_share
        self._explore_budget = 0.0  # seconds of extra verification exploring may still spend
        self.smoothing = smoothing  # weight of the newest round in the size and expectation averages
        # an asked round that verified nothing and whose drafting cost less than this share of a
        # plain step is a plain round in all but name: it is not held against the drafter
        self.negligible = negligible
        # asking must beat a plain step by this share to keep asking: a goodput average that hovers at
        # break-even is above it half the time by chance, and asking then loses what drafting costs
        self.margin = margin
        self.calibration = Calibration()
        # the goodput of the rounds that asked the drafter: acceptance comes in bursts, so one round
        # says little; ~7 rounds of memory (goodput_smoothing), no verdict on fewer than min_evidence
        self.asked = Goodput(goodput_smoothing, min_evidence)
        self.asked_long = Goodput(LONG_SMOOTHING, min_evidence)  # the same rounds, for the catch-up rule
        # the same rounds as they would have gone without the drafter's costly parts (see observe_round)
        self.asked_lean = Goodput(goodput_smoothing, min_evidence)
        self.plain_round: float | None = None  # seconds of a plain round as measured (bookkeeping included)
        # a drafter that always pays is never backed off, so no plain round would ever be measured and
        # the goodput it must beat would rest on the cost model's t(1), one measurement of a few
        # forwards: a plain round is taken after 16 drafting rounds in a row when none was measured
        # yet, 64 after one, and every ``plain_probe_every`` after more (what one costs: about a
        # token per 256 rounds at 2x plain)
        self.plain_probe_every = plain_probe_every
        self._since_plain = 0  # drafting rounds since the last plain round
        self._plain_rounds = 0  # plain rounds measured
        self.overhead = 0.0  # seconds per round beyond the forward (verify, commit, bookkeeping), measured
        self.backoff = Backoff(max_backoff, exploration, patient=True)
        self._plain_left = 0
        self.probing = False
        self._kept_size = 4.0  # draft nodes verified per round, recently (moving average)
        self._expected = 2.0  # committed tokens expected per round, recently
        self._drafting = 0.0  # seconds of drafting per asked round, recently
        self._overridden: tuple[list[bool], int, float] | None = None  # this round's plan, had it not explored
        # batches: whether a configuration's rows draft at all, one verdict per batch size (shared
        # by the rows' controllers, see for_row)
        self.batch_verdicts: dict[int, BatchVerdict] = {}
        # whether a request's first draft pays for the drafter's catching up (see _catch_up_pays)
        self.catch_up_rule = CatchUpRule()

    # ------------------------------------------------------------------ per request

    def for_row(self) -> Controller:
        """A controller for one row of a batch: its own back-off and goodput (per request), the
        calibration, cost model and batch verdicts shared with this one (what is learned per
        configuration)."""
        row = copy.copy(self)
        row.asked, row.asked_long, row.asked_lean = (
            copy.copy(self.asked),
            copy.copy(self.asked_long),
            copy.copy(self.asked_lean),
        )
        row.backoff = copy.deepcopy(self.backoff)
        row.catch_up_rule = self.catch_up_rule.for_row()
        return row

    def verdict(self, rows: int) -> BatchVerdict:
        """The batch verdict for ``rows`` rows (batch sizes that cost alike share one; a new one
        starts from the nearest smaller size's, see :func:`by_batch_size`)."""

        def new() -> BatchVerdict:
            goodput = Goodput(self.asked.smoothing, self.asked.min_evidence)
            return BatchVerdict(self.max_backoff, self.exploration, goodput, self.margin)

        return by_batch_size(self.batch_verdicts, rows, new)

    def start(self) -> None:
        if not self.carry_backoff:
            self.backoff.reset()
            self._plain_left, self.probing = 0, False
        self.catch_up_rule.start()

    def finish(self, new_tokens: int) -> None:
        """The request ended with ``new_tokens`` generated."""
        self.catch_up_rule.finish(new_tokens)

    @property
    def typical_length(self) -> float | None:
        """How many tokens requests have run lately (None before any ended)."""
        return self.catch_up_rule.typical_length

    def plain_rate(self) -> float:
        seconds = self.plain_round if self.plain_round is not None else self.cost.plain_step + self.overhead
        return 1.0 / max(seconds, 1e-9)

    def row_cost(self, rows: int = 1):
        """n -> seconds: what a forward over an n-node tree (root included) costs one row of a batch
        of ``rows``, by the cost model (alone: t(n))."""
        if rows <= 1:
            return self.cost
        cost = self.cost
        return lambda n: cost.batch(rows, n) / rows

    def wants_draft(
        self, rows: int = 1, step: object = None, *, catch_up: float = 0.0, generated: int = 0, tokens_left: int = 0
    ) -> bool:
        """Whether to ask the drafter this round (False: a plain step); ``rows`` > 1: in ``step`` of
        a batch of that many rows, where the configuration's batch verdict has a say too.

        ``catch_up``: the seconds asking would first spend catching up (``Drafter.catch_up_estimate``),
        ``generated`` tokens into a request that may give ``tokens_left`` more."""
        if rows > 1:
            return self.verdict(rows).asks(step)
        if self._plain_left > 0:
            self._plain_left -= 1
            self.probing = self._plain_left == 0  # the round after a back-off is a probe
            return False
        if self._since_plain >= min(self.plain_probe_every, 16 << (2 * min(self._plain_rounds, 4))):
            return False  # a plain round that measures what plain decoding costs now
        if catch_up > 0.0 and not self._catch_up_pays(catch_up, generated, tokens_left):
            return False
        self.catch_up_rule.used(generated)
        return True

    def _catch_up_pays(self, catch_up: float, generated: int, tokens_left: int) -> bool:
        """Whether what asking saves per token, over the tokens this request likely has left, pays
        for the catch-up asking starts with. Issue #18: a 0.5B draft's prefill of a prompt costs
        about two plain steps of the 1.5B target, and at T=1 drafting saves a few percent of a step
        per token: on translations of 10-30 tokens it was lost before it was won back (draft_model
        0.91x plain on WMT16). Unknown goodput, or a probe due: ask (what asking gives is measured
        again). Judged on the longer memory of the asked rounds (``LONG_SMOOTHING``)."""
        rate, step = self.asked_long.rate, 1.0 / self.plain_rate()
        saving = step - 1.0 / rate if rate is not None and self.asked_long.judged else None
        return self.catch_up_rule.pays(catch_up, saving, generated, tokens_left, step)

    def chain_stop(self, source: str = "draft_model") -> ChainStop:
        """This round's stop for a chain drafted one forward at a time, its nodes labelled ``source``
        (every chain drafter's: see ``Draft.sources``)."""
        return ChainStop(self, source)

    # ------------------------------------------------------------------ what to verify

    def plan(
        self,
        draft: Draft,
        max_depth: int,
        prunable: bool = True,
        whole_sources: frozenset[str] = frozenset(),
        draft_seconds: float = 0.0,
        rows: int = 1,
        floor: int = 1,
    ) -> Plan:
        """The keep-mask over ``draft``'s nodes that maximises expected committed tokens per second;
        nodes of ``whole_sources`` are kept whenever their parent is (see ``Drafter.whole_sources``).

        ``draft_seconds``: what drafting this round took. It is part of the round's time, so an extra
        node costs a smaller share of a round whose drafting was dear (issue #18: counting only the
        forward, Ouroboros' phrases looked twice as dear as they were, beside a 0.5B draft model's
        chain that takes 45% of the round).

        ``rows`` > 1: the forward carries a batch whose trees are padded to the largest, ``floor``
        nodes so far this step. What counts is the batch's committed tokens per second: one row's
        extra nodes make every row's step dearer, and their gain is weighed against the whole
        batch's output (the other rows' expected tokens), so speculation thins out as the batch
        grows and the forward stops being memory-bound."""
        self._overridden = None  # (keep, kept, extra seconds) of a plan that exploring overrode
        if rows > 1:
            cost = lambda m: self.cost.batch(rows, max(m, floor))  # noqa: E731
            others = (rows - 1) * self._expected
        else:
            cost, others = self.cost, 0.0
        depths = draft.depths()
        scores = draft.scores if draft.scores is not None else [None] * len(draft)
        sources = draft.sources if draft.sources is not None else [""] * len(draft)
        labels = calibration_labels(draft)
        runs = source_depths(draft)
        reach = [0.0] * len(draft)  # P(node reached and accepted)
        by_parent: dict[int, list[int]] = {}
        for i, parent in enumerate(draft.parents):
            by_parent.setdefault(parent, []).append(i)
        for parent, children in by_parent.items():  # parents before children: reach[parent] is final
            above = 1.0 if parent < 0 else reach[parent]
            chances = [self.calibration.estimate(scores[c], runs[c], labels[c], optimistic=self.probing)
                       if depths[c] <= max_depth else 0.0 for c in children]  # fmt: skip
            total = sum(chances)
            scale = 1.0 / total if total > 1.0 else 1.0  # siblings are exclusive: at most one is accepted
            for child, chance in zip(children, chances, strict=True):
                reach[child] = above * chance * scale
        within = sum(1 for d in depths if d <= max_depth)
        if not prunable:
            expected = 1.0 + sum(reach[i] for i in range(len(draft)) if depths[i] <= max_depth)
            return self._planned(Plan(None, expected, cost(within + 1)), within)
        whole = [False] * len(draft)  # kept as proposed: a whole-source node below the root or another one
        if whole_sources and draft.sources is not None:
            for i, parent in enumerate(draft.parents):
                whole[i] = sources[i] in whole_sources and depths[i] <= max_depth and (parent < 0 or whole[parent])
        if draft.probs is not None:
            keep = self._local_keep(draft, reach, depths, max_depth, whole, cost, rows)
        else:
            keep = self._best_keep(reach, depths, whole, cost, others + 1.0, self.overhead * rows + draft_seconds)
        # sampled drafts use past rounds' drafting time (this round's may depend on what was sampled)
        self._drafting += self.smoothing * (draft_seconds - self._drafting)
        kept = sum(keep)
        bins = (depths, runs, scores, labels)
        explored = kept < within and self._explores(draft, keep, bins, max_depth, cost(kept + 1), cost(within + 1))
        if explored:
            # the round is judged as the plan it overrides would have gone (observe_round)
            self._overridden = (keep, kept, cost(within + 1) - cost(kept + 1)) if rows == 1 else None
            keep, kept = [d <= max_depth for d in depths], within
        expected = 1.0 + sum(r for r, k in zip(reach, keep, strict=True) if k)
        return self._planned(Plan(keep, expected, cost(kept + 1), within - kept, explored), kept)

    def _explores(self, draft, keep, bins, max_depth, kept_cost, whole_cost) -> bool:
        """Whether to verify the whole proposal this round instead of the pruned one: some dropped
        node's bin holds too little evidence, and the budget covers the extra nodes. Only bins
        (source, depth, score) decide, never a node's token, so sampled drafts stay exact."""
        extra = whole_cost - kept_cost
        if extra > self._explore_budget:
            return False
        depths, runs, scores, labels = bins
        # the frontier of what pruning kept: a node below a dropped one is learnt of once its parent
        # is (a node is calibrated only when its parent was accepted), so a phrase the target never
        # takes costs exploring its first node's bin, not a whole tree every so often for ever
        unknown = any(
            not keep[i] and depths[i] <= max_depth and (parent < 0 or keep[parent])
            and self.calibration.evidence(scores[i], runs[i], labels[i]) < EXPLORE_EVIDENCE
            for i, parent in enumerate(draft.parents)
        )  # fmt: skip
        if unknown:
            self._explore_budget -= max(extra, 0.0)
        return unknown

    def _best_keep(self, reach, depths, whole, cost, base_tokens: float, spent: float) -> list[bool]:
        """Deterministic drafts: the ``whole`` nodes, then the prefix of the other nodes, most likely
        first, with the best expected tokens per second (``base_tokens``: what the round commits
        without a draft, the other rows' included; ``spent``: its seconds beyond the forward). Reach
        never grows along a path, so every prefix of that order (ties broken by depth, then draft
        order) holds each node's parent."""
        fixed = sum(whole)
        order = sorted(
            (i for i in range(len(reach)) if reach[i] > 0 and not whole[i]), key=lambda i: (-reach[i], depths[i], i)
        )
        gained = sum(r for r, w in zip(reach, whole, strict=True) if w)
        best_m, best_value = 0, (base_tokens + gained) / (cost(fixed + 1) + spent)
        for m, node in enumerate(order, start=1):
            gained += reach[node]
            value = (base_tokens + gained) / (cost(fixed + m + 1) + spent)
            if value > best_value:
                best_m, best_value = m, value
        keep = list(whole)
        for node in order[:best_m]:
            keep[node] = True
        return keep

    def _local_keep(self, draft: Draft, reach, depths, max_depth: int, whole, cost, rows: int) -> list[bool]:
        """Drafts with sampled nodes: whether a node is verified may depend only on what was known
        before it was sampled (its ancestors, its own sampling distribution, this controller's past),
        never on its own token or on other branches (keeping a sampled token because of what it or a
        later sample turned out to be would bias the output, as the oracle's stop would). So each node
        is kept when its parent is and its chance of being reached beats a threshold set from past
        rounds: the gain one more node must bring to pay for its verification cost."""
        size = max(1, round(self._kept_size))
        extra = cost(size + 2) - cost(size + 1)
        spent = self.overhead * rows + self._drafting
        threshold = self._expected * rows * max(extra, 0.0) / (cost(size + 1) + spent)
        keep = [False] * len(draft)
        for i, parent in enumerate(draft.parents):
            above = parent < 0 or keep[parent]
            keep[i] = whole[i] or (above and depths[i] <= max_depth and reach[i] > threshold)
        return keep

    def _planned(self, plan: Plan, kept: int) -> Plan:
        """Remember what this round kept and expected: the local rule's threshold comes from them."""
        self._kept_size += self.smoothing * (kept - self._kept_size)
        self._expected += self.smoothing * (plan.expected_tokens - self._expected)
        return plan

    # ------------------------------------------------------------------ learning

    def observe_round(
        self,
        tree: TokenTree,
        path: list[int],
        draft: Draft | None,
        *,
        asked: bool,
        committed: int,
        forward_seconds: float,
        round_seconds: float,
        draft_seconds: float = 0.0,
        rows: int = 1,
        padded: int | None = None,
        lean: tuple[float, float, int] | None = None,
    ) -> None:
        """What the round cost and gave: calibration from the verified nodes, the cost model from the
        forward, goodput from the whole round (drafting, ``draft_seconds`` of it, included).

        ``lean``: (tokens, seconds, nodes verified) the round would have given without the
        drafter's costly parts (``auto``'s model-gated groups, which their gates turn on and off).
        Asking is judged by the better of the rounds as they were and as they would have been lean:
        a gate that is about to stop heads that lose should not have every drafter backed off with
        them. A lean round that verifies nothing is not evidence, as a round that verifies nothing
        and costs next to nothing is not.

        ``rows`` > 1: the forward carried a batch of trees padded to ``padded`` nodes. The cost model
        learns T(rows, padded) from it; the row is judged on its own share of the step (its own
        drafting, a ``1 / rows`` share of the forward and its bookkeeping) against a plain batched
        step's share, by the batch verdict of this batch size (whether rows draft is decided for
        them all there; the row's own back-off is for when it runs alone)."""
        overridden, self._overridden = self._overridden, None
        if rows > 1:
            self.cost.observe_batch(rows, padded or len(tree), forward_seconds)
            round_seconds = draft_seconds + forward_seconds / rows + self.overhead
            plain_rate = 1.0 / max(self.cost.batch(rows, 1) / rows + self.overhead, 1e-9)
            spent = len(tree) > 1 or draft_seconds >= self.negligible / plain_rate
            if asked and spent:
                self.verdict(rows).record(committed, round_seconds, 1.0 / plain_rate)
        else:
            self.cost.observe(len(tree), forward_seconds)
            plain_rate = self.plain_rate()
        # the exploring budget fills with the time spent; it never holds more than a few plain steps,
        # so a long stretch without anything to explore does not become a burst of whole trees
        self._explore_budget = min(self._explore_budget + self.explore_share * round_seconds, 4.0 / plain_rate)
        if rows > 1:
            if asked and draft is not None and len(tree) > 1:
                self._calibrate(tree, path, draft)
            return  # the single-row plain time is measured alone
        if len(tree) == 1:
            # a one-token forward, as a plain step's: asked or not, the round less its drafting
            # measures what a plain step costs now. Were asked rounds left out, a plain step measured
            # while the host was busy would stand for hundreds of rounds, and a drafter whose trees
            # are all pruned would be judged against it (issue #18: `ctc` asked in every round of a
            # request while verifying nothing)
            self._measure_plain(round_seconds - draft_seconds, forward_seconds)
        verified = len(tree)
        if asked and overridden is not None and draft is not None:
            # an explored round buys calibration with the exploring budget; judged whole, its extra
            # nodes' cost would also back asking off (issue #18: at T=1 on Gemma `auto` explored its
            # prompt-lookup and head bins in 32 of MT-bench's 140 asked rounds at a loss of 9 plain
            # steps, and backed off from the n-gram rounds that gave `anpd` alone 24). Judge it as
            # the plan would have gone: the accepted path up to its first node the plan dropped,
            # the round less the extra nodes' cost
            keep, kept, extra = overridden
            cut = next((i for i, node in enumerate(path[1:]) if not keep[tree.source[node]]), len(path) - 1)
            committed, round_seconds = min(committed, cut + 1), max(round_seconds - max(extra, 0.0), 1e-6)
            verified, lean = kept + 1, None
        if not asked or (verified == 1 and draft_seconds < self.negligible / plain_rate):
            # a plain round, or one in all but name (nothing verified, next to nothing spent):
            # neither evidence for asking nor against it
            self._since_plain = 0
            self._plain_rounds += 1
            return
        self._since_plain += 1
        if draft is not None and len(tree) > 1:
            self._calibrate(tree, path, draft)
        # after a back-off, fresh evidence of how asking does now
        self.asked.add(committed, round_seconds, fresh=self.probing)
        self.asked_long.add(committed, round_seconds)
        # without costly parts the lean round is the round itself, and evidence as every counted round is
        lean_tokens, lean_seconds = (committed, round_seconds) if lean is None else lean[:2]
        lean_evidence = lean is None or lean[2] > 0
        if lean_evidence:
            self.asked_lean.add(lean_tokens, lean_seconds, fresh=self.probing)
        judged_by = self.asked
        if self.asked_lean.rate is not None and self.asked_lean.rate > self.asked.rate:
            judged_by = self.asked_lean
            # judged by the lean rounds, one that verified nothing was a plain round in all but name
            committed, round_seconds = (lean_tokens, lean_seconds) if lean_evidence else (1, 1.0 / plain_rate)
        loss = round_seconds * plain_rate - committed  # plain steps lost against plain decoding
        self.backoff.note(loss, self.probing, self.asked.min_evidence)
        self.probing = False
        if not judged_by.judged:
            return  # too few rounds to judge: acceptance comes in bursts
        if judged_by.rate < plain_rate * (1.0 + self.margin):
            self._plain_left = self.backoff.lost()
        else:
            self.backoff.won()

    def _measure_plain(self, seconds: float, forward_seconds: float) -> None:
        """A plain step took ``seconds``, ``forward_seconds`` of it the forward."""
        self.overhead += self.smoothing * (max(0.0, seconds - forward_seconds) - self.overhead)
        self.plain_round = seconds if self.plain_round is None else (
            self.plain_round + self.smoothing * (seconds - self.plain_round))  # fmt: skip

    def _calibrate(self, tree: TokenTree, path: list[int], draft: Draft) -> None:
        """Every verified node whose parent was accepted is a sample of P(accepted | parent accepted)."""
        on_path = set(path)
        scores, labels = draft.scores, calibration_labels(draft)
        runs = source_depths(draft)
        for node in range(1, len(tree)):
            if tree.parents[node] not in on_path:
                continue
            j = tree.source[node]
            score = scores[j] if scores is not None else None
            self.calibration.update(score, runs[j], node in on_path, labels[j])


class ChainStop:
    """Whether a drafter that grows a chain one draft forward at a time (a draft model, Ouroboros)
    should run one more forward this round, by the controller's own numbers: a forward costs
    ``step_seconds`` of drafting and the next node adds t(n + 2) - t(n + 1) to the verification; it
    gains that node's chance of being accepted, the reach of the chain so far (calibrated, as
    :meth:`Controller.plan` computes it) times the calibrated acceptance of a node scored as the
    last one. It is worth it while that gain per second beats the round's expected tokens per
    second so far. Reach only falls along a chain, so the first node that does not pay ends it.

    Issue #18: the draft model's own stop (confidence 0.8, its CPU default then) drafts on while the draft is sure of
    itself, whether or not the target agrees; on translations it is sure and wrong often enough
    that the drafting (1.1 plain steps per round with the Qwen pair) ate the gain. Calibration
    learns how far its confidence is believed on this request, and the draft step's measured cost
    says what a node must bring. Stopping after a drafted token, on what was drafted up to it, is a
    stopping time: sampled drafts stay exact (the token itself is kept; only whether another is
    drafted depends on it)."""

    def __init__(self, controller: Controller, source: str):
        self.calibration, self.cost, self.source = controller.calibration, controller.cost, source
        self.optimistic = controller.probing  # a probe drafts as its drafter believes
        self.base = controller.overhead  # seconds per round beyond the forward and the drafting
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


class CatchUpRule:
    """Whether using a drafter that must first catch up (a draft model's prefill of the prompt at a
    request's first use, or of the tokens decoded since it last ran) pays: what using it saves per
    token, over the tokens the request likely has left, against the catch-up's seconds. It keeps
    how long requests run (a moving average of the finished ones' new tokens) and the tokens
    decoded without it since it last ran; once a probe (the catch-up and about a plain step more)
    costs at most ``CATCH_UP_PROBE_SHARE`` of those tokens' time, the drafter runs anyway, so what
    the saving rests on is measured again. The controller keeps one for its drafter, ``auto`` one
    per costly group."""

    def __init__(self) -> None:
        self._learned = _RequestLengths()  # what finished requests taught (shared by the rows of a batch)
        self._used_at: int | None = None  # tokens generated when it last ran in the request in flight

    def for_row(self) -> CatchUpRule:
        """A rule for one row of a batch: what requests taught shared, the request in flight its own
        (one row's start must not reset another's)."""
        row = CatchUpRule()
        row._learned = self._learned
        return row

    @property
    def typical_length(self) -> float | None:
        return self._learned.typical_length

    def start(self) -> None:
        self._used_at = None

    def used(self, generated: int = 0) -> None:
        """It runs ``generated`` tokens into the request in flight."""
        self._used_at = generated

    def finish(self, new_tokens: int) -> None:
        learned, known = self._learned, self._learned.typical_length
        learned.typical_length = float(new_tokens) if known is None else known + LENGTH_SMOOTHING * (new_tokens - known)
        learned.skipped = self.decoded_without(new_tokens)

    def decoded_without(self, generated: int) -> int:
        """The tokens decoded without it since it last ran, ``generated`` tokens into the request in
        flight. Within a request too: one that drafted and then stopped paying has a backlog to catch
        up, and counting only finished requests had vetoed every probe of the back-off until the
        request ended (54 plain rounds in an MT-bench request, issue #18, eighteenth pass)."""
        if self._used_at is None:
            return self._learned.skipped + generated
        return max(generated - self._used_at, 0)

    def likely_left(self, generated: int, tokens_left: int) -> float:
        """The tokens a request ``generated`` tokens in likely has left, at most ``tokens_left``:
        what is left of the typical length, or, for a request already past half of it, about as
        many as it has run so far (a request of 55 tokens among translations of 27 is a long one;
        cut to half the typical length, it had never started drafting)."""
        if self.typical_length is None:
            return float(tokens_left)
        return min(float(tokens_left), max(self.typical_length - generated, float(generated)))

    def pays(
        self, catch_up: float, saving: float | None, generated: int, tokens_left: int, step_seconds: float
    ) -> bool:
        """Whether saving ``saving`` seconds per token (None: not known yet) pays for ``catch_up``
        seconds now, ``generated`` tokens into a request that may give ``tokens_left`` more
        (``likely_left``); or whether a probe is due, a plain step taking ``step_seconds``."""
        if catch_up <= 0.0 or saving is None or saving * self.likely_left(generated, tokens_left) > catch_up:
            return True
        # within a request that drafted, the round is the back-off's probe, which budgets its own
        # rounds: only the catch-up is this rule's to weigh. Both it and the tokens decoded without
        # grow with the wait, so a draft catching up for under the share of a plain step per token
        # is let through; counting the step too, one never was (issue #18, nineteenth pass)
        probe = catch_up + (step_seconds if self._used_at is None else 0.0)
        return probe <= CATCH_UP_PROBE_SHARE * self.decoded_without(generated) * step_seconds


@dataclass
class _RequestLengths:
    """What finished requests taught a :class:`CatchUpRule`."""

    typical_length: float | None = None  # new tokens of finished requests (a moving average)
    skipped: int = 0  # tokens of finished requests decoded without the drafter since it last ran


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


def source_depths(draft: Draft) -> list[int]:
    """Each draft node's depth within the run of its own source: 1 for a node below the root or
    below another drafter's node. Calibration bins by it, not by the depth in the tree: a phrase
    that Ouroboros hangs below a chain of varying length starts with a guess and goes on with a
    copy, wherever it starts (by tree depth, its first and later nodes shared bins and the guesses'
    rejections made the whole phrase look bad)."""
    sources = draft.sources
    runs = [1] * len(draft)
    for i, parent in enumerate(draft.parents):
        if parent >= 0 and (sources is None or sources[parent] == sources[i]):
            runs[i] = runs[parent] + 1
    return runs


def calibration_labels(draft: Draft) -> list[str]:
    """What each node is calibrated as: its source, marked ``" after a sample"`` for a deterministic
    node with an earlier sampled sibling. The verifier tries that node only once the sample is
    rejected, against the residual max(p - q, 0), where it is accepted far less often than where it
    is tried first (issue #18: at T=1 the n-gram and head nodes beside the Qwen 0.5B draft's chain
    gave 7 of 142 accepted tokens), and the same drafter's nodes elsewhere must not pay for that."""
    sources = draft.sources if draft.sources is not None else [""] * len(draft)
    if draft.probs is None:
        return list(sources)
    sampled_below: set[int] = set()  # parents with a sampled child so far
    labels = []
    for i, parent in enumerate(draft.parents):
        sampled = draft.q(i) is not None
        labels.append(sources[i] + " after a sample" if not sampled and parent in sampled_below else sources[i])
        if sampled:
            sampled_below.add(parent)
    return labels
