"""The controller itself: :class:`Controller` decides each round whether to draft and which draft
nodes to verify, and learns from what the round cost and gave (see the package docstring)."""

from __future__ import annotations

import copy

from speculum.controller.backoff import Backoff
from speculum.controller.batch import BatchVerdict, by_batch_size
from speculum.controller.calibration import Calibration, calibration_labels, source_depths
from speculum.controller.catch_up import CatchUpRule
from speculum.controller.chain_stop import ChainStop
from speculum.controller.goodput import LONG_SMOOTHING, Goodput
from speculum.controller.pruning import (
    Plan,
    best_prefix_keep,
    has_unexplored_frontier,
    node_reach,
    threshold_keep,
    whole_nodes,
)
from speculum.costs import CostModel
from speculum.tree import Draft, TokenTree


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
        # yet, 64 after one, and every ``plain_probe_every`` after more (what one costs: at twice
        # plain speed, about a token per ``plain_probe_every`` rounds)
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
        for the catch-up asking starts with: a draft model's prefill of a prompt can cost a few plain
        steps of the target while drafting saves a few percent of a step per token (at T=1), so on
        short requests (translations) the catch-up is lost before it is won back. Unknown goodput,
        or a probe due: ask (what asking gives is measured again). Judged on the longer memory of
        the asked rounds (``LONG_SMOOTHING``)."""
        rate, step = self.asked_long.rate, 1.0 / self.plain_rate()
        saving = step - 1.0 / rate if rate is not None and self.asked_long.judged else None
        return self.catch_up_rule.pays(catch_up, saving, generated, tokens_left, step)

    def chain_stop(self, source: str = "draft_model") -> ChainStop:
        """This round's stop for a chain drafted one forward at a time, its nodes labelled ``source``
        (every chain drafter's: see ``Draft.sources``)."""
        return ChainStop(self.calibration, self.cost, source, optimistic=self.probing, overhead=self.overhead)

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
        node costs a smaller share of a round whose drafting was dear (counting only the forward,
        phrases hung below a draft model's chain would look far dearer than they are).

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
        bins = (depths, source_depths(draft), scores, calibration_labels(draft))
        reach = node_reach(self.calibration, draft, bins, max_depth, optimistic=self.probing)
        within = sum(1 for d in depths if d <= max_depth)
        if not prunable:
            expected = 1.0 + sum(reach[i] for i in range(len(draft)) if depths[i] <= max_depth)
            return self._planned(Plan(None, expected, cost(within + 1)), within)
        whole = whole_nodes(draft, whole_sources, depths, max_depth)
        if draft.probs is not None:
            keep = self._local_keep(draft, reach, depths, max_depth, whole, cost, rows)
        else:
            keep = best_prefix_keep(reach, depths, whole, cost, others + 1.0, self.overhead * rows + draft_seconds)
        # sampled drafts use past rounds' drafting time (this round's may depend on what was sampled)
        self._drafting += self.smoothing * (draft_seconds - self._drafting)
        kept = sum(keep)
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
        unknown = has_unexplored_frontier(self.calibration, draft, keep, bins, max_depth)
        if unknown:
            self._explore_budget -= max(extra, 0.0)
        return unknown

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
        return threshold_keep(draft, reach, depths, max_depth, whole, threshold)

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
            # are all pruned would be judged against it (and asked in every round while verifying
            # nothing)
            self._measure_plain(round_seconds - draft_seconds, forward_seconds)
        verified = len(tree)
        if asked and overridden is not None and draft is not None:
            # an explored round buys calibration with the exploring budget; judged whole, its extra
            # nodes' cost would also back asking off, and with it the rounds where the plan's own
            # nodes pay. Judge it as the plan would have gone: the accepted path up to its first
            # node the plan dropped, the round less the extra nodes' cost
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
        self.calibration.learn_round(tree, path, draft)
