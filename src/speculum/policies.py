"""Length policies: how far an autoregressive drafter goes this round.

Any policy works with any autoregressive drafter (draft model, self-draft, ...). A policy
answers two questions: how many tokens at most this round (``budget``, called once at the start
of each round) and, after each drafted token, whether to stop early (``should_stop``, which sees
a :class:`DraftStep`: the token, the draft's logits and distribution, and, for policies that set
``needs_hidden``, the draft's last hidden state), then learns from the verifier (``update``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculum.errors import InvalidInputError
from speculum.heads.acceptance import AcceptanceHead, bundled_heads
from speculum.tree import MAX_DRAFT_NODES

POLICIES = ("fixed", "heuristic", "confidence", "specdecpp", "oracle")


@dataclass
class DraftStep:
    """One drafted token, as a length policy sees it."""

    position: int  # 0 for the first token of this round's draft
    token: int
    logits: torch.Tensor  # [vocab]: the draft's logits that produced ``token``
    probs: torch.Tensor | None = None  # the warped distribution ``token`` was sampled from (None when greedy)
    hidden: torch.Tensor | None = None  # [hidden]: the draft's last hidden state at the position that gave
    # ``logits`` (its input was the previous token); only for policies with needs_hidden

    @property
    def confidence(self) -> float:
        """The draft's probability of its own token."""
        dist = self.probs if self.probs is not None else torch.softmax(self.logits.float(), dim=-1)
        return float(dist[self.token])


class LengthPolicy:
    needs_hidden = False  # whether should_stop() reads DraftStep.hidden (the drafter then computes it)

    def __init__(self, num_speculative_tokens: int):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise InvalidInputError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.initial = num_speculative_tokens
        self.length = num_speculative_tokens

    def reset(self, sampling=None) -> None:
        """A new request, decoded with ``sampling`` (SamplingParams; None: unknown)."""
        self.length = self.initial

    def check(self, sampling) -> None:
        """Refuse (InvalidInputError) a request this policy cannot serve exactly, before it starts."""

    def begin_round(self, tokens: list[int]) -> None:
        """A new round drafts after ``tokens`` (every committed token)."""

    def budget(self, max_depth: int) -> int:
        return min(self.length, max_depth)

    def stop_before(self, step: DraftStep) -> bool:
        """Whether to end the draft without ``step.token`` (checked before it is kept)."""
        return False

    def should_stop(self, step: DraftStep) -> bool:
        """Whether to end the draft after ``step.token`` (which is kept)."""
        return False

    def update(self, accepted: int, drafted: int) -> None:
        pass


class FixedLength(LengthPolicy):
    """Always K tokens."""


class HeuristicLength(LengthPolicy):
    """transformers' schedule: +2 after a fully accepted draft, -1 (not below 1) otherwise."""

    def update(self, accepted: int, drafted: int) -> None:
        if drafted and accepted == drafted:
            self.length += 2
        else:
            self.length = max(1, self.length - 1)


class ConfidenceStop(LengthPolicy):
    """Up to K tokens; stop as soon as the draft's probability of its own token falls below a threshold.

    (transformers' ``assistant_confidence_threshold``.) The threshold is not adapted.
    """

    def __init__(self, num_speculative_tokens: int, threshold: float = 0.4):
        super().__init__(num_speculative_tokens)
        if not 0.0 <= threshold < 1.0:
            raise InvalidInputError(f"confidence_threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold

    def should_stop(self, step: DraftStep) -> bool:
        return step.confidence < self.threshold


class SpecDecPPStop(LengthPolicy):
    """SpecDec++: stop when a trained head says the draft has probably been rejected somewhere.

    The head reads the draft's hidden state at the position whose input is candidate i and predicts
    P(candidate i accepted | the earlier ones were). After each drafted token the running product
    of those predictions is the chance that the whole draft so far passes; the draft ends as soon
    as 1 - product > ``threshold`` (the paper's h), never before ``min_tokens`` and never beyond
    ``num_speculative_tokens``. As in the paper, the token drafted when the rule fires is kept
    unscored (its own prediction would need one more draft forward). An ``early`` head (ours)
    instead scores each candidate from the state that produced it and the draft's confidence in
    it, so the rule can fire on the doubtful token itself: no unscored token, one draft forward less.
    """

    needs_hidden = True

    def __init__(self, num_speculative_tokens: int, head=None, threshold: float = 0.7, min_tokens: int = 2):
        super().__init__(num_speculative_tokens)
        if not 0.0 < threshold < 1.0:
            raise InvalidInputError(f"stop_threshold must be in (0, 1), got {threshold!r}")
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 1:
            raise InvalidInputError(f"min_draft_tokens must be an integer >= 1, got {min_tokens!r}")
        # one head, or several trained for different temperatures: each request uses the one
        # trained nearest to its own (labels depend on the warping: greedy vs T=1 acceptance)
        self.heads = list(head) if isinstance(head, (list, tuple)) else [head]
        self.threshold = threshold
        self.min_tokens = min_tokens
        self.passes = 1.0  # predicted P(every candidate so far accepted)
        self.previous_confidence: float | None = None  # the draft's probability of the previous candidate
        self.head_calls = 0  # head evaluations in this request (what the head costs)
        self._use(self.heads[0])

    def _use(self, head) -> None:
        self.head = head
        self.reads_confidence = bool(getattr(head, "confidence_input", False))

    def reset(self, sampling=None) -> None:
        super().reset(sampling)
        self.head_calls = 0
        if len(self.heads) > 1:
            temperature = 0.0 if sampling is None or sampling.greedy else sampling.temperature
            self._use(min(self.heads, key=lambda h: abs(head_temperature(h) - temperature)))

    def begin_round(self, tokens: list[int]) -> None:
        self.passes = 1.0

    def should_stop(self, step: DraftStep) -> bool:
        if getattr(self.head, "early", False):
            # an early head scores this very candidate from the state that produced it
            self.head_calls += 1
            self.passes *= float(self.head.accept_probability(step.hidden, step.confidence))
            return step.position + 1 >= self.min_tokens and 1.0 - self.passes > self.threshold
        # step.hidden is where the previous candidate was the input: it scores that candidate
        previous, self.previous_confidence = (
            self.previous_confidence,
            (step.confidence if self.reads_confidence else None),
        )
        if step.position == 0 or step.hidden is None:
            return False  # the first forward's input is the last committed token, not a candidate
        self.head_calls += 1
        self.passes *= float(self.head.accept_probability(step.hidden, previous))
        return step.position + 1 >= self.min_tokens and 1.0 - self.passes > self.threshold


def head_temperature(head) -> float:
    """The decoding temperature an acceptance head's labels were made for (0: greedy)."""
    info = getattr(head, "training_info", None) or {}
    return float((info.get("data") or {}).get("temperature", 0.0))


class OracleStop(LengthPolicy):
    """For analysis only: stop exactly before the first token the target would reject (SpecDec++'s
    Lemma 2.1), read from a recorded greedy output set with :meth:`set_reference`. The best any
    stopping rule can do with this draft; without a reference it drafts ``num_speculative_tokens``."""

    def __init__(self, num_speculative_tokens: int):
        super().__init__(num_speculative_tokens)
        self.reference: list[int] = []
        self.round_start = 0

    def check(self, sampling) -> None:
        # Under sampling, dropping a drafted token because of its value would change the distribution
        # the draft's tokens are drawn from (q), which the verifier assumes: the output would be biased.
        if sampling is not None and not sampling.greedy:
            raise InvalidInputError("length_policy='oracle' is for greedy analysis only; it cannot sample exactly")

    def set_reference(self, sequence: list[int]) -> None:
        """The prompt followed by the target's greedy output."""
        self.reference = list(sequence)

    def begin_round(self, tokens: list[int]) -> None:
        same = len(tokens) <= len(self.reference) and self.reference[: len(tokens)] == list(tokens)
        self.round_start = len(tokens) if same else -1

    def stop_before(self, step: DraftStep) -> bool:
        if self.round_start < 0:
            return False
        at = self.round_start + step.position
        return at >= len(self.reference) or self.reference[at] != step.token


def make_policy(
    name: str,
    num_speculative_tokens: int,
    confidence_threshold: float = 0.4,
    *,
    head=None,
    stop_threshold: float = 0.7,
    min_draft_tokens: int = 2,
) -> LengthPolicy:
    """The policy ``name``; ``head`` (an AcceptanceHead) is what ``specdecpp`` reads."""
    if name == "specdecpp":
        return SpecDecPPStop(num_speculative_tokens, head, stop_threshold, min_draft_tokens)
    if name == "oracle":
        return OracleStop(num_speculative_tokens)
    if name == "fixed":
        return FixedLength(num_speculative_tokens)
    if name == "heuristic":
        return HeuristicLength(num_speculative_tokens)
    if name == "confidence":
        return ConfidenceStop(num_speculative_tokens, confidence_threshold)
    raise InvalidInputError(f"unknown length policy {name!r}; choose one of {', '.join(POLICIES)}")


def check_policy_options(options) -> None:
    """Validate a drafter's length-policy options (``length_policy``, ``num_speculative_tokens``,
    ``confidence_threshold``, ``stop_threshold``, ``min_draft_tokens``, ``acceptance_head``)."""
    k = options.num_speculative_tokens
    if isinstance(k, int) and not isinstance(k, bool) and k > MAX_DRAFT_NODES:
        raise InvalidInputError(f"num_speculative_tokens may be at most {MAX_DRAFT_NODES}, got {k}")
    make_policy(
        options.length_policy,
        options.num_speculative_tokens,
        options.confidence_threshold,
        stop_threshold=options.stop_threshold,
        min_draft_tokens=options.min_draft_tokens,
    )


# Draft tokens per round at most, when the options do not say: the paper's bound for the policies
# that stop on their own, a short fixed draft otherwise.
ADAPTIVE_BOUND = 20


def default_draft_length(length_policy: str, fixed_default: int) -> int:
    return ADAPTIVE_BOUND if length_policy in ("specdecpp", "oracle") else fixed_default


def policy_for(options, draft_model) -> LengthPolicy:
    """The length policy a drafter's options ask for; ``specdecpp`` loads its head for ``draft_model``."""
    head = None
    if options.length_policy == "specdecpp":
        paths = [options.acceptance_head] if options.acceptance_head else bundled_heads(draft_model)
        if not paths:
            raise InvalidInputError(
                "length_policy='specdecpp' needs acceptance_head=PATH: no head ships for this draft model "
                "(speculum ships one for qwen2.5-coder-0.5b). Train one with `speculum train acceptance-head "
                "--model TARGET --draft DRAFT --out DIR` and give acceptance_head=DIR"
            )
        device = next(draft_model.parameters()).device
        head = [AcceptanceHead.load(path, draft_model=draft_model).to(device) for path in paths]
    return make_policy(
        options.length_policy,
        options.num_speculative_tokens,
        options.confidence_threshold,
        head=head,
        stop_threshold=options.stop_threshold,
        min_draft_tokens=options.min_draft_tokens,
    )
