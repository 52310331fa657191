"""A draft model inside vLLM's step, for :class:`speculum.integrations.vllm.Auto`.

speculum's ``draft_model`` drafter runs per request (its KV cache kept with the request's state,
found again by content, and cropped to what was committed), the draft forwards of every row that
drafts run together (``DraftModelDrafter.propose_rows``), and each row's chain stops where one more
draft forward no longer pays (its confidence, then the controller's ``ChainStop`` against vLLM's
learnt step cost). Whether the draft runs at all in a step is :class:`DraftGate`'s call: the
steps that ran it are compared with those that did not, by tokens committed per second, so a
draft model that does not pay inside vLLM's step is kept off (and tried again after a back-off).

Loading the draft imports model code (transformers), so it happens in ``load_model``, which vLLM
calls after loading the target; importing this module stays light.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from speculum.controller import Backoff, Goodput
from speculum.errors import InvalidInputError

REFRESH_EVERY = 32  # while the draft pays, one step in this many runs without it, to keep that side measured
MAX_BACKOFF = 64  # steps without the draft after it lost, at most (doubling from 1), before it is tried again
LOSS_MEMORY = 8  # losses the back-off weighs
# steps a measurement of the draft may take: steps that are not timed (a prompt being prefilled
# beside them) give no evidence, and a draft must not run on unjudged for as long as they last
MAX_PROBE_STEPS = 12


@dataclasses.dataclass
class DraftOptions:
    """The draft model's options in ``additional_config["speculum"]``."""

    draft: str | None = None  # a packaged alias, a local Hugging Face directory or a hub id (None: no draft)
    draft_depth: int | None = None  # most tokens a chain (None: num_speculative_tokens)
    draft_confidence: float = 0.8  # the draft drafts on while its next token's probability is at least this
    # positions of draft KV cache held across steps, all requests together: vLLM budgets its GPU memory
    # for the target alone, so the draft's caches must stay small beside it
    max_draft_positions: int = 32768

    @classmethod
    def take(cls, options: dict, method: str) -> DraftOptions:
        """The draft's options, removed from ``options`` (what is left is the n-gram drafters')."""
        mine = {f.name: options.pop(f.name) for f in dataclasses.fields(cls) if f.name in options}
        out = cls(**mine)
        if out.draft is not None and (not isinstance(out.draft, str) or not out.draft):
            raise InvalidInputError(f"{method}: draft must be a model name or path, got {out.draft!r}")
        if out.draft_depth is not None and (
            not isinstance(out.draft_depth, int) or isinstance(out.draft_depth, bool) or out.draft_depth < 1
        ):
            raise InvalidInputError(f"{method}: draft_depth must be an integer >= 1, got {out.draft_depth!r}")
        p = out.max_draft_positions
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise InvalidInputError(f"{method}: max_draft_positions must be an integer >= 1, got {p!r}")
        c = out.draft_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:
            raise InvalidInputError(f"{method}: draft_confidence must be a number in [0, 1), got {c!r}")
        if out.draft is None and mine:
            raise InvalidInputError(f"{method}: {', '.join(sorted(mine))} given without a draft")
        return out


class DraftModel:
    """The loaded draft model, and a ``draft_model`` drafter for each request."""

    def __init__(self, options: DraftOptions, k: int, vocab_size: int | None, dtype: Any, device: str) -> None:
        self.options = options
        self.depth = min(k, options.draft_depth or k)
        self.vocab_size = vocab_size
        self.dtype = dtype if dtype is not None else "auto"
        self.device = device
        self.model = None
        self.resources = None

    def load(self) -> None:
        """Load the draft (once) in the target's dtype, on the target's kind of device."""
        if self.model is not None:
            return
        from speculum.drafters.base import DraftContext, Resources
        from speculum.models.loading import load_model
        from speculum.sampling import SamplingParams

        self.model, _ = load_model(self.options.draft, dtype=self.dtype, device=self.device)
        self.resources = Resources(draft_model=self.model, vocab_size=self.vocab_size)
        # the first forwards pay one-time costs (kernel choice, allocation) the gate must not judge the draft by
        drafter = self.new_drafter()
        for tokens in ([1] * 16, [1] * 17):
            drafter.propose(DraftContext(tokens, len(tokens), SamplingParams(), None, max_depth=2))

    def new_drafter(self) -> Any:
        from speculum.drafters import draft_model

        self.load()
        options = draft_model.Options(
            num_speculative_tokens=self.depth,
            length_policy="confidence",
            confidence_threshold=self.options.draft_confidence,
        )
        return draft_model.DraftModelDrafter(options, self.resources)

    def fitting(self, drafters: list, ctxs: list) -> list[int]:
        """The rows (indices) that draft this step: those whose draft caches, grown by this step,
        fit in ``max_draft_positions`` together. Rows already holding a cache come first (a cache
        dropped is fed again), shorter ones first; the others' caches are released, and they draft
        again once they fit."""
        need = [len(ctx.tokens) + ctx.max_depth for ctx in ctxs]  # the most a row's cache holds after the step
        order = sorted(range(len(drafters)), key=lambda i: (not self.held(drafters[i]), need[i]))
        fits, total = [], 0
        for i in order:
            if total + need[i] <= self.options.max_draft_positions:
                fits.append(i)
                total += need[i]
            else:
                self.release(drafters[i])
        return sorted(fits)

    @staticmethod
    def held(drafter: Any) -> int:
        """Positions of draft cache ``drafter`` holds."""
        return len(drafter.state.seen)

    @staticmethod
    def release(drafter: Any) -> None:
        """Free ``drafter``'s draft cache; its request's next draft feeds its context again."""
        if drafter.state.seen:
            drafter.state.reset()

    @staticmethod
    def propose_rows(drafters: list, ctxs: list) -> list:
        """Every row's draft, the draft forwards of all rows together."""
        if len(drafters) == 1:
            return [drafters[0].propose(ctxs[0])]
        return type(drafters[0]).propose_rows(drafters, ctxs)


class DraftGate:
    """Whether the draft model runs this step: steps with it and steps without, each judged by the
    tokens a row committed per (plain) step's time, taken over vLLM's step and the drafting that
    preceded it. Normalised by a plain step's predicted time at the step's row count, so steps of
    different batch sizes compare. The draft starts in alternation with steps without it until
    both sides are measured; it is kept while it pays (one step in ``REFRESH_EVERY`` without, to
    keep that side current) and, once it loses, is off for a back-off of 1, 2, 4, ... steps, then
    tried again from a fresh measurement."""

    def __init__(self) -> None:
        self.with_draft = Goodput()
        self.without = Goodput()
        self.backoff = Backoff(MAX_BACKOFF, exploration=0.05)
        self.off_for = 0  # steps left without the draft
        self.steps = 0
        self.drafted_steps = 0
        self._fresh = False  # the next step with the draft starts its measurement afresh (a probe)
        self._unjudged = 0  # steps since the draft's side was last judged, while it is not

    def wants(self) -> bool:
        """Whether the draft runs in the step now being proposed."""
        self.steps += 1
        if self.off_for > 0:
            self.off_for -= 1
            self._fresh = self.off_for == 0
            return False
        if not (self.with_draft.judged and self.without.judged):
            wants = self.steps % 2 == 1 if self.without.judged == self.with_draft.judged else not self.with_draft.judged
        else:
            wants = self.steps % REFRESH_EVERY != 0
        if not self.with_draft.judged:
            self._unjudged += 1
            if self._unjudged > MAX_PROBE_STEPS:  # no evidence comes: backed off as if it lost, then measured again
                self._unjudged = 0
                self.off_for = self.backoff.lost() - 1
                self._fresh = True
                return False
        self.drafted_steps += wants
        return wants

    def record(self, drafted: bool, tokens_per_row: float, plain_steps: float) -> None:
        """A finished step: ``tokens_per_row`` committed a row, in ``plain_steps`` of a plain step's time."""
        if not drafted:
            self.without.add(tokens_per_row, plain_steps)
            return
        fresh, self._fresh = self._fresh, False
        self.with_draft.add(tokens_per_row, plain_steps, fresh=fresh)
        if not (self.with_draft.judged and self.without.judged):
            return
        self._unjudged = 0
        with_rate, without_rate = self.with_draft.rate, self.without.rate
        if with_rate >= without_rate:
            self.backoff.won()
            return
        self.backoff.note(1.0 - with_rate / without_rate, fresh, LOSS_MEMORY)
        self.off_for = self.backoff.lost()

    def summary(self) -> str:
        w, wo = self.with_draft.rate, self.without.rate
        rates = f"{w:.2f} vs {wo:.2f} tokens a plain step" if w is not None and wo is not None else "not yet measured"
        return f"draft ran in {self.drafted_steps} of {self.steps} steps ({rates})"
