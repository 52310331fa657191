"""Sampling parameters and the one warping function shared by the target and every drafter.

Losslessness under sampling means: the output follows the target's distribution *after* the
same temperature / top-k / top-p warping that plain sampling would apply. The verifier warps
the target's logits and stochastic drafters warp theirs with this exact function, using
transformers' own logits warpers so the semantics match ``generate(do_sample=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from speculum.errors import InvalidInputError

# Temperatures below this count as 0 (greedy): dividing logits by, say, 1e-40 overflows them to
# inf and the softmax to NaN, and sampling that cold is greedy in effect.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding, and so does any temperature below ``GREEDY_TEMPERATURE``
    (1e-5; ``temperature`` then reads 0.0); top_k 0 and top_p 1.0 mean "no filter"."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise InvalidInputError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: set once, here
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidInputError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def warpers(self) -> LogitsProcessorList:
        chain = LogitsProcessorList()
        if self.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            chain.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            chain.append(TopPLogitsWarper(self.top_p))
        return chain


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[n, vocab]`` (float32) of the warped distribution for each row of ``logits``."""
    scores = logits.float().reshape(-1, logits.shape[-1])
    scores = params.warpers()(None, scores)
    return torch.softmax(scores, dim=-1)


SAMPLE_BLOCK = 512  # tokens per block of the two-level inverse-CDF search in ``sample``


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability vector (``probs >= 0``, not necessarily normalised).

    An inverse-CDF draw from one uniform, in two levels: the block of ``SAMPLE_BLOCK`` tokens from
    the running sum of block masses, then the token inside it. Sums are in float64, so a token's
    chance is its probability to ~1e-12. ``torch.multinomial`` draws one exponential per token
    instead, which over a 262k vocabulary (Gemma 3) costs a noticeable share of a CPU decode step;
    this search costs a small fraction of that. A zero-probability token is never drawn.
    """
    probs = probs.reshape(-1)
    vocab = probs.numel()
    padded = torch.nn.functional.pad(probs, (0, -vocab % SAMPLE_BLOCK)).view(-1, SAMPLE_BLOCK)
    block_cdf = torch.cumsum(padded.sum(dim=1, dtype=torch.float64), dim=0)
    u = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64) * block_cdf[-1]
    block = int(torch.searchsorted(block_cdf, u, right=True).clamp_max(block_cdf.numel() - 1))
    inside = u - block_cdf[block - 1] if block > 0 else u
    row = padded[block]
    token = int(torch.searchsorted(torch.cumsum(row, dim=0, dtype=torch.float64), inside, right=True))
    if token >= SAMPLE_BLOCK or row[token] <= 0:
        # float64 rounding put the draw past the block's last token with mass: that is the one
        token = int(torch.nonzero(row > 0)[-1])
    return block * SAMPLE_BLOCK + token


class PositionNoise:
    """Sampling whose token at each position depends only on the seed, the position and the target's
    distribution there: never on what was drafted, nor on which rounds drafted at all.

    Position ``i`` of the generated text (0: the first new token) is sampled by the Gumbel-max
    trick in two levels, as ``sample`` searches: the block of ``SAMPLE_BLOCK`` tokens is
    ``argmax mass(block) / E``, then the token inside it ``argmax p / E'`` (``E``, ``E'``: vectors
    of Exp(1) draws; a Gumbel-max draw is exactly a sample, so each level is, and the two together
    are one from ``p``). The noise of position ``i`` is what one seeded generator draws ``i``-th,
    whichever position is asked first, so the target's token at ``i`` is a function of the prefix
    and that noise alone: the text is the text plain sampling with this seed gives, whatever the
    method, tree or controller. A draft model samples its chain with the same noise, and a draft
    node is accepted when it holds the target's token: a sampled draft token then with probability
    up to 1 - TV(p, q), the rate of speculative sampling (at least (1 - TV)/(1 + TV) in one level:
    Daliri, Musco and Suresh 2024, "Coupling without communication and drafter-invariant
    speculative decoding"); a deterministic draft token x with p(x), as before. Two levels draw
    ~1k numbers a position where one would draw the vocabulary (262k for Gemma 3: milliseconds).
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.rows: dict[int, torch.Tensor] = {}
        self.drawn = 0  # positions drawn so far (rows below ``drawn`` not in ``rows`` were forgotten)

    def choose(self, probs: torch.Tensor, position: int) -> int:
        """The token at generated ``position`` for a distribution ``probs`` (>= 0, any scale)."""
        probs = probs.reshape(-1)
        vocab = probs.numel()
        blocks = -(-vocab // SAMPLE_BLOCK)
        if position < self.drawn and position not in self.rows:
            raise RuntimeError(f"position {position} was already committed and its noise forgotten")
        while self.drawn <= position:  # drawn where the generator lives, used where the logits are
            row = torch.empty(blocks + SAMPLE_BLOCK, device=self.generator.device, dtype=torch.float64)
            self.rows[self.drawn] = row.exponential_(generator=self.generator)
            self.drawn += 1
        noise = self.rows[position].to(probs.device)
        if noise.numel() != blocks + SAMPLE_BLOCK:
            raise RuntimeError(f"a distribution over {vocab} tokens, noise drawn for another vocabulary")
        padded = torch.nn.functional.pad(probs, (0, -vocab % SAMPLE_BLOCK)).view(-1, SAMPLE_BLOCK)
        block = int((padded.sum(dim=1, dtype=torch.float64) / noise[:blocks]).argmax())
        return block * SAMPLE_BLOCK + int((padded[block].double() / noise[blocks:]).argmax())

    def forget(self, before: int) -> None:
        """Drop the noise of positions before ``before`` (committed: never asked again)."""
        for position in [p for p in self.rows if p < before]:
            del self.rows[position]
