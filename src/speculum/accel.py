"""Faster linear layers on CPU: weights prepacked once for oneDNN, in float32 and bfloat16.

Speculation only pays if verifying K tokens costs about as much as decoding one. With PyTorch's
default float32 path (MKL) on the CPUs measured here, a linear layer over 2 rows costs ~2x one row
(matrix-vector vs matrix-matrix kernels), so a draft of even 2 tokens doubled the step. oneDNN's
kernels on weights reordered once into its blocked layout (``torch.ops.mkldnn``, the same
prepacking ``torch.compile``'s CPU freezing uses) keep 1..8 rows nearly flat and make a single row
faster too. See BENCHMARKS.md for t(K) with and without it.

bfloat16 layers are prepacked too where the CPU computes bfloat16 natively (AVX-512-BF16, AMX).
PyTorch's stock bfloat16 linear already runs oneDNN's kernels there, but reorders the weight on
every call: prepacked, a Qwen2.5-Coder 1.5B layer's MLP runs 2-2.8x faster over 1-8 rows and a step
of the whole model over 1-8 tokens 25-34% cheaper, with logits bit-identical to the stock layers'
(issue #18, fourteenth pass). Where bfloat16 is emulated it is left as it is (not measured there).

The swap is reversible (``unpacked``) so a benchmark can time transformers' stock model in the
same process. Numerics: float32 results differ from MKL's in the last bits, exactly like any other
kernel choice; greedy equality is always between runs on the same kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (float32 or bfloat16, CPU, inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes prepacked on this CPU: float32, and bfloat16 where it is computed natively."""
    from speculum.models.dtypes import cpu_has_fast_bf16

    return frozenset({torch.float32, torch.bfloat16} if cpu_has_fast_bf16() else {torch.float32})


def supported(model: nn.Module) -> bool:
    """Prepacking applies to float32 models on CPU where oneDNN is available, and to bfloat16 ones
    where the CPU computes bfloat16 natively (not to models that accelerate dispatches over several
    devices or offloads: their hooks manage the weights)."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return False
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if not dtypes or not dtypes <= packable_dtypes():
        return False
    if any(hasattr(m, "_hf_hook") for m in model.modules()) or not torch.backends.mkldnn.is_available():
        return False
    try:
        for dtype in dtypes:
            probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), probe, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


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
    in new memory, and on the machines measured here decoding from it ran 5-20% slower for a while
    (issue #18, twelfth pass: in a benchmark, the method timed right after each transformers row)."""
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
    return head.out_features if isinstance(head, PackedLinear) else head.weight.shape[0]
