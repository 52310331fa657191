"""The catch-up rule: whether a drafter that must first catch up (a draft model's prefill) pays for
it over what the request likely has left, and when to probe it again anyway."""

from __future__ import annotations

from dataclasses import dataclass

LENGTH_SMOOTHING = 0.3  # weight of the last finished request in the typical request length
# a drafter whose catch-up (a draft model's prefill) would not pay on the evidence is tried again
# once the tokens decoded without it since it last ran are worth this share of a probe's cost: the
# catch-up and about one plain step of rounds that may lose. Counting tokens, not requests: after a
# workload switch (chat, where drafting lost, then code) long requests probe within one or two of
# them, where a count of requests would leave several of them undrafted
CATCH_UP_PROBE_SHARE = 0.02


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
        up, and counting only finished requests would veto every probe of the back-off until the
        request ended."""
        if self._used_at is None:
            return self._learned.skipped + generated
        return max(generated - self._used_at, 0)

    def likely_left(self, generated: int, tokens_left: int) -> float:
        """The tokens a request ``generated`` tokens in likely has left, at most ``tokens_left``:
        what is left of the typical length, or, for a request already past half of it, about as
        many as it has run so far (a request of 55 tokens among translations of 27 is a long one;
        cut to half the typical length, it would never start drafting)."""
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
        # is let through (counting the step too would never let it through)
        probe = catch_up + (step_seconds if self._used_at is None else 0.0)
        return probe <= CATCH_UP_PROBE_SHARE * self.decoded_without(generated) * step_seconds


@dataclass
class _RequestLengths:
    """What finished requests taught a :class:`CatchUpRule`."""

    typical_length: float | None = None  # new tokens of finished requests (a moving average)
    skipped: int = 0  # tokens of finished requests decoded without the drafter since it last ran
