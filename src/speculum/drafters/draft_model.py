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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome, Resources, token_probability
from speculum.errors import InvalidInputError
from speculum.policies import DraftStep, check_policy_options, default_draft_length, policy_for
from speculum.sampling import sample, warp


@dataclass
class Options:
    num_speculative_tokens: int | None = None  # at most per round; None: 5, or 20 for specdecpp/oracle
    length_policy: str = "heuristic"  # fixed | heuristic | confidence | specdecpp | oracle (analysis only)
    confidence_threshold: float = 0.4  # only for length_policy="confidence"
    acceptance_head: str | None = None  # length_policy="specdecpp": a trained head's checkpoint directory
    stop_threshold: float = 0.7  # specdecpp: stop when P(some candidate rejected) exceeds this (h)
    min_draft_tokens: int = 2  # specdecpp: never stop before this many tokens

    def __post_init__(self) -> None:
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = default_draft_length(self.length_policy, 5)
        check_policy_options(self)


class DraftModelState:
    """A draft model's KV cache across the rounds of one request, kept in step with the committed text.

    ``seen`` lists the tokens whose keys/values are in the cache; ``catch_up`` crops it to the
    longest prefix shared with the committed tokens. Ids the draft cannot embed (a target head
    padded wider than the draft's embeddings) are fed as ``stand_in``: the draft's guesses get
    worse for a moment, the output does not change.
    """

    def __init__(self, runner, draft_model: torch.nn.Module):
        self.runner = runner
        self.embeddable = draft_model.get_input_embeddings().num_embeddings
        self.stand_in = getattr(draft_model.config, "pad_token_id", None) or 0
        self.reset()

    def reset(self) -> None:
        self.cache = self.runner.new_cache()
        self.seen: list[int] = []
        self.committed = 0  # leading entries of seen known to be committed tokens

    def feed(self, token_ids: list[int]) -> list[int]:
        return [t if t < self.embeddable else self.stand_in for t in token_ids]

    def catch_up(self, tokens: list[int]) -> int:
        """Crop the cache to the longest prefix it shares with the committed ``tokens`` (always
        leaving the last one to feed); returns its length. Only positions after the tokens already
        committed at the last round can differ, so only those are compared."""
        keep = self.committed
        limit = min(len(self.seen), len(tokens) - 1)
        while keep < limit and self.seen[keep] == tokens[keep]:
            keep += 1
        self.runner.crop(self.cache, keep)
        del self.seen[keep:]
        self.committed = len(tokens)
        return keep


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

    def _forward(self, token_ids: list[int], ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``token_ids``; the draft's logits after the last one (on the sampling device, at the
        target's width) and, if the policy reads it, its hidden state there."""
        state = self.state
        out = self.runner.forward(state.cache, state.feed(token_ids), last_only=True, hidden=self.policy.needs_hidden)
        self._forwards += 1
        state.seen.extend(token_ids)
        logits = self._fit(out.logits[-1].to(ctx.device))
        return logits, out.hidden[-1] if out.hidden is not None else None

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[: self.vocab_size]
        pad = logits.new_full((self.vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    def propose(self, ctx: DraftContext) -> Draft | None:
        self._asked = True
        self.policy.begin_round(ctx.tokens)
        budget = self.policy.budget(ctx.max_depth)
        if budget < 1:
            return None
        keep = self.state.catch_up(ctx.tokens)
        logits, hidden = self._forward(ctx.tokens[keep:], ctx)

        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        scores: list[float] = []
        while True:
            if ctx.sampling.greedy:
                dist = None
                token = int(logits.argmax())
            else:
                dist = warp(logits, ctx.sampling)[0]
                token = sample(dist, ctx.generator)
            if self.policy.stop_before(DraftStep(len(tokens), token, logits, dist, hidden)):
                break
            if dist is not None:
                probs.append(dist)
            if ctx.wants_scores:
                # greedy: the draft's probability of its token; sampled: of its most likely token (a
                # sampled token's own value must not decide whether it is verified)
                scores.append(token_probability(logits, token) if dist is None else float(dist.max()))
            tokens.append(token)
            if len(tokens) >= budget or token in ctx.eos_token_ids:
                break
            if self.policy.should_stop(DraftStep(len(tokens) - 1, token, logits, dist, hidden)):
                break
            logits, hidden = self._forward([token], ctx)
        if not tokens:
            return None
        return Draft.chain(tokens, torch.stack(probs) if probs else None, scores or None)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        if self._asked:  # (a plain step the controller chose says nothing about the draft length)
            self.policy.update(len(outcome.accepted), outcome.drafted)
        self._asked = False
