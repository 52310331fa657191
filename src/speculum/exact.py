"""Exact mode: a target forward whose every row comes out the same whatever else is in it.

In half precision a verification forward over several tokens, a token tree or a batch row rounds
differently from plain decoding's one-token forward, so at a near-tie a text parts from plain
decoding's (``speculum diagnose divergence`` finds where: docs/exactness.md). Exact mode removes
both sources that tool finds:

- **attention** runs in float64 (SDPA, the same call as the model's own, on float64 copies of the
  query, keys and values; the output is rounded back to the model's dtype). The kernel's order of
  summation still depends on the query count, the mask and where the keys sit in the cache, but in
  float64 that changes the last of 53 bits, and rounding to bfloat16 (8 bits) or float16 (11) drops
  it: an output differs only where the exact value lies within ~1e-13 of a rounding boundary.
- **linear layers** (the LM head included) must give a row the same bits whatever the number of
  rows beside it. Whether this CPU's kernels do is measured on the model's own layers, once per
  distinct shape (:func:`rows_invariance`): where they do up to ``ROWS`` rows, larger forwards are
  cut into pieces of ``ROWS`` rows; where even that fails, every forward is padded to exactly
  ``ROWS`` rows; where that fails too, exact mode says so (``ExactChoice.guaranteed`` is False).

Float32 models need none of it for greedy output in practice (the tests check float32 without it),
but ``exact=True`` applies it in any dtype.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from speculum.errors import InvalidInputError

logger = logging.getLogger(__name__)

EXACT_ATTENTION = "speculum_exact"  # the attention implementation's name in transformers' registry
ROWS = 16  # rows per linear-layer call where a kernel's rounding depends on the row count
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 13, 16)  # row counts whose outputs are compared with one row's


def exact_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, computed in float64 and rounded back to the query's dtype."""
    dtype = query.dtype
    mask = attention_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.to(torch.float64)
    out, weights = sdpa_attention_forward(
        module, query.to(torch.float64), key.to(torch.float64), value.to(torch.float64), mask, *args, **kwargs
    )
    return out.to(dtype), weights


AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


@dataclass(frozen=True)
class ExactChoice:
    """Whether exact mode is on (``Speculum.exact``; ``speculum generate --stats``), and how.

    ``rows``: linear layers run in pieces of this many rows ("split" above it, "padded" to exactly
    it) or as they are (None). ``guaranteed``: every linear layer measured row-count invariant in
    the way chosen (False: this CPU's kernels round a row differently by its neighbours, so texts
    can still part at near-ties)."""

    enabled: bool
    reason: str
    rows: int | None = None
    padded: bool = False
    guaranteed: bool = True

    def describe(self) -> str:
        if not self.enabled:
            return f"exact: off ({self.reason})"
        if self.rows is None:
            linears = "linear layers as they are (measured row-count invariant)"
        elif self.padded:
            linears = f"linear layers padded to {self.rows} rows"
        else:
            linears = f"linear layers in pieces of at most {self.rows} rows"
        warning = "" if self.guaranteed else "; NOT guaranteed: this CPU's linear kernels round rows by row count"
        return f"exact: on ({self.reason}): attention in float64, {linears}{warning}"


def _linear_modules(model: nn.Module) -> list[nn.Module]:
    """Every module that multiplies rows by a weight matrix: nn.Linear, speculum's PackedLinear,
    GPT-2's Conv1D (each has ``in_features`` or a 2-D ``weight`` whose first dimension is its input)."""
    found = []
    for module in model.modules():
        if getattr(module, "in_features", None) is not None:
            found.append(module)
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            found.append(module)
    return found


def _in_features(module: nn.Module) -> int:
    inputs = getattr(module, "in_features", None)
    return inputs if inputs is not None else module.weight.shape[0]


def _weight_dtype(module: nn.Module) -> torch.dtype:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    weight = getattr(module, "packed_weight", None)
    return weight.dtype if weight is not None else torch.float32


def _device(module: nn.Module) -> torch.device:
    """Where the probe's rows go: the weights' device (an offloaded layer's are on "meta": its accelerate
    hook moves rows from the CPU to where it computes)."""
    weight = next(module.parameters(), None)
    if weight is None:
        weight = getattr(module, "packed_weight", None)
    if weight is None or weight.device.type == "meta":
        return torch.device("cpu")
    return weight.device


@torch.inference_mode()
def rows_invariance(module: nn.Module, forward=None, seed: int = 0) -> tuple[bool, bool]:
    """(a row's output is the same bits alone and beside up to ``ROWS - 1`` others, in any slot;
    the same holds for calls of exactly ``ROWS`` rows), measured on random inputs: kernels choose
    their path by shape, not by values."""
    forward = forward or module.forward
    inputs = _in_features(module)
    generator = torch.Generator().manual_seed(seed)
    dtype, device = _weight_dtype(module), _device(module)

    def rand(rows: int) -> torch.Tensor:
        return torch.randn(rows, inputs, generator=generator).to(device, dtype)

    row = rand(1)
    alone = forward(row)[0]
    free = True
    for rows in PROBE_ROWS[1:]:
        for slot in sorted({0, rows // 2, rows - 1}):
            batch = rand(rows)
            batch[slot] = row[0]
            free = free and torch.equal(forward(batch)[slot], alone)
    if free:
        return True, True
    reference = None
    for slot in range(ROWS):
        batch = rand(ROWS)
        batch[slot] = row[0]
        out = forward(batch)[slot]
        reference = out if reference is None else reference
        if not torch.equal(out, reference):
            return False, False
    return False, True


_WHOLE_ROWS = contextvars.ContextVar("speculum_exact_whole_rows", default=False)


@contextmanager
def whole_rows() -> Iterator[None]:
    """Linear layers take their rows whole inside: a prefill, which every method, layout and batch
    computes the same way (the prompt alone, in the same chunks), so its rows need no splitting; a
    prefill cut into pieces of 16 rows would read every weight once per piece."""
    token = _WHOLE_ROWS.set(True)
    try:
        yield
    finally:
        _WHOLE_ROWS.reset(token)


def _split_rows(forward, inputs: int, pad: bool):
    """``forward`` over pieces of at most ``ROWS`` rows (each padded to exactly ``ROWS`` if ``pad``)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // inputs
        if rows == 0 or (rows <= ROWS and not pad) or _WHOLE_ROWS.get():
            return forward(x)
        flat = x.reshape(rows, inputs)
        if pad and rows % ROWS:
            flat = torch.cat([flat, flat.new_zeros(ROWS - rows % ROWS, inputs)])
        out = torch.cat([forward(piece) for piece in flat.split(ROWS)])[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


def make_exact(model: nn.Module, reason: str = "asked") -> ExactChoice:
    """Switch ``model`` to exact mode in place (float64 attention; linear layers measured and split
    or padded where their kernels need it). Calling it again changes nothing."""
    existing = getattr(model, "_speculum_exact", None)
    if existing is not None:
        return existing
    model.set_attn_implementation(EXACT_ATTENTION)
    modules = _linear_modules(model)
    verdicts: dict[tuple, tuple[bool, bool]] = {}
    for module in modules:
        weight = getattr(module, "weight", None)
        outputs = getattr(module, "out_features", None) or (weight.shape[-1] if weight is not None else None)
        key = (type(module), _in_features(module), outputs, _weight_dtype(module))
        if key not in verdicts:
            verdicts[key] = rows_invariance(module)
    free = all(v[0] for v in verdicts.values())
    padded_ok = all(v[1] for v in verdicts.values())
    # a forward over more than ROWS rows is always split: the probes stop at ROWS rows
    for module in modules:
        module.forward = _split_rows(module.forward, _in_features(module), pad=not free)
    choice = ExactChoice(True, reason, rows=ROWS, padded=not free, guaranteed=free or padded_ok)
    if not choice.guaranteed:
        logger.warning("speculum: %s", choice.describe())
    model._speculum_exact = choice
    return choice


def wants_exact(exact: bool | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Resolve ``exact`` (True, False or "auto": on in half precision, where plain decoding's and a
    verification's roundings part) to (on, why)."""
    if exact not in (True, False, "auto"):
        raise InvalidInputError(f"exact must be True, False or 'auto', got {exact!r}")
    if exact == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        return half, f"auto: {'half precision' if half else str(dtype).removeprefix('torch.') + ' needs none'}"
    return bool(exact), "asked" if exact else "not asked"
