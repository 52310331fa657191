"""Ouroboros (Zhao et al., EMNLP 2024): a draft model sped up by phrases, drafts lengthened by phrases.

Four components, each can be switched off for the paper's ablation:

1. ``phrase_drafting`` — the draft model runs lookahead decoding (a Jacobi window and pool guesses
   in each of its forwards, :class:`~speculum.drafters.lookahead.JacobiWindow`), so γ draft tokens
   cost fewer draft forwards. The window carries over between rounds; the draft's own
   verification is greedy over its own logits.
2. ``lengthen`` — K (``num_phrase_candidates``) pool phrases that start with the last draft token
   hang below it as extra branches of the token tree, verified with the draft in ONE target
   forward. When the draft is fully accepted the verifier continues into them, and, unlike the
   reference code, the target's bonus token after a fully matched phrase is kept.
3. ``verification_phrases`` — phrases from verification (paper Section 3.3 / Figure 4): after a
   rejection, the target's own predictions along the rest of the draft, wherever they stay
   consistent with it, go into the pool under the draft token they follow; a tried phrase is
   replaced by the target's corrected version of it.
4. ``reuse_history`` — one pool serves every request of a ``Speculum`` (shared through
   ``Resources.shared``, so also across configurations with the same phrase length and capacity);
   ``pool_path`` loads it at start and saves it (atomically) after every request, so a warm start
   survives restarts (a failed save is logged; the request keeps its output). Off: each request
   starts with an empty pool.

Extensions, off by default: ``context_phrases`` also puts the prompt's and the output's own
n-grams in the pool (what prompt lookup copies from), and ``window_size=0`` with
``draft_guesses`` makes phrase drafting a cheap check of a few pool phrases by the draft, without
a Jacobi window.

How far each round drafts is a length policy (:mod:`speculum.policies`): ``fixed`` γ as in the
paper, or ``heuristic`` / ``confidence``; policies see every drafted token with the draft's logits
(and hidden state), also when one draft forward produced several.

The pool is LADE's/Ouroboros' (:class:`~speculum.drafters.phrase_pool.PhrasePool`): per key token
at most G phrases of N - 1 tokens, least recently used dropped. The Jacobi window's column n-grams
feed it too (the reference's lookahead trajectories).

Lossless for greedy decoding and sampling: the draft is greedy (deterministic), so every branch
is verified by the sample-and-match rule (exactly one-hot rejection sampling), as the authors
advise for temperature > 0 (their code is greedy only). In a seeded sampled request the draft
instead picks each token by the request's own noise (:class:`~speculum.sampling.PositionNoise`),
as ``draft_model`` does: the target picks its token at that position by the same noise, so a draft
token is accepted with probability near 1 - TV(p, q) instead of p(argmax q), which is what pays at
T = 1 on open chat (the text is the seed's, whatever is drafted). A sampled request without a seed
samples by a noise of fresh entropy for the same reason (``samples_by_noise``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from speculum import cache as cache_ops
from speculum.drafters.base import (
    Draft,
    DraftContext,
    Drafter,
    Outcome,
    Resources,
    check_options,
    check_tree_size,
    token_probability,
)
from speculum.drafters.draft_model import DraftModelState, begin_rows, catch_up_clock, fit_width, side_by_side
from speculum.drafters.lookahead import JacobiWindow
from speculum.drafters.phrase_pool import DEFAULT_MAX_KEYS, PhrasePool
from speculum.errors import InvalidInputError, PoolFileError
from speculum.policies import DraftStep, check_policy_options, policy_for
from speculum.runner import LazyLogits
from speculum.sampling import warp
from speculum.tree import TokenTree

__all__ = ["Options", "OuroborosDrafter"]

log = logging.getLogger(__name__)


@dataclass
class Options:
    """Parameters of the ``ouroboros`` method; defaults are the authors' Spec-Bench settings."""

    num_speculative_tokens: int = 6  # γ: draft tokens per round (before lengthening); the most a policy may use
    length_policy: str = "fixed"  # fixed (the paper) | heuristic | confidence | specdecpp | oracle (analysis)
    confidence_threshold: float = 0.4  # only for length_policy="confidence"
    acceptance_head: str | None = None  # length_policy="specdecpp": a trained head's checkpoint directory
    stop_threshold: float = 0.7  # specdecpp: stop when P(some candidate rejected) exceeds this (h)
    min_draft_tokens: int = 2  # specdecpp: never stop before this many tokens
    window_size: int = 15  # W: the draft's Jacobi window (0: phrase drafting guesses from the pool only)
    ngram_size: int = 5  # N: phrases are N - 1 tokens after their key token
    num_phrase_candidates: int = 3  # K: phrases lengthening each draft
    guess_set_size: int = 15  # G: phrases kept per key
    draft_guesses: int | None = None  # pool phrases the draft verifies per forward (None: all G, the paper)
    phrase_drafting: bool = True  # component 1
    lengthen: bool = True  # component 2
    verification_phrases: bool = True  # component 3
    reuse_history: bool = True  # component 4
    # Extension (not in the paper): the prompt's and the committed output's own n-grams go into the
    # pool too, so lengthening and phrase drafting also copy from the context (as prompt lookup does).
    context_phrases: bool = False
    pool_path: str | None = None  # loaded when present, saved after each request (needs reuse_history)
    max_pool_keys: int = DEFAULT_MAX_KEYS
    # under the controller, also end the chain where one more draft forward does not pay for itself
    # (not in the paper: controller.ChainStop)
    chain_stop: bool = True

    def __post_init__(self) -> None:
        ints = {
            "num_speculative_tokens": 1,
            "window_size": 0,
            "ngram_size": 2,
            "num_phrase_candidates": 0,
            "guess_set_size": 1,
            "max_pool_keys": 1,
        }
        bools = (
            "phrase_drafting", "lengthen", "verification_phrases", "reuse_history", "context_phrases", "chain_stop",
        )  # fmt: skip
        check_options("ouroboros", self, ints, bools, path="pool_path")
        if self.draft_guesses is not None:
            check_options("ouroboros", self, {"draft_guesses": 0})
        if self.pool_path is not None and not self.reuse_history:
            raise InvalidInputError("ouroboros: pool_path needs reuse_history=True")
        check_policy_options(self)
        gamma, phrase = self.num_speculative_tokens, self.phrase_length
        lengthened = gamma + self.num_phrase_candidates * phrase
        check_tree_size("ouroboros", lengthened, f"the target's tree: γ + K*(N-1) = {lengthened}")
        # the draft's own forwards: up to a round's accepted tokens as a chain, the Jacobi window and
        # the pool guesses below them
        guesses = self.guess_set_size if self.draft_guesses is None else self.draft_guesses
        drafting = lengthened + 1 + (self.window_size + guesses) * phrase
        check_tree_size("ouroboros", drafting, f"the draft's tree: γ + K*(N-1) + 1 + W*(N-1) + G*(N-1) = {drafting}")

    @property
    def phrase_length(self) -> int:
        return self.ngram_size - 1


class OuroborosDrafter(Drafter):
    """Ouroboros over a draft model or ``self:N`` (see the module docstring)."""

    name: ClassVar[str] = "ouroboros"
    samples_by_noise: ClassVar[bool] = True  # (its draft picks by the request's noise: see the module docstring)
    Options: ClassVar[type] = Options
    needs_draft_model = True

    # the draft model's chain is verified as drafted (its drafting is already paid for, and pruning
    # it would give back tokens it had bought); the controller prunes phrases
    whole_sources = frozenset({"draft_model"})

    def __init__(self, options: Options | None = None, resources: Resources | None = None):
        self.options = options = Options() if options is None else options
        resources = resources or Resources()
        if resources.draft_model is None:
            raise InvalidInputError("method 'ouroboros' needs a draft model: load(..., draft=...) or draft='self:N'")
        # Tree forwards over the draft read few rows (the walked path, the window's top level):
        # its LM head runs on those rows only.
        self.runner = resources.runner(resources.draft_model, lazy_head=True)
        self.state = DraftModelState(self.runner, resources.draft_model)
        self.policy = policy_for(options, resources.draft_model)
        self.clock = catch_up_clock(resources, resources.draft_model, "ouroboros")
        self.vocab_size = resources.vocab_size
        self.model_key = resources.model_key
        self.window = JacobiWindow(options.window_size, options.phrase_length)
        self._shared = resources.shared
        self.pool = self._pool()
        self._forwards = 0
        self._chain: list[int] = []
        self._phrases: list[tuple[tuple[int, ...], list[int]]] = []
        self._context_done = 0  # context_phrases: keys up to here are in the pool

    def _pool(self) -> PhrasePool:
        o = self.options
        if not o.reuse_history:
            return PhrasePool(o.guess_set_size, o.max_pool_keys)
        key = ("phrase_pool", o.phrase_length, o.guess_set_size, str(o.pool_path))
        if key not in self._shared:
            if o.pool_path is not None and os.path.exists(o.pool_path):
                pool = PhrasePool.load(
                    o.pool_path, model_key=self.model_key, capacity=o.guess_set_size, max_keys=o.max_pool_keys
                )
            else:
                pool = PhrasePool(o.guess_set_size, o.max_pool_keys)
            self._shared[key] = pool
        return self._shared[key]

    @property
    def forwards(self) -> int:
        return self._forwards

    # ------------------------------------------------------------------ protocol

    def check(self, sampling) -> None:
        self.policy.check(sampling)

    def start(self, ctx: DraftContext) -> None:
        self.state.reset()
        self.window.reset(ctx.tokens)
        self.policy.reset(ctx.sampling)
        if not self.options.reuse_history:
            self.pool = self._pool()
        self._forwards = 0
        self._context_done = 0
        # a request that ended on a drafted round left that round's draft unobserved; the next
        # request's first round may be a plain step, which must not read it
        self._chain, self._phrases = [], []
        self._add_context_phrases(ctx.tokens)

    def _add_context_phrases(self, tokens: list[int]) -> None:
        """context_phrases: every n-gram of the context not yet in the pool (the newest last, so the
        newest phrase of a key is the one seen most recently)."""
        if not self.options.context_phrases:
            return
        length = self.options.phrase_length
        self.pool.add_ngrams(tokens, length, start=self._context_done)
        self._context_done = max(self._context_done, len(tokens) - length)

    def _begin(self, ctx: DraftContext) -> PhraseRound | None:
        """This round's drafting, or None when the policy drafts nothing."""
        self.catch_up_seconds = 0.0
        self.policy.begin_round(ctx.tokens)
        room = self.state.room(ctx.tokens)
        budget = self.policy.budget(ctx.max_depth if room is None else min(ctx.max_depth, room))
        if budget < 1:
            return None
        self._chain, self._phrases = [], []
        return PhraseRound(self, ctx, budget)

    def catch_up_estimate(self, ctx: DraftContext) -> float:
        return self.clock.estimate(self.state.backlog(ctx.tokens))

    def propose(self, ctx: DraftContext) -> Draft | None:
        round_ = self._begin(ctx)
        return self._draft_alone(round_) if round_ is not None else None

    @property
    def batch_key(self):
        """Rows drafting with the same draft model run their draft forwards together (``propose_rows``)."""
        return ("ouroboros", id(self.runner.model))

    @classmethod
    def propose_rows(cls, drafters: list[OuroborosDrafter], ctxs: list[DraftContext]) -> list[Draft | None]:
        """Every row's draft with one draft forward per draft step for all of them (as
        ``DraftModelDrafter.propose_rows``: the rows' draft caches side by side for the round; a row
        whose round has ended rides along with a node whose keys are dropped). Each row drafts
        what it drafts alone: its tree, its window and its pool are its own."""
        rounds, live, alone = begin_rows(drafters, ctxs)
        if alone is not None:
            return alone
        runner = drafters[live[0]].runner
        needs_hidden = any(drafters[i].policy.needs_hidden for i in live)
        with side_by_side(runner, [drafters[i].state for i in live]) as (cache, lengths):
            while not all(rounds[i].done for i in live):
                trees = [TokenTree([ctxs[i].tokens[-1]], [-1]) if rounds[i].done else rounds[i].tree() for i in live]
                fed = [1 if rounds[i].done else len(rounds[i].forced) for i in live]
                columns = cache_ops.cache_length(cache)
                began = time.perf_counter()
                outs = runner.forward_rows(cache, trees, lengths, hidden=needs_hidden)
                paths = [[] if rounds[i].done else rounds[i].path(out.logits)
                         for i, out in zip(live, outs, strict=True)]  # fmt: skip
                runner.commit_rows(cache, columns, lengths, paths)
                drafters[live[0]].clock.charge([drafters[i] for i in live], fed, time.perf_counter() - began)
                for n, (i, out, path) in enumerate(zip(live, outs, paths, strict=True)):
                    if path:
                        lengths[n] += len(path)
                        rounds[i].take(out.logits, out.hidden)
        return [rounds[i].draft() if rounds[i] is not None else None for i in range(len(drafters))]

    def _draft_alone(self, round_: PhraseRound) -> Draft | None:
        state = self.state
        while not round_.done:
            tree = round_.tree()
            past, fed = len(state.seen), len(round_.forced)
            began = time.perf_counter()
            out = self.runner.forward(state.cache, tree, hidden=self.policy.needs_hidden)
            path = round_.path(out.logits)
            self.runner.commit(state.cache, past, path)
            self.clock.charge([self], [fed], time.perf_counter() - began)
            round_.take(out.logits, out.hidden)
        return round_.draft()

    def _rows(self, logits, nodes: list[int]) -> torch.Tensor:
        """The draft's logits after each of ``nodes``, over the target's vocabulary."""
        rows = logits.take(nodes) if isinstance(logits, LazyLogits) else logits[nodes]
        return fit_width(rows, self.vocab_size)

    def _argmax(self, logits, nodes: list[int]) -> list[int]:
        """The draft's greedy token after each of ``nodes``."""
        return self._rows(logits, nodes).argmax(dim=-1).tolist()

    def _lengthened(self, chain: list[int], ctx: DraftContext, scores: list[float] | None = None) -> Draft:
        """The draft chain with up to K pool phrases below its last token (component 2); ``scores``:
        the chain's (the phrases have none: the controller learns how they fare by depth)."""
        self._chain = chain
        self._phrases = []
        tokens, parents = list(chain), list(range(-1, len(chain) - 1))
        room = ctx.max_depth - len(chain)
        if self.options.lengthen and room > 0 and chain[-1] not in ctx.eos_token_ids:
            for phrase in self.pool.get(chain[-1], self.options.num_phrase_candidates):
                ids: list[int] = []
                parent = len(chain) - 1
                for token in phrase[:room]:
                    if self.vocab_size is not None and token >= self.vocab_size:
                        break
                    parents.append(parent)
                    parent = len(tokens)
                    ids.append(parent)
                    tokens.append(token)
                if ids:
                    self._phrases.append((phrase, ids))
        if scores is not None:
            scores = scores + [None] * (len(tokens) - len(chain))
        sources = ["draft_model"] * len(chain) + ["phrases"] * (len(tokens) - len(chain))
        return Draft(tokens, parents, scores=scores, sources=sources)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        if self.options.context_phrases:
            self._add_context_phrases(ctx.tokens)  # the tokens just committed
        # this round's draft, consumed here (a plain step the controller chose has none)
        chain, phrases, self._chain, self._phrases = self._chain, self._phrases, [], []
        if chain:
            self.policy.update(min(len(outcome.accepted), len(chain)), len(chain))
        if not self.options.verification_phrases or outcome.target is None or not chain:
            return
        length = self.options.phrase_length
        after = outcome.target.argmax_of(list(range(len(chain))))  # the target's token after each draft token
        rejected_at = len(outcome.accepted)
        if rejected_at < len(chain):
            # Matched sub-segments of the rejected tail: from each draft token on, the target's
            # predictions for as long as the draft agrees with them (so each one's context is the
            # one the phrase claims).
            for i in range(rejected_at, len(chain)):
                phrase = [after[i]]
                for j in range(i + 1, len(chain)):
                    if chain[j] != phrase[-1] or after[j] is None:
                        break
                    phrase.append(after[j])
                if len(phrase) >= 2 and None not in phrase:
                    self.pool.add(chain[i], phrase[:length])
            return
        # The draft was accepted whole, so the tried phrases were read in the right context:
        # each is replaced by the target's own version of it.
        key, first = chain[-1], after[-1]
        if first is None:
            return
        for phrase, ids in phrases:
            predicted = outcome.target.argmax_of(ids)
            corrected = [first]
            for token, nxt in zip(phrase, predicted, strict=False):
                if token != corrected[-1] or nxt is None:
                    break
                corrected.append(nxt)
            corrected = corrected[:length]
            if tuple(corrected) != tuple(phrase):
                self.pool.replace(key, phrase, corrected)

    # Save the pool (pool_path) when a request ends; a server turns this off and saves on its own schedule.
    save_on_finish: bool = True

    def finish(self, ctx: DraftContext) -> None:
        # a kept drafter waits for its next request without the last one's cache (the pool stays)
        self.state.reset()
        if self.options.pool_path is None or not self.save_on_finish:
            return
        try:
            self.save()
        except PoolFileError as exc:  # the request's output is made: keep it, try again after the next one
            log.warning("ouroboros: the phrase pool was not saved: %s", exc)

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the phrase pool (default: ``pool_path``) atomically."""
        path = path if path is not None else self.options.pool_path
        if path is None:
            raise PoolFileError("ouroboros: no path given and no pool_path set")
        self.pool.save(path, model_key=self.model_key)


class PhraseRound:
    """One round of Ouroboros' drafting for one request: each draft forward verifies the tokens the
    draft has not seen as a chain, with the Jacobi window and pool guesses below its last token
    (the draft's own greedy verification: accepted guesses are several draft tokens for one
    forward). ``tree`` gives the next forward's tree, ``path`` the nodes the draft accepts from its
    output (their keys are kept), ``take`` the tokens it produced; whether the forward ran for this
    request alone or beside others (``OuroborosDrafter.propose_rows``) does not matter here."""

    def __init__(self, drafter: OuroborosDrafter, ctx: DraftContext, budget: int):
        self.drafter, self.ctx, self.budget = drafter, ctx, budget
        keep = drafter.state.catch_up(ctx.tokens)
        self.forced = ctx.tokens[keep:]  # not in the draft's cache yet; the last one is where drafting starts
        self.chain: list[int] = []
        self.scores: list[float] = []  # the draft's probability of each chain token (for a controller)
        self.done = False
        self._tree: TokenTree | None = None
        self._anchor = -1
        self._path: list[int] = []
        self._best = 0
        self._dists: dict[int, torch.Tensor] = {}  # node -> the draft's warped distribution after it (coupled)

    def tree(self) -> TokenTree:
        d, forced = self.drafter, self.forced
        tokens: list[int] = list(forced[1:])
        parents: list[int] = list(range(-1, len(tokens) - 1))
        self._anchor = len(tokens) - 1  # draft index of the last forced token (-1: the root)
        if d.options.phrase_drafting:
            if d.options.window_size > 0:
                d.window.add_to(tokens, parents, root=self._anchor)
            guesses = d.options.draft_guesses
            for phrase in d.pool.get(forced[-1], d.options.guess_set_size if guesses is None else guesses):
                parent = self._anchor
                for token in phrase:
                    parents.append(parent)
                    parent = len(tokens)
                    tokens.append(token)
        state = d.state
        # cut where the draft's positions run out (the forced tokens always fit: see ``_begin``)
        depth = state.depth_left()
        self._tree = TokenTree.from_draft(state.feed(forced[:1])[0], Draft(state.feed(tokens), parents), depth)
        return self._tree

    def path(self, logits) -> list[int]:
        """The tree nodes the draft keeps: the forced chain, then its guesses as far as its own
        choice follows them. The choice is greedy, or in a sampled request with a noise the token that
        request's noise picks from the draft's warped distribution at that position, as
        ``draft_model`` samples its chain: the target samples with the same noise, so the two agree
        far more often than on the draft's argmax where the distributions are flat."""
        d, tree, ctx = self.drafter, self._tree, self.ctx
        node = 0 if self._anchor < 0 else tree.node_of[self._anchor]
        path = tree.path_to(node)
        coupled = ctx.noise is not None and not ctx.sampling.greedy
        position = len(ctx.tokens) - ctx.prompt_length + len(self.chain)  # generated position of the next token
        self._dists = {}
        while True:
            if coupled:
                dist = warp(d._rows(logits, [path[-1]])[0], ctx.sampling)[0]
                self._dists[path[-1]] = dist
                best = ctx.noise.choose(dist, position)
            else:
                best = d._argmax(logits, [path[-1]])[0]
            child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == best), None)
            if child is None:
                break
            path.append(child)
            position += 1
        self._path, self._best = path, best
        return path

    def take(self, logits, hidden) -> None:
        """After the forward and its commit: the tokens produced, the window stepped, the chain grown."""
        d, tree, path, forced, ctx = self.drafter, self._tree, self._path, self.forced, self.ctx
        d._forwards += 1
        produced = [tree.tokens[n] for n in path[len(forced) :]] + [self._best]
        d.state.seen.extend(forced + produced[:-1])
        if d.options.phrase_drafting and d.options.window_size > 0:
            top = [tree.node_of[j] for j in d.window.top_nodes]
            # a top node cut at the draft's context has no output: the window waits a step
            d.pool.add_all(d.window.step(d._argmax(logits, top) if min(top, default=0) >= 0 else None))
        deciding = path[len(forced) - 1 :]  # the node whose output chose each produced token
        rows = d._rows(logits, deciding)
        states = hidden[deciding] if hidden is not None else [None] * len(deciding)
        policy, chain = d.policy, self.chain
        stop = ctx.chain_stop if d.options.chain_stop else None
        for node, token, row, state in zip(deciding, produced, rows, states, strict=True):
            if d.vocab_size is not None and token >= d.vocab_size:
                self.done = True  # a draft-only id the target cannot verify
                return
            if policy.stop_before(DraftStep(len(chain), token, row, None, state)):
                self.done = True
                return
            chain.append(token)
            if ctx.wants_scores:  # (sampled: of the most likely token, as draft_model's)
                dist = self._dists.get(node)
                self.scores.append(token_probability(row, token) if dist is None else float(dist.max()))
            if stop is not None:
                stop.add(self.scores[-1] if self.scores else None)
            if token in ctx.eos_token_ids or len(chain) >= self.budget:
                self.done = True
                return
            if policy.should_stop(DraftStep(len(chain) - 1, token, row, None, state)):
                self.done = True
                return
        # (the tokens one forward produced cost nothing more to draft: the stop weighs the next forward)
        if stop is not None and not stop.worth_another(d.clock.step.get(1)):
            self.done = True
            return
        self.forced = [chain[-1]]

    def draft(self) -> Draft | None:
        if not self.chain:
            return None
        return self.drafter._lengthened(self.chain, self.ctx, self.scores or None)
