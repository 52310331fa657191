"""Exact mode: a target forward whose every row comes out the same whatever else is in it.

In half precision a verification forward over several tokens, a token tree or a batch row rounds
differently from plain decoding's one-token forward, so at a near-tie a text parts from plain
decoding's (``speculum diagnose divergence`` finds where: docs/exactness.md). Exact mode removes
both sources that tool finds:

- **attention** runs in float64 (SDPA, the same call as the model's own, on float64 copies of the
  query, keys and values; the output is rounded back to the model's dtype). A masked forward of
  several queries has each key/value head's query heads folded into its queries, as transformers
  does for one query, rather than the keys and values repeated per query head. The kernel's order of
  summation still depends on the query count, the mask and where the keys sit in the cache, but in
  float64 that changes the last of 53 bits, and rounding to bfloat16 (8 bits) or float16 (11) drops
  it: an output differs only where the exact value lies within ~1e-13 of a rounding boundary.
- **linear layers** (the LM head included) must give a row the same bits whatever the number of
  rows beside it. Whether this CPU's kernels do is measured on the model's own layers, once per
  distinct shape (:func:`min_invariant_rows`): the fewest rows ``m`` from which every call of ``m``
  to ``ROWS`` rows gives a row the same bits in any slot. A layer with ``m > 1`` has its smaller
  calls padded to ``m`` rows (zeros, their outputs dropped); calls over ``ROWS`` rows are cut into
  pieces of ``ROWS``, the probes' reach; where even calls of exactly ``ROWS`` rows part by slot,
  exact mode says so (``ExactChoice.guaranteed`` is False).

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


def exact_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, computed in float64 and rounded back to the query's dtype."""
    dtype = query.dtype
    mask = attention_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.to(torch.float64)
    query, key, value = query.to(torch.float64), key.to(torch.float64), value.to(torch.float64)
    if _foldable(module, query, mask, args, kwargs):
        return _folded_attention(query, key, value, mask, kwargs.get("scaling")).to(dtype), None
    out, weights = sdpa_attention_forward(module, query, key, value, mask, *args, **kwargs)
    return out.to(dtype), weights


def _foldable(module, query, mask, args, kwargs) -> bool:
    """A masked forward of several queries over grouped key/value heads, which transformers would
    give SDPA with every key/value head repeated for its query heads (a float64 copy of the cache
    per layer); the same mask for every head."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain_call = not args and not kwargs.get("dropout") and kwargs.get("softcap") is None
    return (
        plain_call
        and groups > 1
        and query.shape[2] > 1
        and mask is not None
        and mask.dim() == 4
        and mask.shape[1] == 1
        and kwargs.get("position_bias") is None
    )


def _folded_attention(query, key, value, mask, scaling) -> torch.Tensor:
    """SDPA with each key/value head's query heads folded into its queries (as transformers does
    for one query): (batch, heads, queries, dim) in, (batch, queries, heads, dim) out."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * queries, dim)
    mask = mask.expand(mask.shape[0], 1, queries, keys)[:, :, None]
    mask = mask.expand(mask.shape[0], 1, groups, queries, keys).reshape(mask.shape[0], 1, groups * queries, keys)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, queries, value.shape[-1]).transpose(1, 2).contiguous()


AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


@dataclass(frozen=True)
class ExactChoice:
    """Whether exact mode is on (``Speculum.exact``; ``speculum generate --stats``), and how.

    ``rows``: linear layers take at most this many rows a call (None: off). ``padded``: (layer kind,
    rows, how many layers) for the layers whose smaller calls are padded to that many rows.
    ``guaranteed``: every linear layer measured row-count invariant in the way chosen (False: this
    CPU's kernels round a row by its neighbours, so texts can still part at near-ties)."""

    enabled: bool
    reason: str
    rows: int | None = None
    padded: tuple[tuple[str, int, int], ...] = ()
    guaranteed: bool = True

    def describe(self) -> str:
        if not self.enabled:
            return f"exact: off ({self.reason})"
        linears = f"linear layers in calls of at most {self.rows} rows"
        if self.padded:
            linears += "; " + ", ".join(f"{count} {kind} padded to {rows} rows" for kind, rows, count in self.padded)
        warning = "" if self.guaranteed else "; NOT guaranteed: this CPU's linear kernels round rows by row count"
        return f"exact: on ({self.reason}): attention in float64, {linears}{warning}"


def _linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module that multiplies rows by a weight matrix, with its name: nn.Linear, speculum's
    PackedLinear, GPT-2's Conv1D (each has ``in_features`` or a 2-D ``weight`` whose first dimension
    is its input)."""
    found = []
    for name, module in model.named_modules():
        if getattr(module, "in_features", None) is not None:
            found.append((name, module))
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            found.append((name, module))
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
def min_invariant_rows(module: nn.Module, forward=None, seed: int = 0) -> int | None:
    """The fewest rows ``m`` such that a row's output is the same bits in every call of ``m`` to
    ``ROWS`` rows, in any slot (1: any call as it is); None where calls of exactly ``ROWS`` rows
    already part by slot. Measured on random inputs: kernels choose their path by shape, not values."""
    forward = forward or module.forward
    inputs = _in_features(module)
    generator = torch.Generator().manual_seed(seed)
    dtype, device = _weight_dtype(module), _device(module)
    row = torch.randn(1, inputs, generator=generator).to(device, dtype)

    def outputs(rows: int) -> list[torch.Tensor]:
        found = []
        for slot in sorted({0, rows // 2, rows - 1}):
            batch = torch.randn(rows, inputs, generator=generator).to(device, dtype)
            batch[slot] = row[0]
            found.append(forward(batch)[slot])
        return found

    reference = outputs(ROWS)
    if not all(torch.equal(out, reference[0]) for out in reference):
        return None
    fewest = ROWS
    for rows in range(ROWS - 1, 0, -1):
        if not all(torch.equal(out, reference[0]) for out in outputs(rows)):
            break
        fewest = rows
    return fewest


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


def _split_rows(forward, inputs: int, min_rows: int):
    """``forward`` over pieces of at most ``ROWS`` rows, each padded to at least ``min_rows``."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // inputs
        if rows == 0 or min_rows <= rows <= ROWS or _WHOLE_ROWS.get():
            return forward(x)
        pieces = list(x.reshape(rows, inputs).split(ROWS))
        short = min_rows - pieces[-1].shape[0]
        if short > 0:
            pieces[-1] = torch.cat([pieces[-1], pieces[-1].new_zeros(short, inputs)])
        out = torch.cat([forward(piece) for piece in pieces])[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


def make_exact(model: nn.Module, reason: str = "asked") -> ExactChoice:
    """Switch ``model`` to exact mode in place (float64 attention; linear layers measured and split
    or padded where their kernels need it). Calling it again changes nothing."""
    existing = getattr(model, "_speculum_exact", None)
    if existing is not None:
        return existing
    model.set_attn_implementation(EXACT_ATTENTION)
    verdicts: dict[tuple, int | None] = {}
    padded: dict[tuple[str, int], int] = {}
    for name, module in _linear_modules(model):
        weight = getattr(module, "weight", None)
        outputs = getattr(module, "out_features", None) or (weight.shape[-1] if weight is not None else None)
        key = (type(module), _in_features(module), outputs, _weight_dtype(module))
        if key not in verdicts:
            verdicts[key] = min_invariant_rows(module)
        # where even ROWS rows part by slot, padding to ROWS is the best left (and said not guaranteed)
        min_rows = verdicts[key] or ROWS
        if min_rows > 1:
            kind = name.rsplit(".", 1)[-1] or name
            padded[(kind, min_rows)] = padded.get((kind, min_rows), 0) + 1
        module.forward = _split_rows(module.forward, _in_features(module), min_rows)
    guaranteed = all(v is not None for v in verdicts.values())
    summary = tuple((kind, rows, count) for (kind, rows), count in sorted(padded.items()))
    choice = ExactChoice(True, reason, rows=ROWS, padded=summary, guaranteed=guaranteed)
    if not guaranteed:
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
