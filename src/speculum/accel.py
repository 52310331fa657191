"""Faster linear layers on CPU: weights prepacked once for oneDNN, in float32 and bfloat16.

Speculation only pays if verifying K tokens costs about as much as decoding one. With PyTorch's
default float32 path (MKL), a linear layer over 2 rows costs about twice one row (matrix-vector vs
matrix-matrix kernels), so a draft of even 2 tokens doubles the step. oneDNN's kernels on weights
reordered once into its blocked layout (``torch.ops.mkldnn``, the same prepacking ``torch.compile``'s
CPU freezing uses) keep 1..8 rows nearly flat and make a single row faster too (t(K) with and
without it: docs/results.md).

bfloat16 layers are prepacked too where the CPU computes bfloat16 natively (AVX-512-BF16, AMX).
PyTorch's stock bfloat16 linear already runs oneDNN's kernels there, but reorders the weight on
every call; prepacked, the same kernels run without the reorder, with logits bit-identical to the
stock layers'. Where bfloat16 is emulated it is left as it is. On CPUs with AVX-512 BF16 but no AMX, bfloat16
layers run on speculum's own row kernel instead (:mod:`speculum.kernels`): it streams a one-token
step's weights faster than oneDNN there and rounds every row alike whatever the row count.

Forwards over fewer than 4 rows can be padded to 4 (``PackedLinear.min_rows``, decided by
measuring the loaded model: :func:`speculum.row_padding.choose_row_padding`): on some CPUs oneDNN's
kernels for 1-2 rows run slower than its kernel for 4, and padded to 4 rows (the extra rows zeros,
their outputs dropped) the one- and two-token forwards cost no more than four tokens do. A draft
model verifying one token a round gains the most. On other CPUs the stock kernel is the faster one
for those forwards while the packed one stays faster for wider ones. There one- and two-row
forwards run on the stock kernel over a dense copy of each weight (``PackedLinear.dense_rows``,
decided by the same measurement, only where the copies fit in memory), and wider ones on the
packed weights.

The swap is reversible (``unpacked``) so a benchmark can time transformers' stock model in the
same process. Numerics: float32 results differ from MKL's in the last bits, exactly like any other
kernel choice; greedy equality is always between runs on the same kernels.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from speculum import kernels, machine

logger = logging.getLogger("speculum")

DENSE_ROWS = 2  # forwards of at most this many rows may run on the stock kernel (a dense copy of the weight)


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (float32 or bfloat16, CPU, inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        # bfloat16 on speculum's row kernel where it is the faster one (speculum.kernels), else oneDNN's
        self.rows = kernels.rows_kernel() if linear.weight.dtype == torch.bfloat16 else None
        if self.rows is not None:
            self.packed_weight = kernels.pack_rows(linear.weight)
            self.bias32 = kernels.pack_bias(linear.bias)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.min_rows = 1  # inputs of fewer rows are padded to this many (see choose_row_padding)
        # inputs of at most this many rows run on the stock kernel, over a dense copy of the weight
        # (see choose_row_padding: on some CPUs MKL's one-row kernel beats oneDNN's packed one)
        self.dense_rows = 0
        self.dense_weight: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        """``x @ weight.T + bias`` prepacked, for matrices that are not an ``nn.Linear``'s (draft heads')."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        return cls(linear)

    @property
    def kernel(self) -> str:
        """Which kernel the layer runs on: "rows" (speculum's, row-count invariant) or "onednn"."""
        return "rows" if self.rows is not None else "onednn"

    def dense(self) -> torch.Tensor:
        """The weight as an [out, in] matrix (a copy)."""
        if self.rows is not None:
            return kernels.unpack_rows(self.packed_weight, self.out_features, self.in_features)
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:  # no padding or dense copy: every row count runs alike on it
            return kernels.rows_linear(self.rows, x, self.packed_weight, self.bias32, self.out_features)
        rows = x.numel() // self.in_features
        if 0 < rows <= self.dense_rows and self.dense_weight is not None:
            return torch.nn.functional.linear(x, self.dense_weight, self.bias)
        if 0 < rows < self.min_rows:  # a kernel for more rows that runs faster: pad with zero rows
            flat = x.reshape(rows, self.in_features)
            flat = torch.cat([flat, flat.new_zeros(self.min_rows - rows, self.in_features)])
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dense = self.dense_weight if self.dense_weight is not None else self.dense()
        linear.weight = nn.Parameter(dense, requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        padded = ", kernel=rows" if self.rows is not None else ""
        padded += f", min_rows={self.min_rows}" if self.min_rows > 1 else ""
        padded += f", dense_rows={self.dense_rows}" if self.dense_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{padded}"


def packable_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes prepacked on this CPU: float32, and bfloat16 where it is computed natively."""
    return frozenset({torch.float32, torch.bfloat16} if machine.cpu_has_fast_bf16() else {torch.float32})


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are prepacked on this CPU (oneDNN present and working for it)."""
    if dtype not in packable_dtypes() or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), probe, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def supported(model: nn.Module) -> bool:
    """Prepacking applies to float32 models on CPU where oneDNN is available, and to bfloat16 ones
    where the CPU computes bfloat16 natively (not to models that accelerate dispatches over several
    devices or offloads: their hooks manage the weights)."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if not dtypes or any(hasattr(m, "_hf_hook") for m in model.modules()):
        return False
    return all(packs(dtype) for dtype in dtypes)


def _swap(model: nn.Module, convert) -> int:
    # each module converted once (a conversion reorders or copies the weights: not a test to repeat)
    swapped = [(name, new) for name, module in list(model.named_modules()) if (new := convert(module)) is not None]
    for name, new in swapped:
        model.set_submodule(name, new)
    return len(swapped)


def prepack(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (see :func:`supported`); returns how many."""
    if not supported(model):
        return 0
    with torch.no_grad():
        return _swap(model, lambda m: PackedLinear(m) if type(m) is nn.Linear else None)


def unpack(model: nn.Module) -> int:
    """Undo ``prepack`` (exactly: the blocked layout is a reordering of the same numbers)."""
    with torch.no_grad():
        return _swap(model, lambda m: m.to_linear() if isinstance(m, PackedLinear) else None)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


@contextlib.contextmanager
def unpacked(*models: nn.Module | None) -> Iterator[None]:
    """Run a block on the stock ``nn.Linear`` layers (e.g. to time transformers' own generate).

    The packed layers are put back as they were, not packed again: a fresh reorder lands the weights
    in new memory, and decoding from it runs slower for a while (in a benchmark, the method timed
    right after each transformers row would pay for it)."""
    originals: list[tuple[nn.Module, str, PackedLinear]] = []
    for model in models:
        if model is not None:
            originals += [(model, name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    dense: dict[int, nn.Linear] = {}  # one copy per packed layer: a layer two models share stays shared
    with torch.no_grad():
        for model, name, packed in originals:
            if id(packed) not in dense:
                dense[id(packed)] = packed.to_linear()
            model.set_submodule(name, dense[id(packed)])
    try:
        yield
    finally:
        for model, name, packed in originals:
            model.set_submodule(name, packed)


def output_size(model: nn.Module) -> int:
    """Rows of the LM head (the logits' width), packed or not."""
    head = model.get_output_embeddings()
    outputs = getattr(head, "out_features", None)  # nn.Linear, PackedLinear, QuantizedLinear
    return outputs if outputs is not None else head.weight.shape[0]


# ------------------------------------------------------------------------------- row padding


def set_min_rows(model: nn.Module, rows: int) -> int:
    """Pad every packed layer's inputs of fewer than ``rows`` rows to ``rows`` (1: no padding); returns
    how many layers."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.rows is None]
    for layer in layers:
        layer.min_rows = rows
    return len(layers)


def min_rows(model: nn.Module) -> int:
    """The row padding of ``model``'s packed layers (1: none, or not packed)."""
    return max((m.min_rows for m in model.modules() if isinstance(m, PackedLinear)), default=1)


def set_dense_rows(model: nn.Module, rows: int) -> int:
    """Run every packed layer's inputs of at most ``rows`` rows on the stock kernel (0: never), keeping
    a dense copy of each weight for it (made here, dropped again with ``rows=0``); returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.rows is None]
    with torch.no_grad():
        for layer in layers:
            if rows and layer.dense_weight is None:
                layer.dense_weight = layer.dense()
            elif not rows:
                layer.dense_weight = None
            layer.dense_rows = rows
    return len(layers)


def dense_rows(model: nn.Module) -> int:
    """How many rows ``model``'s packed layers run on the stock kernel at most (0: none, or not packed)."""
    return max((m.dense_rows for m in model.modules() if isinstance(m, PackedLinear)), default=0)
