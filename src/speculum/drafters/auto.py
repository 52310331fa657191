"""``auto``: every drafter the loaded model has, composed into one token tree each round.

Which drafters: the n-gram ones always (ANPD's multi-level table and prompt lookup: they cost
microseconds), trained heads when some ship for the target or are named (``medusa``, ``ctc``), and
the draft model when one is loaded (``draft_model``, which ``self:N`` drafts are too). Lookahead is
left out (its Jacobi window needs the target's output at every node it proposes, which a pruned,
composed tree does not promise). Ouroboros is there when named (``drafters=...,ouroboros``): the
draft model's chain as ``draft_model`` drafts it, with pool phrases checked by the draft and hung
below the chain; its chain nodes count as the draft model's and its phrases as ``phrases``. A
sampled request then samples by a noise (``samples_by_noise``), so the draft's picks match the
target's where the two distributions agree.

Each round the cheap drafters propose; the costly ones (the draft model, heads: each runs model
layers and an output layer as wide as the vocabulary) propose only while the rounds that ran them
have paid more per second than the same rounds would have without them (measured goodput against
the round with their drafting, their nodes' share of the forward and the tokens only they brought
taken out; explored again after a back-off of 1, 2, 4, ... rounds, as the controller does for
drafting at all), the draft model and the heads each judged apart (``GATE_GROUPS``; the gates are
in :mod:`speculum.drafters.model_gate`). A sampled round that runs the draft model verifies its
draft alone: beside a sampled chain the others' nodes are tried only after the sample is rejected,
where they rarely pay for their share of the forward. The proposals are merged into one draft
(:mod:`speculum.drafters.merged_draft`), the draft model's chain first: a deterministic node
(n-gram, heads) becomes one with an earlier node holding its token below the same parent (the
draft model's, else the first drafter listed keeps it), sampled branches stay apart (each is an
independent sample, which the verifier's multi-candidate rule needs), and every node remembers its
drafter (``Draft.sources``): the controller calibrates each drafter's scores apart and prunes the
merged tree to what pays on this machine, and the stats count accepted tokens by drafter. Each
drafter then observes the step in its own numbering, as if it had drafted alone.

Lossless as every method: the verifier decides, drafters only propose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from speculum.controller import by_batch_size
from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, Resources, check_options
from speculum.drafters.merged_draft import Part, merge, outcome_for
from speculum.drafters.model_gate import PRIOR_ACCEPTANCE, PRIOR_HEADS_GAIN, BatchRound, ModelGate
from speculum.errors import InvalidInputError, SpeculumError
from speculum.methods import SpeculativeConfig

__all__ = ["AutoDrafter", "ModelGate", "Options"]

CANDIDATES = ("anpd", "prompt_lookup", "medusa", "ctc", "draft_model", "ouroboros")
# what ``auto`` composes when ``drafters`` is not given (each where the loaded model has it). The draft
# model runs as Ouroboros (its chain, with pool phrases checked by the draft and hung below it): the
# phrases add accepted tokens to the draft forwards the chain runs anyway, greedy and at T=1, with
# the heads kept beside them (see docs/results.md)
DEFAULT_CANDIDATES = ("anpd", "prompt_lookup", "medusa", "ctc", "ouroboros")
# drafters that run the draft model (one of them at most: they would draft the same chain twice)
DRAFT_MODEL_PARTS = ("draft_model", "ouroboros")
# the ones whose drafting costs model forwards (a draft model; heads over the target's hidden state,
# each with an output layer as wide as the vocabulary), each group behind a gate of its own: a group
# runs while the rounds that ran it pay more per second than those that did not. Apart, because
# one can pay where the other does not: at T=1 a draft model can pay while heads beside it do not
# (their tokens are tried after the draft's sample is rejected, against what is left of p, where
# they are rarely accepted), while greedy both add
GATE_GROUPS = {"draft_model": "draft model", "ouroboros": "draft model", "medusa": "heads", "ctc": "heads"}
DRAFT_MODEL_GROUP = GATE_GROUPS["draft_model"]
# a batch's catch-up (every row's backlog side by side, padded to the longest, under a tree mask)
# per padded token against a lone prefill's, until the draft's clock has timed one (a measured
# ratio, see docs/results.md)
BATCH_CATCH_UP_PRIOR = 3.0


@dataclass
class Options:
    """Parameters of the ``auto`` method."""

    drafters: str | None = None  # comma-separated names from CANDIDATES; None: every one available
    num_speculative_tokens: int = 8  # the deepest draft the n-gram drafters and heads may propose
    # the draft model's most tokens a round: it stops earlier on its own confidence, and the
    # controller verifies its chain as drafted (the standalone draft_model's machine default)
    draft_depth: int = 20
    # the draft model's stop: it drafts on while its confidence in its next token is at least this.
    # Higher than draft_model's and Ouroboros' own CPU settings (0.5 and 0.2), which are floors below
    # the controller's chain stop; auto runs without the chain stop (see ``chain_stop``)
    draft_confidence: float = 0.8
    max_backoff: int = 32  # the draft model is tried again within this many rounds after it stopped paying
    # Ouroboros' phrase pool kept from one request to the next (its component 4); a server that keeps
    # pools per request (no --share-pools) turns it off, as it does for the method alone
    reuse_history: bool = True
    # true: the draft model's chain also ends where one more draft forward does not pay for itself,
    # by auto's controller (controller.ChainStop). Off: auto's gates already keep the draft model to
    # the rounds where it pays, and there the stop fires in a few rounds a request and costs auto
    # more than it saves, greedy and at T=1 (draft_model and Ouroboros alone gain by it)
    chain_stop: bool = False

    def __post_init__(self) -> None:
        ints = {"num_speculative_tokens": 1, "draft_depth": 1, "max_backoff": 1}
        check_options("auto", self, ints, ("reuse_history", "chain_stop"))
        confidence = self.draft_confidence
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 <= confidence < 1.0:
            raise InvalidInputError(f"auto: draft_confidence must be a number in [0, 1), got {confidence!r}")
        if self.drafters is not None:
            names = self.names()
            unknown = [n for n in names if n not in CANDIDATES]
            if unknown or not names:
                raise InvalidInputError(
                    f"auto: drafters must name some of {', '.join(CANDIDATES)}; got {self.drafters!r}"
                )
            if len(set(names) & set(DRAFT_MODEL_PARTS)) > 1:
                raise InvalidInputError(
                    f"auto: name one of {' and '.join(DRAFT_MODEL_PARTS)}: both run the draft model"
                )

    def names(self) -> list[str]:
        if self.drafters is None:
            return list(DEFAULT_CANDIDATES)
        if not isinstance(self.drafters, str):
            raise InvalidInputError(f"auto: drafters must be a comma-separated string, got {self.drafters!r}")
        return [n.strip() for n in self.drafters.split(",") if n.strip()]


def _sub_config(name: str, options: Options):
    """Each drafter's settings inside ``auto``: trees where the drafter has them (the controller prunes
    them), drafts up to ``num_speculative_tokens`` deep, the draft model up to ``draft_depth``,
    stopping on its own confidence."""
    depth, draft_depth = options.num_speculative_tokens, options.draft_depth
    params = {
        "anpd": {"num_speculative_tokens": depth, "tree": True},
        "prompt_lookup": {"num_speculative_tokens": depth},
        "medusa": {},
        "ctc": {},
        # the stop measured best for auto on the CPU: a draft below 0.8 confidence rarely pays here
        "draft_model": {
            "num_speculative_tokens": draft_depth,
            "length_policy": "confidence",
            "confidence_threshold": options.draft_confidence,
            "chain_stop": options.chain_stop,
        },
        # the same chain, its draft forwards also checking a pool phrase (the CPU setting's cheap
        # phrase drafting: no Jacobi window, the context's n-grams in the pool), and K pool
        # phrases below it
        "ouroboros": {
            "num_speculative_tokens": draft_depth,
            "length_policy": "confidence",
            "confidence_threshold": options.draft_confidence,
            "window_size": 0,
            "draft_guesses": 1,
            "context_phrases": True,
            "reuse_history": options.reuse_history,
            "chain_stop": options.chain_stop,
        },
    }[name]
    return SpeculativeConfig(name, controller=False, **params)


class AutoDrafter(Drafter):
    """Every available drafter, composed (see the module docstring)."""

    name: ClassVar[str] = "auto"
    Options: ClassVar[type] = Options

    def __init__(self, options: Options | None = None, resources: Resources | None = None):
        self.options = options = Options() if options is None else options
        resources = resources or Resources()
        explicit = options.drafters is not None
        self.parts: list[Part] = []
        skipped = []
        for name in options.names():
            if name in DRAFT_MODEL_PARTS and resources.draft_model is None:
                if explicit:
                    raise InvalidInputError(f"auto: {name} needs a draft model: load(..., draft=...)")
                continue
            if name == "ctc" and any(p.name == "medusa" for p in self.parts) and not explicit:
                continue  # one kind of heads is enough by default (Medusa's trees were accepted further)
            config = _sub_config(name, options)
            try:
                drafter = config.drafter_class()(config.options(), resources)
            except SpeculumError as exc:  # e.g. no heads ship for this model
                if explicit:
                    raise InvalidInputError(f"auto: {name}: {exc}") from None
                skipped.append(name)
                continue
            self.parts.append(Part(name, drafter))
        if not self.parts:
            raise InvalidInputError("auto: no drafter is available for this model")
        self.skipped = skipped
        self.wants_hidden_states = any(p.drafter.wants_hidden_states for p in self.parts)
        # a sampled request samples by a noise where a part drafts by it (Ouroboros)
        self.samples_by_noise = any(p.drafter.samples_by_noise for p in self.parts)
        # the draft model's chain is verified as its confidence stop drafted it: pruning it gives back
        # tokens whose drafting is already paid for; n-gram branches, phrases and head trees are pruned
        has_draft_model = bool(set(DRAFT_MODEL_PARTS) & set(self.names))
        self.whole_sources = frozenset({"draft_model"}) if has_draft_model else frozenset()
        # the model gates, one per group and batch size (a draft model that pays alone may not
        # beside 7 other rows), shared by every drafter of this configuration: what one request
        # learned, the next one starts from, and the rows of a batch decide together
        self._gates = resources.shared.setdefault(
            ("auto.model_gates", tuple(self.names), options.num_speculative_tokens, options.draft_depth,
             options.draft_confidence, options.max_backoff, options.chain_stop), {},
        )  # fmt: skip
        self.groups = list(dict.fromkeys(GATE_GROUPS[n] for n in self.names if n in GATE_GROUPS))
        # a draft forward's cost against the target's, before the draft's clock has timed one
        self._draft_size = _size_ratio(resources.draft_model, resources.target)
        self._deciding: dict[str, ModelGate] = {}  # group -> the gate that decided this round
        self._used: dict[str, bool] = {}  # group -> whether it runs this round
        self._drafting: dict[str, float] = {}  # group -> seconds its drafters took this round (this row's)
        self._proposed = False  # propose ran this round (the controller may have chosen a plain step)
        self._chain_alone = False  # this round verifies the draft model's draft alone (see _decide)
        self._round_start = 0.0

    @property
    def names(self) -> list[str]:
        """The drafters composed, in priority order."""
        return [p.name for p in self.parts]

    @property
    def forwards(self) -> int:
        return sum(p.drafter.forwards for p in self.parts)

    def check(self, sampling) -> None:
        for part in self.parts:
            part.drafter.check(sampling)

    def start(self, ctx: DraftContext) -> None:
        for part in self.parts:
            part.drafter.start(ctx)
            part.draft = None
        for group in self.groups:
            self.gate(1, group).catch_up_rule.start()
        # the last request may have ended on a drafted round, which was never observed
        self._proposed = False
        self._deciding, self._used = {}, {}

    def gate(self, rows: int = 1, group: str | None = None) -> ModelGate:
        """The gate of ``group`` (default: the first there is, the draft model's if loaded) for
        batches of ``rows`` rows (a new size starts from the nearest smaller one's)."""
        learned = self._gates.setdefault(group or (self.groups[0] if self.groups else "draft model"), {})
        return by_batch_size(learned, rows, lambda: ModelGate(self.options.max_backoff))

    def _runs(self, part: Part) -> bool:
        """Whether ``part`` proposes this round (the cheap ones always, but for a sampled round
        that runs the draft model, which verifies its draft alone)."""
        if self._chain_alone:
            return part.name in DRAFT_MODEL_PARTS
        return part.name not in GATE_GROUPS or self._used[GATE_GROUPS[part.name]]

    def _decide(self, gates: dict[str, ModelGate], used: dict[str, bool], sampled: bool) -> None:
        """This round's decisions (``used``: ``gates``' ``use``, made once for every row of a batch).

        A ``sampled`` round that runs the draft model verifies the draft model's draft alone: the
        other drafters' nodes beside its sampled chain are tried only once the target rejects the
        sample, against what is left of p, where at T=1 they are rarely accepted, while their
        drafting and their share of the forward make the round dearer than ``draft_model``'s for
        the same tokens. The heads' gate does not learn from such a round."""
        self._round_start = time.perf_counter()
        self._proposed = True
        self._chain_alone = sampled and used.get(DRAFT_MODEL_GROUP, False)
        if self._chain_alone:
            gates = {DRAFT_MODEL_GROUP: gates[DRAFT_MODEL_GROUP]}
        self._deciding, self._used = gates, used
        self._model_forwards = self._draft_model_forwards()
        self._drafting = {}
        self.catch_up_seconds = 0.0
        for part in self.parts:
            part.draft = None

    def _drafted(self, part: Part, draft: Draft | None, seconds: float) -> None:
        """``part``'s proposal this round, and what drafting it cost this row (its catching up
        apart: the engine and the gates judge the round without it)."""
        part.draft = draft if draft is not None and len(draft) else None
        catch_up = min(part.drafter.catch_up_seconds, seconds)
        self.catch_up_seconds += catch_up
        if part.name in GATE_GROUPS:
            group = GATE_GROUPS[part.name]
            self._drafting[group] = self._drafting.get(group, 0.0) + seconds - catch_up

    def propose(self, ctx: DraftContext) -> Draft | None:
        gates = {group: self.gate(ctx.rows, group) for group in self.groups}
        used = {group: gate.use() for group, gate in gates.items()}
        if ctx.rows == 1:  # alone, a group that must catch up first runs only where that pays
            generated, left = len(ctx.tokens) - ctx.prompt_length, ctx.max_depth + 1
            for group, gate in gates.items():
                if not used[group]:
                    continue
                catch_up = sum(p.drafter.catch_up_estimate(ctx) for p in self.parts if GATE_GROUPS.get(p.name) == group)
                if catch_up > 0.0:
                    used[group] = gate.worth_catching_up(catch_up, generated, left)
                if used[group]:
                    gate.catch_up_rule.used(generated)
        self._decide(gates, used, not ctx.sampling.greedy)
        for part in self.parts:
            if not self._runs(part):
                continue
            began = time.perf_counter()
            draft = part.drafter.propose(ctx)
            self._drafted(part, draft, time.perf_counter() - began)
        return self._merged()

    @property
    def batch_key(self):
        """Rows of the same parts whose draft model is the same propose together: each part then
        proposes for all of them at once (the draft model's forwards batched)."""
        keys = tuple(getattr(part.drafter, "batch_key", None) for part in self.parts)
        return ("auto", tuple(self.names), keys) if any(k is not None for k in keys) else None

    @classmethod
    def propose_rows(cls, drafters: list[AutoDrafter], ctxs: list[DraftContext]) -> list[Draft | None]:
        gates = {group: drafters[0].gate(ctxs[0].rows, group) for group in drafters[0].groups}
        used = {group: gate.use() for group, gate in gates.items()}  # one decision for the rows: a
        # draft model runs for all of them or none
        for group, gate in gates.items():  # predicted where a group has not run at this batch size
            if used[group]:
                batch = drafters[0]._batch_round(group, drafters, ctxs)
                if batch is not None:
                    used[group] = gate.catch_up_pays(batch) if gate.measured else gate.predicts_paying(batch)
        for drafter, ctx in zip(drafters, ctxs, strict=True):
            drafter._decide(gates, used, not ctx.sampling.greedy)
        for k in range(len(drafters[0].parts)):
            rows = [(d, ctx) for d, ctx in zip(drafters, ctxs, strict=True) if d._runs(d.parts[k])]
            if not rows:
                continue
            parts = [d.parts[k].drafter for d, _ in rows]
            began = time.perf_counter()
            if len(rows) > 1 and getattr(parts[0], "batch_key", None) is not None:
                drafts = type(parts[0]).propose_rows(parts, [ctx for _, ctx in rows])
            else:
                drafts = [p.propose(ctx) for p, (_, ctx) in zip(parts, rows, strict=True)]
            share = (time.perf_counter() - began) / len(rows)  # each row's part of the drafting
            for (d, _), draft in zip(rows, drafts, strict=True):
                d._drafted(d.parts[k], draft, share)
        return [drafter._merged() for drafter in drafters]

    def _draft_model_forwards(self) -> int:
        return sum(p.drafter.forwards for p in self.parts if p.name in DRAFT_MODEL_PARTS)

    def _batch_round(self, group: str, drafters: list[AutoDrafter], ctxs: list[DraftContext]) -> BatchRound | None:
        """The batch step ``group`` would run in, for its gate's prediction (None without a cost
        model: no controller). Heads draft row by row, as alone. A draft model's forward costs the
        clock's at that many rows where it has run, else scaled from where it has by the target's
        curve, else the target's scaled by the models' sizes; catching up costs the clock's seconds
        per token (or the target's prefill rate, scaled), for every token the rows' caches lack."""
        cost = ctxs[0].cost
        if cost is None:
            return None
        own, alone = len(drafters), self.gate(1, group)
        left = sum(
            alone.catch_up_rule.likely_left(len(ctx.tokens) - ctx.prompt_length, ctx.max_depth + 1) for ctx in ctxs
        )
        rows = max(ctxs[0].rows, own)
        if group != DRAFT_MODEL_GROUP:
            return BatchRound(cost, rows, own, own * alone.shape.drafting, 0.0, left, PRIOR_HEADS_GAIN)
        part = next(p.drafter for p in self.parts if p.name in DRAFT_MODEL_PARTS)
        steps = part.clock.step
        if own in steps:
            step = steps[own]
        elif steps:
            near = min(steps, key=lambda r: abs(r - own))
            step = steps[near] * cost.batch(own, 1) / cost.batch(near, 1)
        else:
            step = cost.batch(own, 1) * self._draft_size
        per_token = part.clock.per_padded_token
        if per_token is None:
            alone_rate = part.clock.per_token
            if alone_rate is None:
                alone_rate = cost.base(64) / 64 * self._draft_size
            per_token = BATCH_CATCH_UP_PRIOR * alone_rate
        # the rows' catch-ups run side by side, each padded to the longest
        backlog = 0
        for drafter, ctx in zip(drafters, ctxs, strict=True):
            model = next(p.drafter for p in drafter.parts if p.name in DRAFT_MODEL_PARTS)
            backlog = max(backlog, model.state.backlog(ctx.tokens) + 1)
        backlog *= own
        gain = sum(PRIOR_ACCEPTANCE**k for k in range(1, round(alone.shape.forwards) + 1))
        forwards = alone.shape.largest_forwards(own)  # the batch drafts until its longest chain ends
        return BatchRound(cost, rows, own, forwards * step, backlog * per_token, left, gain)

    @property
    def _merge_order(self) -> list[Part]:
        """The parts in the order their drafts are merged: the draft model's chain first, so its
        nodes come first among siblings. At T > 0 the verifier tries siblings in order, and an
        n-gram or head token tried before the chain's own (accepted with the target's p(x)) would
        lead down a short branch away from the chain, which the draft model alone follows several
        tokens deep. Greedy, the chain then owns the nodes other drafters share with it, so it
        stays whole (``whole_sources``)."""
        return sorted(self.parts, key=lambda part: part.name not in DRAFT_MODEL_PARTS)

    def _merged(self) -> Draft | None:
        """One draft of every part's (see the module docstring)."""
        return merge(self._merge_order)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        if self._proposed:  # the round's goodput, drafting and verification included
            # in a batch the engine says what the round cost this row (its drafting, its share of the
            # forward): the time since the round began is filled by every row's drafting alike;
            # either way without catching up (``Drafter.catch_up_seconds``)
            seconds = outcome.stats.get("row_seconds", time.perf_counter() - self._round_start - self.catch_up_seconds)
            tokens = len(outcome.accepted) + 1
            catch_up = self.catch_up_seconds if "row_seconds" in outcome.stats else 0.0  # (alone: CatchUpRule's)
            for group, gate in self._deciding.items():
                used = self._used[group]
                without = self._without({group}, outcome, seconds) if used else None
                gate.record(used, tokens, seconds, without, catch_up if used and group == DRAFT_MODEL_GROUP else 0.0)
            # alone, the round as it would have gone without every costly group that ran: the
            # controller judges asking by the better of the two, so heads that their gate is about
            # to turn off do not take the n-gram drafters' rounds down with them (judged with them,
            # auto would take plain steps in most rounds where the n-gram drafters alone pay)
            ran = {group for group in self._deciding if self._used[group]}
            if "row_seconds" not in outcome.stats:  # alone: what a round of each group that ran looks like
                for group in ran:
                    without = self._verified_without({group}, outcome)
                    forwards = self._draft_model_forwards() - self._model_forwards if group == DRAFT_MODEL_GROUP else 0
                    shape = self.gate(1, group).shape
                    shape.add(forwards, self._drafting.get(group, 0.0), outcome.drafted + 1, without + 1)
            if ran and "row_seconds" not in outcome.stats:
                lean = self._without(ran, outcome, seconds)
                if lean is not None:  # (tokens, seconds saved, the other drafters' nodes verified)
                    outcome.stats["lean_round"] = (lean[0], seconds - lean[1], self._verified_without(ran, outcome))
        for part in self.parts:
            part.drafter.observe(ctx, self._outcome_for(part, outcome))
            part.draft = None
        self._proposed = False
        self._deciding, self._used = {}, {}

    def _without(self, groups: set[str], outcome: Outcome, seconds: float) -> tuple[float, float] | None:
        """What this round would have given without the drafters of ``groups``: (tokens committed,
        seconds). The accepted path stops before its first node only those groups proposed (there
        the target's own token is committed instead, as the bonus), and the round costs their
        drafting less, and the forward ``node_cost(n) - node_cost(n - k)`` less for their k
        nodes verified (the engine's cost model; None without one)."""
        node_cost = outcome.stats.get("node_cost")
        target = outcome.target
        if node_cost is None or target is None:
            return None
        own: set[int] = set()  # merged nodes the group proposed
        others: set[int] = set()  # merged nodes another drafter proposed
        for part in self.parts:
            if part.draft is not None:
                (own if GATE_GROUPS.get(part.name) in groups else others).update(part.nodes)
        own -= others
        accepted = outcome.accepted_nodes
        cut = next((i for i, node in enumerate(accepted) if node in own), len(accepted))
        node_of = target.tree.node_of
        verified = {node_of[j] for j in own if j < len(node_of) and node_of[j] >= 0}
        verified -= {node_of[j] for j in others if j < len(node_of) and node_of[j] >= 0}
        n = outcome.drafted + 1  # the tree verified, root included
        drafting = sum(self._drafting.get(group, 0.0) for group in groups)
        saved = drafting + max(node_cost(n) - node_cost(n - len(verified)), 0.0)
        return cut + 1.0, max(seconds - saved, 1e-6)

    def _verified_without(self, groups: set[str], outcome: Outcome) -> int:
        """How many nodes the drafters outside ``groups`` had verified this round: the lean round's
        tree. Proposed nodes the controller pruned do not count: alone, those drafters would have
        verified nothing, a round the controller does not count either way."""
        node_of = outcome.target.tree.node_of if outcome.target is not None else []
        cheap = {
            node
            for part in self.parts
            if part.draft is not None and GATE_GROUPS.get(part.name) not in groups
            for node in part.nodes
        }
        return sum(1 for node in cheap if node < len(node_of) and node_of[node] >= 0)

    def _outcome_for(self, part: Part, outcome: Outcome) -> Outcome:
        """The step as ``part``'s drafter would have seen it alone (see :func:`outcome_for`)."""
        return outcome_for(part, outcome)

    def finish(self, ctx: DraftContext) -> None:
        for part in self.parts:
            part.drafter.finish(ctx)
        if getattr(ctx, "rows", 1) == 1:
            for group in self.groups:
                self.gate(1, group).catch_up_rule.finish(len(ctx.tokens) - ctx.prompt_length)

    def request_stats(self) -> dict:
        merged: dict = {}
        for part in self.parts:
            for key, value in part.drafter.request_stats().items():
                merged[key] = merged.get(key, 0) + value if isinstance(value, (int, float)) else value
        return merged


def _size_ratio(draft, target) -> float:
    """What a forward of ``draft`` costs against one of ``target``, by their parameters (0.5 where
    one is not known: a prior the draft's clock replaces once it has run)."""
    if draft is None or target is None:
        return 0.5
    try:
        draft_size = sum(p.numel() for p in draft.parameters())
        target_size = sum(p.numel() for p in target.parameters())
    except (AttributeError, TypeError):
        return 0.5
    return min(max(draft_size / max(target_size, 1), 0.01), 1.0)
