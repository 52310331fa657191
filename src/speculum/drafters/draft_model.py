"""Speculative decoding / sampling with a separate (smaller) draft model (Leviathan et al.; Chen et al.).

The draft model keeps its own KV cache. Each round it catches up on the tokens it has not seen,
then drafts up to K tokens autoregressively (greedy: argmax; sampling: from its warped
distribution q, which the verifier needs for the min(1, p/q) rule). The round's length comes
from a length policy (fixed K, transformers' heuristic, or a confidence stop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum import cache as cache_ops
from speculum.drafters.base import Draft, DraftContext, Drafter, Outcome
from speculum.errors import InvalidInputError
from speculum.policies import make_policy
from speculum.sampling import sample, warp


@dataclass
class Options:
    num_speculative_tokens: int = 5
    length_policy: str = "heuristic"  # fixed | heuristic | confidence
    confidence_threshold: float = 0.4  # only for length_policy="confidence"

    def __post_init__(self) -> None:
        make_policy(self.length_policy, self.num_speculative_tokens, self.confidence_threshold)


class DraftModelDrafter(Drafter):
    name = "draft_model"
    needs_draft_model = True

    def __init__(self, options: Options, *, draft_model: torch.nn.Module, vocab_size: int, **_):
        if draft_model is None:
            raise InvalidInputError("method 'draft_model' needs a draft model: load(..., draft=...)")
        self.options = options
        self.model = draft_model
        self.vocab_size = vocab_size  # the target's: draft distributions are cut to it
        self.device = next(draft_model.parameters()).device
        self.policy = make_policy(options.length_policy, options.num_speculative_tokens, options.confidence_threshold)
        self._forwards = 0

    @property
    def forwards(self) -> int:
        return self._forwards

    def start(self, ctx: DraftContext) -> None:
        self.cache = cache_ops.new_cache()
        self.seen: list[int] = []  # the tokens whose keys/values are in self.cache
        self.policy.reset()
        self._forwards = 0

    @torch.inference_mode()
    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self._forwards += 1
        self.seen.extend(token_ids)
        return out.logits[0, -1, : self.vocab_size].float().cpu()

    def propose(self, ctx: DraftContext) -> Draft | None:
        budget = self.policy.budget(ctx.max_depth)
        if budget < 1:
            return None
        # Roll back to the longest prefix the draft cache shares with the committed tokens,
        # keeping at least one token to feed so that we get logits after the last one.
        keep = 0
        limit = min(len(self.seen), len(ctx.tokens) - 1)
        while keep < limit and self.seen[keep] == ctx.tokens[keep]:
            keep += 1
        cache_ops.crop(self.cache, keep)
        del self.seen[keep:]
        logits = self._forward(ctx.tokens[keep:])

        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            if ctx.sampling.greedy:
                dist = None
                token = int(logits.argmax())
            else:
                dist = warp(logits, ctx.sampling)[0]
                probs.append(dist)
                token = sample(dist, ctx.generator)
            tokens.append(token)
            if len(tokens) >= budget or token in ctx.eos_token_ids:
                break
            if self.policy.uses_confidence:
                confidence = float((dist if dist is not None else torch.softmax(logits, dim=-1))[token])
                if self.policy.should_stop(confidence):
                    break
            logits = self._forward([token])
        return Draft.chain(tokens, torch.stack(probs) if probs else None)

    def observe(self, ctx: DraftContext, outcome: Outcome) -> None:
        self.policy.update(len(outcome.accepted), outcome.drafted)
