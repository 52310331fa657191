"""Speculative decoding / sampling with a separate (smaller) draft model (Leviathan et al.; Chen et al.).

The draft model keeps its own KV cache (through its own ModelRunner). Each round it catches up on
the tokens it has not seen, then drafts up to K tokens autoregressively (greedy: argmax; sampling:
from its warped distribution q, which the verifier needs for the min(1, p/q) rule). The round's
length comes from a length policy (fixed K, transformers' heuristic, a confidence stop, ...),
which sees each drafted token with the draft's logits (and hidden state, if it asks).

The draft's logits are fitted to the target's width before anything else: cut when the draft's
head is wider, padded with -inf (no probability mass) when the target's is (Qwen2.5-7B's padded
152,064-row head against the 0.5B's 151,936). A token the target emits that the draft cannot
embed (one of those padding ids) reaches the draft as its pad token instead
(:class:`DraftModelState`, shared with Ouroboros).

A draft model whose context is shorter than the target's drafts only while every position it is
fed stays inside it; past that the rounds are plain steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from speculum import cache as cache_ops
from speculum.drafters.base import (
    Draft,
    DraftContext,
    Drafter,
    Outcome,
    Resources,
    check_options,
    token_probability,
)
from speculum.errors import InvalidInputError
from speculum.policies import DraftStep, check_policy_options, default_draft_length, policy_for
from speculum.sampling import sample, warp
from speculum.tree import TokenTree


@dataclass
class Options:
    num_speculative_tokens: int | None = None  # at most per round; None: 5, or 20 for specdecpp/oracle
    length_policy: str = "heuristic"  # fixed | heuristic | confidence | specdecpp | oracle (analysis only)
    confidence_threshold: float = 0.4  # only for length_policy="confidence"
    acceptance_head: str | None = None  # length_policy="specdecpp": a trained head's checkpoint directory
    stop_threshold: float = 0.7  # specdecpp: stop when P(some candidate rejected) exceeds this (h)
    min_draft_tokens: int = 2  # specdecpp: never stop before this many tokens
    # under the controller, also end the chain where one more draft forward does not pay for itself
    # (its measured cost and the calibrated chance of the next token: controller.ChainStop)
    chain_stop: bool = True

    def __post_init__(self) -> None:
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = default_draft_length(self.length_policy, 5)
        check_options("draft_model", self, {}, ("chain_stop",))
        check_policy_options(self)


def fit_width(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """The draft's ``logits`` (vocabulary last) at the target's ``width``: cut where the draft's head
    is wider, padded with -inf (no probability mass) where it is narrower (None: as they are)."""
    if width is None or logits.shape[-1] == width:
        return logits
    if logits.shape[-1] > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DraftModelState:
    """A draft model's KV cache across the rounds of one request, kept in step with the committed text.

    ``seen`` lists the tokens whose keys/values are in the cache; ``catch_up`` crops it to the
    longest prefix shared with the committed tokens. Ids the draft cannot embed (a target head
    padded wider than the draft's embeddings) are fed as ``stand_in``: the draft's guesses get
    worse for a moment, the output does not change.

    Drafting keeps every position fed below the draft's context less one (``room``,
    ``depth_left``): in a batch, a row whose round has ended rides along in the others' forwards
    with one more node at its next position.
    """

    def __init__(self, runner, draft_model: torch.nn.Module):
        self.runner = runner
        self.embeddable = draft_model.get_input_embeddings().num_embeddings
        self.stand_in = getattr(draft_model.config, "pad_token_id", None) or 0
        self.positions = runner.max_positions  # the draft's context (None: not known, no limit)
        self.reset()

    def room(self, tokens: list[int]) -> int | None:
        """The most tokens a round may draft after the committed ``tokens`` (None: no limit): k
        drafted tokens feed positions up to len(tokens) + k - 2 (the last one is never fed), which
        stays below the context less one."""
        return None if self.positions is None else self.positions - len(tokens)

    def depth_left(self) -> int | None:
        """The deepest node of a tree fed after ``seen`` (its root at depth 0; None: no limit)."""
        return None if self.positions is None else self.positions - 2 - len(self.seen)

    def backlog(self, tokens: list[int]) -> int:
        """Committed tokens the next round must feed beyond its root (at least; a stale draft
        token in the cache adds to it)."""
        return max(0, len(tokens) - 1 - len(self.seen))

    def reset(self) -> None:
        """Forget the request: an empty cache (what an idle drafter holds between requests)."""
        self.cache = self.runner.new_cache()
        self.seen: list[int] = []
        self.committed = 0  # leading entries of seen known to be committed tokens

    def feed(self, token_ids: list[int]) -> list[int]:
        return [t if t < self.embeddable else self.stand_in for t in token_ids]

    def catch_up(self, tokens: list[int]) -> int:
        """Crop the cache to the longest prefix it shares with the committed ``tokens`` (always
        leaving the last one to feed); returns its length. Only positions after the tokens already
        committed at the last round can differ, so only those are compared. A round begun again
        on the same tokens (its batched forward raised: each row drafts alone) catches up as the
        first did."""
        limit = min(len(self.seen), len(tokens) - 1)
        keep = min(self.committed, limit)
        while keep < limit and self.seen[keep] == tokens[keep]:
            keep += 1
        self.runner.crop(self.cache, keep)
        del self.seen[keep:]
        self.committed = len(tokens)
        return keep


class CatchUpClock:
    """What a draft forward of one new token per row costs, by batch size (a moving average kept
    across requests); a forward that also catches up on committed text (``fed`` > 1 tokens for
    some row) is charged to the catch-up beyond that (see ``Drafter.catch_up_seconds``)."""

    SMOOTHING = 0.2
    # catch-ups of at least this many tokens teach the cost per token caught up (a prompt's prefill
    # runs at the model's throughput; a token or two more than one costs next to nothing extra)
    PER_TOKEN_BACKLOG = 16

    def __init__(self) -> None:
        self.step: dict[int, float] = {}  # rows -> seconds of a one-token-per-row forward
        self.per_token: float | None = None  # seconds per token of a long catch-up, alone (a moving average)
        # the same in a batch, per token of the rows' catch-ups padded to the longest (side by side)
        self.per_padded_token: float | None = None

    def estimate(self, backlog: int) -> float:
        """Seconds a lone catch-up of ``backlog`` tokens beyond the round's root costs (0 before any
        long one was timed)."""
        return backlog * self.per_token if self.per_token is not None and backlog > 0 else 0.0

    def charge(self, drafters: list, fed: list[int], seconds: float) -> None:
        """One draft forward of ``seconds`` that fed ``fed[i]`` tokens for ``drafters[i]``'s row."""
        rows = len(fed)
        step = self.step.get(rows)
        if max(fed) <= 1:
            self.step[rows] = seconds if step is None else step + self.SMOOTHING * (seconds - step)
            return
        # before any one-token forward was timed: the catch-up's share of the tokens fed
        excess = max(seconds - step, 0.0) if step is not None else seconds * (1.0 - rows / sum(fed))
        backlog = sum(n - 1 for n in fed)
        for drafter, n in zip(drafters, fed, strict=True):
            drafter.catch_up_seconds += excess * (n - 1) / backlog
        if rows == 1 and backlog >= self.PER_TOKEN_BACKLOG:
            rate, known = excess / backlog, self.per_token
            self.per_token = rate if known is None else known + self.SMOOTHING * (rate - known)
        elif rows > 1 and max(fed) - 1 >= self.PER_TOKEN_BACKLOG:
            rate, known = excess / (rows * (max(fed) - 1)), self.per_padded_token
            self.per_padded_token = rate if known is None else known + self.SMOOTHING * (rate - known)


def catch_up_clock(resources: Resources, model: torch.nn.Module, kind: str = "draft_model") -> CatchUpClock:
    """The clock of ``model``'s draft forwards by the drafters of one ``kind`` (Ouroboros' forwards
    verify trees, not chains: a clock of their own), shared by every request."""
    return resources.shared.setdefault((kind + ".catch_up_clock", id(model)), CatchUpClock())


@contextmanager
def side_by_side(runner, states: list[DraftModelState]) -> Iterator[tuple[object, list[int]]]:
    """The rows' draft caches side by side for one round (the target's batch layout, ``cache.join``)
    with each row's length, to be kept up to date by the caller; each state gets its row back at the end.

    The caller extends a row's ``seen`` only once the forward that fed those tokens is committed,
    so each row gets back the columns its ``seen`` holds: also when the round raises part way,
    its state stays consistent and the row can draft alone from there."""
    cache = runner.new_cache()
    lengths = []
    for n, state in enumerate(states):
        lengths.append(len(state.seen))
        cache_ops.join(cache, n, state.cache)
    try:
        yield cache, lengths
    finally:
        seen = [len(state.seen) for state in states]
        for state, row_cache in zip(states, cache_ops.split_rows(cache, seen), strict=True):
            state.cache = row_cache


def begin_rows(drafters: list, ctxs: list[DraftContext]) -> tuple[list, list[int], list[Draft | None] | None]:
    """Each row's round begun (its drafter's ``_begin``), the rows that draft, and, when fewer than
    two do (nothing to batch), every row's draft made alone (else None). Shared by the drafters
    whose rows run their draft forwards together (draft_model, ouroboros)."""
    rounds = [d._begin(ctx) for d, ctx in zip(drafters, ctxs, strict=True)]
    live = [i for i, r in enumerate(rounds) if r is not None]
    if len(live) >= 2:
        return rounds, live, None
    return rounds, live, [drafters[i]._draft_alone(rounds[i]) if i in live else None for i in range(len(drafters))]


class DraftRound:
    """One round of drafting for one request: the tokens drafted so far and when to stop, whether
    the draft model's forwards run for this request alone (``propose``) or for a batch of them
    (``propose_rows``)."""

    def __init__(self, drafter: DraftModelDrafter, ctx: DraftContext, budget: int):
        self.drafter, self.ctx, self.budget = drafter, ctx, budget
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.scores: list[float] = []

    def catch_up(self) -> list[int]:
        """What the draft model must be fed first: the committed tokens it has not seen."""
        keep = self.drafter.state.catch_up(self.ctx.tokens)
        return self.ctx.tokens[keep:]

    def take(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[int] | None:
        """The draft's next token from ``logits``; what to feed next, or None when the round ends."""
        ctx, policy = self.ctx, self.drafter.policy
        if ctx.sampling.greedy:
            dist = None
            token = int(logits.argmax())
        else:
            dist = warp(logits, ctx.sampling)[0]
            if ctx.noise is not None:  # the noise the target samples this position with: they agree more
                token = ctx.noise.choose(dist, len(ctx.tokens) - ctx.prompt_length + len(self.tokens))
            else:
                token = sample(dist, ctx.generator)
        position = len(self.tokens)
        if policy.stop_before(DraftStep(position, token, logits, dist, hidden)):
            return None
        if dist is not None:
            self.probs.append(dist)
        if ctx.wants_scores:
            # greedy: the draft's probability of its token; sampled: of its most likely token (a
            # sampled token's own value must not decide whether it is verified)
            self.scores.append(token_probability(logits, token) if dist is None else float(dist.max()))
        self.tokens.append(token)
        if len(self.tokens) >= self.budget or token in ctx.eos_token_ids:
            return None
        if policy.should_stop(DraftStep(position, token, logits, dist, hidden)):
            return None
        stop = ctx.chain_stop if self.drafter.options.chain_stop else None
        if stop is not None:
            stop.add(self.scores[-1] if self.scores else None)
            if not stop.worth_another(self.drafter.clock.step.get(1)):
                return None
        return [token]

    def draft(self) -> Draft | None:
        if not self.tokens:
            return None
        probs = torch.stack(self.probs) if self.probs else None
        # labelled as in every composed draft, so the controller calibrates the chain as ChainStop reads it
        return Draft.chain(self.tokens, probs, self.scores or None, source="draft_model")


class DraftModelDrafter(Drafter):
    name = "draft_model"
    needs_draft_model = True

    def __init__(self, options: Options, resources: Resources | None = None):
        resources = resources or Resources()
        if resources.draft_model is None:
            raise InvalidInputError("method 'draft_model' needs a draft model: load(..., draft=...)")
        self.options = options
        self.runner = resources.runner(resources.draft_model)
        self.state = DraftModelState(self.runner, resources.draft_model)
        self.vocab_size = resources.vocab_size  # the target's: draft distributions are fitted to it
        self.policy = policy_for(options, resources.draft_model)
        self.clock = catch_up_clock(resources, resources.draft_model)
        self._forwards = 0
        self._asked = False  # propose ran this round

    @property
    def forwards(self) -> int:
        return self._forwards

    def check(self, sampling) -> None:
        self.policy.check(sampling)

    def start(self, ctx: DraftContext) -> None:
        self.state.reset()
        self.policy.reset(ctx.sampling)
        self._forwards = 0

    @property
    def batch_key(self):
        """Rows drafting with the same draft model run their draft forwards together (``propose_rows``)."""
        return ("draft_model", id(self.runner.model))

    def _forward(self, token_ids: list[int], ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``token_ids``; the draft's logits after the last one (on the sampling device, at the
        target's width) and, if the policy reads it, its hidden state there."""
        state = self.state
        out = self.runner.forward(state.cache, state.feed(token_ids), last_only=True, hidden=self.policy.needs_hidden)
        self._forwards += 1
        state.seen.extend(token_ids)
        logits = fit_width(out.logits[-1].to(ctx.device), self.vocab_size)
        return logits, out.hidden[-1] if out.hidden is not None else None

    def _begin(self, ctx: DraftContext) -> DraftRound | None:
        """This round's drafting, or None when the policy drafts nothing."""
        self._asked = True
        self.catch_up_seconds = 0.0
        self.policy.begin_round(ctx.tokens)
        room = self.state.room(ctx.tokens)
        budget = self.policy.budget(ctx.max_depth if room is None else min(ctx.max_depth, room))
        return DraftRound(self, ctx, budget) if budget >= 1 else None

    def catch_up_estimate(self, ctx: DraftContext) -> float:
        return self.clock.estimate(self.state.backlog(ctx.tokens))

    def propose(self, ctx: DraftContext) -> Draft | None:
        round_ = self._begin(ctx)
        return self._draft_alone(round_) if round_ is not None else None

    def _draft_alone(self, round_: DraftRound) -> Draft | None:
        feed = round_.catch_up()
        while feed:
            began = time.perf_counter()
            logits, hidden = self._forward(feed, round_.ctx)
            self.clock.charge([self], [len(feed)], time.perf_counter() - began)
            feed = round_.take(logits, hidden)
        return round_.draft()

    @classmethod
    def propose_rows(cls, drafters: list[DraftModelDrafter], ctxs: list[DraftContext]) -> list[Draft | None]:
        """Every row's draft with one draft forward per draft step for all of them: the rows' draft
        caches sit side by side for the round (the target's batch layout, ``cache.join``), each
        row feeds its catch-up tokens then its drafted tokens, a row whose round has ended rides
        along with a node whose keys are dropped, and the caches are split back at the end."""
        rounds, live, alone = begin_rows(drafters, ctxs)
        if alone is not None:
            return alone
        runner = drafters[live[0]].runner
        needs_hidden = any(drafters[i].policy.needs_hidden for i in live)
        feeds = [rounds[i].catch_up() for i in live]
        with side_by_side(runner, [drafters[i].state for i in live]) as (cache, lengths):
            while any(feeds):
                chains = [drafters[i].state.feed(feed or [ctxs[i].tokens[-1]])
                          for i, feed in zip(live, feeds, strict=True)]  # fmt: skip
                trees = [TokenTree(chain, list(range(-1, len(chain) - 1))) for chain in chains]
                columns = cache_ops.cache_length(cache)
                began = time.perf_counter()
                outs = runner.forward_rows(cache, trees, lengths, hidden=needs_hidden)
                paths = [list(range(len(feed))) for feed in feeds]
                runner.commit_rows(cache, columns, lengths, paths)
                drafters[live[0]].clock.charge(
                    [drafters[i] for i in live], [len(chain) for chain in chains], time.perf_counter() - began
                )
                for n, (i, feed) in enumerate(zip(live, feeds, strict=True)):
                    if not feed:
                        continue
                    drafter, out = drafters[i], outs[n]
                    drafter._forwards += 1
                    drafter.state.seen.extend(feed)
                    lengths[n] += len(feed)
                    logits = fit_width(out.logits[len(feed) - 1].to(ctxs[i].device), drafter.vocab_size)
                    hidden = out.hidden[len(feed) - 1] if out.hidden is not None else None
                    feeds[n] = rounds[i].take(logits, hidden) or []
        return [rounds[i].draft() if rounds[i] is not None else None for i in range(len(drafters))]

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        if self._asked:  # (a plain step the controller chose says nothing about the draft length)
            self.policy.update(len(outcome.accepted), outcome.drafted)
        self._asked = False

    def finish(self, ctx: DraftContext) -> None:
        # a kept drafter waits for its next request without the last one's cache
        self.state.reset()
