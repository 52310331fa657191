"""Exact mode: a target forward whose every row comes out the same whatever else is in it.

In half precision a verification forward over several tokens, a token tree or a batch row rounds
differently from plain decoding's one-token forward, so at a near-tie a text parts from plain
decoding's (``speculum diagnose divergence`` finds where: docs/exactness.md). Exact mode removes
both sources that tool finds:

- **attention** gives each query the same bits whatever else the forward carries: float64 where it
  sees few keys, else one call of the model's own kernel per query over exactly its keys
  (:mod:`speculum.exact_attention`).
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

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from speculum import exact_attention
from speculum.errors import InvalidInputError
from speculum.exact_attention import exact_attention_forward, in_prefill, whole_rows
from speculum.kernels import attention as attention_kernel

__all__ = ["ExactChoice", "make_exact", "make_linears_exact", "min_invariant_rows", "wants_exact", "whole_rows"]

logger = logging.getLogger(__name__)

EXACT_ATTENTION = "speculum_exact"  # the attention implementation's name in transformers' registry
ROWS = 16  # rows per linear-layer call where a kernel's rounding depends on the row count
PREFILL_PIECE = 256  # an exact model prefills positions [0, 256), [256, 512), ... one forward each


AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


@dataclass(frozen=True)
class ExactChoice:
    """Whether exact mode is on (``Speculum.exact``; ``speculum generate --stats``), and how.

    ``rows``: linear layers take at most this many rows a call (None: off). ``padded``: (layer kind,
    rows, how many layers) for the layers whose smaller calls are padded to that many rows.
    ``guaranteed``: every linear layer measured row-count invariant in the way chosen (False: this
    CPU's kernels round a row by its neighbours, so texts can still part at near-ties).
    ``row_kernel``: every linear layer runs on speculum's row kernel, whole calls (no pieces needed).
    ``short_attention``: "kernel" (speculum's attention kernel) or "float64" (see exact_attention)."""

    enabled: bool
    reason: str
    rows: int | None = None
    padded: tuple[tuple[str, int, int], ...] = ()
    guaranteed: bool = True
    row_kernel: bool = False
    short_attention: str = "float64"  # how queries that see at most SHORT_KEYS keys are computed

    def describe(self) -> str:
        if not self.enabled:
            return f"exact: off ({self.reason})"
        if self.row_kernel:
            linears = "linear layers on speculum's row kernel (the same bits at any row count)"
        else:
            linears = f"linear layers in calls of at most {self.rows} rows"
        if self.padded:
            linears += "; " + ", ".join(f"{count} {kind} padded to {rows} rows" for kind, rows, count in self.padded)
        warning = "" if self.guaranteed else "; NOT guaranteed: this CPU's linear kernels round rows by row count"
        short = "speculum's kernel" if self.short_attention == "kernel" else "float64"
        attention = f"attention per query ({short} up to {exact_attention.SHORT_KEYS} keys, else one call each)"
        return f"exact: on ({self.reason}): {attention}, {linears}{warning}"


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
    already part by slot. Measured on random inputs: kernels choose their path by shape, not values.

    Every slot of every call is checked: a kernel can round an inner slot apart while the first and
    the last agree. Each row's reference is its output in a call of ``ROWS`` rows; each call probed
    takes a run of the same rows, so that every row lands in another slot or beside other rows."""
    forward = forward or module.forward
    inputs = _in_features(module)
    generator = torch.Generator().manual_seed(seed)
    dtype, device = _weight_dtype(module), _device(module)
    rows = torch.randn(2 * ROWS, inputs, generator=generator).to(device, dtype)
    reference = torch.cat([forward(rows[:ROWS]), forward(rows[ROWS:])])

    def agrees(start: int, count: int) -> bool:
        return torch.equal(forward(rows[start : start + count]), reference[start : start + count])

    # a call of ROWS rows straddling the two references: each row ROWS // 2 slots from its own
    if not agrees(ROWS // 2, ROWS):
        return None
    fewest = ROWS
    for count in range(ROWS - 1, 0, -1):
        # in the slots it has in the reference, and straddling the two references (shifted slots)
        if not (agrees(0, count) and agrees(ROWS - count // 2, count)):
            break
        fewest = count
    return fewest


def _verdict_key(linear: nn.Module) -> tuple:
    """What decides which kernel a linear layer's calls take, so layers alike share one probe: its
    type and shape, its dtype, whether it adds a bias (``addmm`` rather than ``mm``) and, for a
    ``PackedLinear``, how it runs small forwards (padded to ``min_rows``; on a dense copy up to
    ``dense_rows``)."""
    weight = getattr(linear, "weight", None)
    outputs = getattr(linear, "out_features", None) or (weight.shape[-1] if weight is not None else None)
    bias = getattr(linear, "bias", None) is not None
    dense_rows = getattr(linear, "dense_rows", 0) if getattr(linear, "dense_weight", None) is not None else 0
    small_forwards = (getattr(linear, "min_rows", 1), dense_rows, getattr(linear, "kernel", ""))
    return type(linear), _in_features(linear), outputs, _weight_dtype(linear), bias, small_forwards


def _split_rows(forward, inputs: int, min_rows: int):
    """``forward`` over pieces of at most ``ROWS`` rows, each padded to at least ``min_rows``."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // inputs
        if rows == 0 or min_rows <= rows <= ROWS or in_prefill():
            return forward(x)
        pieces = list(x.reshape(rows, inputs).split(ROWS))
        short = min_rows - pieces[-1].shape[0]
        if short > 0:
            pieces[-1] = torch.cat([pieces[-1], pieces[-1].new_zeros(short, inputs)])
        out = torch.cat([forward(piece) for piece in pieces])[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


def make_exact(model: nn.Module, reason: str = "asked") -> ExactChoice:
    """Switch ``model`` to exact mode in place (attention per query; linear layers measured and split
    or padded where their kernels need it). Calling it again changes nothing."""
    existing = getattr(model, "_speculum_exact", None)
    if existing is not None:
        return existing
    model.set_attn_implementation(EXACT_ATTENTION)
    padded, guaranteed = make_linears_exact(model)
    kernels = [getattr(linear, "kernel", "") for _, linear in _linear_modules(model)]
    row_kernel = bool(kernels) and all(kernel == "rows" for kernel in kernels)
    on_kernel = attention_kernel.for_dtype(model.dtype) is not None
    choice = ExactChoice(
        True, reason, rows=ROWS, padded=padded, guaranteed=guaranteed, row_kernel=row_kernel,
        short_attention="kernel" if on_kernel else "float64",
    )  # fmt: skip
    if not guaranteed:
        logger.warning("speculum: %s", choice.describe())
    model._speculum_exact = choice
    return choice


def make_linears_exact(module: nn.Module) -> tuple[tuple[tuple[str, int, int], ...], bool]:
    """Split or pad the calls of every linear layer in ``module`` (itself included) as exact mode
    needs; returns (layer kind, rows, count) for the padded ones, and whether every kernel measured
    row-count invariant that way (``ExactChoice.padded``, ``ExactChoice.guaranteed``)."""
    verdicts: dict[tuple, int | None] = {}
    padded: dict[tuple[str, int], int] = {}
    for name, linear in _linear_modules(module):
        key = _verdict_key(linear)
        if key not in verdicts:
            verdicts[key] = min_invariant_rows(linear)
        # where even ROWS rows part by slot, padding to ROWS is the best left (and said not guaranteed)
        min_rows = verdicts[key] or ROWS
        if min_rows > 1:
            kind = name.rsplit(".", 1)[-1] or name or type(linear).__name__
            padded[(kind, min_rows)] = padded.get((kind, min_rows), 0) + 1
        if min_rows == 1 and getattr(linear, "kernel", "") == "rows":
            continue  # speculum's row kernel: invariant at every row count by construction, no pieces
        linear.forward = _split_rows(linear.forward, _in_features(linear), min_rows)
    guaranteed = all(v is not None for v in verdicts.values())
    return tuple((kind, rows, count) for (kind, rows), count in sorted(padded.items())), guaranteed


def is_exact(model: nn.Module) -> bool:
    choice = getattr(model, "_speculum_exact", None)
    return choice is not None and choice.enabled


def prefill_end(model: nn.Module, done: int, wanted: int, last: int) -> int:
    """Where a prefill from position ``done`` that wants to stop at ``wanted`` (at most ``last``, the
    prompt's end) stops. An exact model stops only where every layout stops, so that a prompt's keys
    and values never depend on how a server split its prefill among other work: at a multiple of
    ``PREFILL_PIECE`` or the prompt's end, the nearest below ``wanted`` or else the next one."""
    if not is_exact(model) or wanted >= last:
        return min(wanted, last)
    aligned = wanted - wanted % PREFILL_PIECE
    return aligned if aligned > done else min(last, (done // PREFILL_PIECE + 1) * PREFILL_PIECE)


def prefill_pieces(model: nn.Module, done: int, count: int) -> list[int]:
    """The sizes of the forwards that prefill ``count`` positions from ``done``: one for a model not in
    exact mode, else pieces that end at multiples of ``PREFILL_PIECE``."""
    if not is_exact(model):
        return [count]
    sizes, position, end = [], done, done + count
    while position < end:
        step = min(end, (position // PREFILL_PIECE + 1) * PREFILL_PIECE) - position
        sizes.append(step)
        position += step
    return sizes


def wants_exact(exact: bool | str, dtype: torch.dtype, quantized: bool = False) -> tuple[bool, str]:
    """Resolve ``exact`` (True, False or "auto": on in half precision, where plain decoding's and a
    verification's roundings part, and on quantized layers, whose 8-bit activations turn a last-bit
    difference of float32 attention into a step of the activations' scale) to (on, why)."""
    if exact not in (True, False, "auto"):
        raise InvalidInputError(f"exact must be True, False or 'auto', got {exact!r}")
    if exact == "auto":
        if quantized:
            return True, "auto: quantized layers"
        half = dtype in (torch.bfloat16, torch.float16)
        return half, f"auto: {'half precision' if half else str(dtype).removeprefix('torch.') + ' needs none'}"
    return bool(exact), "asked" if exact else "not asked"
