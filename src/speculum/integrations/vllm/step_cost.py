"""What one vLLM step costs, learnt online from the time between ``propose`` calls.

A proposer does not see vLLM's forward; it sees that ``propose`` is called once per step, so the
time from one call to the next is the step that verified what the previous call proposed (the
target's forward over every row and its draft tokens, sampling, and the proposer's own time). The
model is linear in the tokens the step verified, t = a + b * tokens, fitted by least squares with
old steps slowly forgotten, from a prior until measured: the cheaper a token beside the rows'
own one, the longer the drafts that pay. A step that also prefilled a prompt, or followed an idle
gap, says nothing of a decoding step and is left out; a prompt prefilled in a step shows first in
the call that ends it, so that step is known for one only when it ends.
"""

from __future__ import annotations

import math
import time

PRIOR_TOKEN_SHARE = 0.05  # b / a before any measurement: a draft token beside a one-token row, on a CPU
PRIOR_WEIGHT = 4.0  # the prior counts as this many steps
FORGET = 0.98  # each step's weight is multiplied by this per later step (~50 steps of memory)
IDLE_FACTOR = 5.0  # a gap this many times the predicted step is idle time, not a step


class StepCost:
    """t(tokens) = a + b * tokens, seconds of one vLLM step over ``tokens`` verified tokens (each
    row's own one included)."""

    def __init__(self, prior_token_share: float = PRIOR_TOKEN_SHARE) -> None:
        if not (math.isfinite(prior_token_share) and prior_token_share >= 0):
            raise ValueError(f"prior_token_share must be a number >= 0, got {prior_token_share!r}")
        self.prior_token_share = prior_token_share
        # weighted sums of 1, x, x^2, y, x*y over measured steps (x: tokens, y: seconds)
        self._s = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.steps = 0
        self._last_call: float | None = None
        self._pending: int | None = None  # tokens the step now running verifies (None: not a sample)

    @property
    def measured(self) -> bool:
        return self.steps > 0

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds; before any step, a = 1 and b = the prior share (only b / a matters)."""
        s0, sx, sxx, sy, sxy = self._s
        if s0 <= 0:
            return 1.0, self.prior_token_share
        mean_x, mean_y = sx / s0, sy / s0
        # the prior: PRIOR_WEIGHT pseudo-steps whose slope is prior_token_share of the fitted intercept,
        # spread over one token either side of the measured mean (it decides b only where x barely varies)
        var_x = sxx / s0 - mean_x * mean_x
        cov = sxy / s0 - mean_x * mean_y
        w = PRIOR_WEIGHT / s0
        # intercept-share prior: b0 = share * (mean_y - b0 * mean_x)  =>  b0 = share * mean_y / (1 + share * mean_x)
        share = self.prior_token_share
        b0 = share * mean_y / (1.0 + share * mean_x)
        b = (cov + w * b0) / (var_x + w)
        b = max(b, 0.0)
        a = max(mean_y - b * mean_x, 1e-9)
        return a, b

    def __call__(self, tokens: int) -> float:
        a, b = self.fit()
        return a + b * tokens

    def token_share(self, tokens: int) -> float:
        """What one more verified token adds to a step over ``tokens``, as a share of that step."""
        a, b = self.fit()
        return b / (a + b * tokens)

    def step_started(self, tokens: int | None, now: float | None = None) -> None:
        """``propose`` returns: the next step verifies ``tokens`` (None: it goes on prefilling a
        prompt, or its time is not a decoding step's). The time until the next call is that step's."""
        now = time.perf_counter() if now is None else now
        self._last_call = now
        self._pending = tokens

    def step_ended(self, now: float | None = None, prefilled: bool = False) -> None:
        """``propose`` is called: the step started at the last call has ended. ``prefilled``: it
        prefilled a prompt too (the call sees it first), so it is not recorded."""
        now = time.perf_counter() if now is None else now
        if self._last_call is None or self._pending is None or prefilled:
            return
        seconds = now - self._last_call
        x = float(self._pending)
        if self.measured and seconds > IDLE_FACTOR * self(self._pending):
            return
        s = self._s
        for i in range(5):
            s[i] *= FORGET
        s[0] += 1.0
        s[1] += x
        s[2] += x * x
        s[3] += seconds
        s[4] += x * seconds
        self.steps += 1
