"""The quantized row kernel (quant_rows.cpp): GGUF weights packed for it, its product, and the same
product written with torch ops (the reference the tests hold it to, and the path where nothing
compiles).

A call quantizes each row of ``x`` to int8 per 32 values (scale max|x| / 127, round half to even;
llama.cpp quantizes per 256 for K-quants, a coarser model of the file), takes exact integer dot
products per 32 and adds them up in one fixed float order, so every row's bits are the same whatever
else is in the call. Built with AVX-512 VNNI where the CPU has it (``isa="avx512vnni"``), else with AVX2
(``"avx2"``), else in portable C++: the same bits from each.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from speculum import machine
from speculum.kernels import build
from speculum.kernels.gguf_blocks import BlockWeight, Format

LANES = 16  # output columns per packed block
UNIT = 32  # activation values per int8 scale
_SOURCE = Path(__file__).with_name("quant_rows.cpp")
_FLAGS = {
    "avx512vnni": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"],
    "portable": ["-O3", "-ffp-contract=off", "-fopenmp"],
}
_NEEDS = {"avx512vnni": {"avx512_vnni", "avx512bw"}, "avx2": {"avx2", "fma"}, "portable": set()}


def runnable_isas() -> list[str]:
    """The builds this CPU can run, fastest first ("avx512vnni", "avx2", "portable")."""
    flags = machine.cpu_flags()
    return [isa for isa, needs in _NEEDS.items() if needs <= flags]


def native_isa() -> str:
    """The build this CPU runs fastest: "avx512vnni" where it has AVX-512 VNNI, "avx2" where it has
    AVX2 and FMA, else "portable"."""
    return runnable_isas()[0]


@functools.cache
def source_digest() -> str:
    """A digest of the kernel's source: measured costs and choices made on one kernel are keyed by it."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


@functools.cache
def load(isa: str | None = None) -> ModuleType:
    """The compiled quantized kernel for ``isa`` (default: :func:`native_isa`), built on first use."""
    isa = isa or native_isa()
    # the source's digest in the name: a failed rebuild can never leave an older build loaded
    return build(f"speculum_quant_rows_{isa}_{source_digest()[:8]}", _SOURCE, _FLAGS[isa], "quantized row kernel")


@dataclass
class Packed:
    """A weight as the kernel reads it (see quant_rows.cpp for the layout)."""

    format: Format
    out_features: int
    in_features: int
    codes: torch.Tensor
    high: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.high, self.a, self.b, self.A, self.B))


_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)


def pack(weight: BlockWeight) -> Packed:
    """``weight`` in the kernel's layout, its width padded to a multiple of 16 columns with zeros."""
    fmt = weight.format
    n, k = weight.shape
    pad = -n % LANES

    def lanes(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if t is None:
            return torch.empty(0, dtype=dtype)
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        return t.view(-1, LANES, t.shape[1]).transpose(1, 2).contiguous().to(dtype)

    codes = F.pad(weight.codes, (0, 0, 0, pad)) if pad else weight.codes
    blocks = codes.shape[0] // LANES
    if fmt.bits == 8:
        packed_codes = codes.view(blocks, LANES, k // 4, 4).permute(0, 2, 1, 3).reshape(blocks, k // 4, 64).contiguous()
        high = _EMPTY_U8
    else:  # [NB, K/8, half, lane, 4]: half 0 in the low nibble, half 1 in the high nibble
        split = codes.view(blocks, LANES, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
        low = split & 0x0F
        packed_codes = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(blocks, k // 8, 64).contiguous()
        planes = [(split >> (4 + p)) & 1 for p in range(fmt.bits - 4)]
        if planes:
            bits = torch.stack(planes, dim=3).reshape(blocks, k // 8, 2, fmt.bits - 4, 64).numpy()
            high = torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little").reshape(blocks, k // 8, 2, -1))
            high = high.view(torch.uint8).contiguous()
        else:
            high = _EMPTY_U8
    return Packed(
        fmt,
        n,
        k,
        packed_codes,
        high,
        lanes(weight.a, torch.int8),
        lanes(weight.b, torch.int8),
        lanes(weight.A, torch.float32),
        lanes(weight.B, torch.float32),
    )


def linear(
    module: ModuleType, x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None, width: int = 0
) -> torch.Tensor:
    """``x @ W.T + bias`` on the compiled kernel, in ``x``'s dtype (float32 inside). ``width``: column
    blocks per register tile (0: the kernel's choice, one; any width gives the same bits)."""
    return linear_group(module, x, [packed], [bias], width)[0]


def linear_group(
    module: ModuleType,
    x: torch.Tensor,
    packed: list[Packed],
    biases: list[torch.Tensor | None],
    width: int = 0,
) -> list[torch.Tensor]:
    """Several layers' ``x @ W.T + bias`` in one call (one quantization of ``x``, one pass over all
    their columns): each output the same bits as a call of its own."""
    flat = x.reshape(-1, packed[0].in_features)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    outs = module.linear_group(
        flat,
        [p.format.name for p in packed],
        [p.codes for p in packed],
        [p.high for p in packed],
        [p.a for p in packed],
        [p.b for p in packed],
        [p.A for p in packed],
        [p.B for p in packed],
        [p.format.offset for p in packed],
        width,
    )
    results = []
    for out, p, bias in zip(outs, packed, biases, strict=True):
        if out.shape[1] != p.out_features:
            out = out[:, : p.out_features]
        if bias is not None:
            out = out + bias.float()
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        results.append(out.reshape(*x.shape[:-1], p.out_features))
    return results


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float32 ``x`` [M, K] as int8 per unit of ``UNIT`` values: (values [M, K] int64,
    scales [M, K/UNIT] float32)."""
    m, k = x.shape
    units = x.view(m, k // UNIT, UNIT)
    amax = units.abs().amax(dim=-1)
    full = torch.full_like(amax, 127.0)  # tensor / tensor divides; a scalar operand would be a reciprocal times
    inv = torch.where(amax > 0, full / amax, torch.zeros_like(amax))
    q = torch.round(units * inv[..., None]).clamp(-127, 127).to(torch.int64)
    return q.view(m, k), amax / full


def reference_linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's product written with torch ops: the same integers and float steps, so the same bits."""
    fmt = weight.format
    n, k = weight.shape
    flat = x.reshape(-1, k).float()
    m = flat.shape[0]
    units, per_unit = k // UNIT, UNIT // fmt.group
    xq, dx = quantize_rows(flat)
    xg = xq.view(m, k // fmt.group, fmt.group)
    sums = xg.sum(-1)  # [M, K/G]
    dots = torch.einsum("mgi,ngi->mng", xg, weight.codes.view(n, k // fmt.group, fmt.group).to(torch.int64))
    per_block = fmt.block // UNIT  # units per float scale
    scale = weight.A.repeat_interleave(per_block, dim=1)  # [N, units]
    if fmt.two_scale:
        low = weight.B.repeat_interleave(per_block, dim=1)
        if fmt.sub_scales:  # G = UNIT here
            scale = scale * weight.a.float()
            low = low * weight.b.float()
        d = dots
    else:
        d = dots - fmt.offset * sums[:, None, :]
        if fmt.sub_scales:
            d = d * weight.a.to(torch.int64)[None]
        d = d.view(m, n, units, per_unit).sum(-1)
    scaled = dx[:, None, :] * scale[None]  # [M, N, units]
    d = d.to(torch.int32).float()
    if fmt.two_scale:
        mins = -(dx * sums.float())  # G = UNIT: one sum per unit
    out = torch.zeros(m, n)
    for u in range(units):  # units added in order, one rounding per fused multiply-add
        out = fused_multiply_add(d[..., u], scaled[..., u], out)
        if fmt.two_scale:
            out = fused_multiply_add(low[None, :, u], mins[:, None, u], out)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fused_multiply_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors with one rounding, as the kernel's fused multiply-adds: the
    product is exact in float64, the sum is rounded to odd there (a correction by its exact error),
    and rounding that to float32 is then the correctly rounded result (Boldo and Melquiond, 2008)."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    product = a * b
    total = product + c
    back = total - c  # two-sum: error = exact sum - total, representable in float64
    error = (product - back) + (c - (total - back))
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, torch.full_like(total, torch.inf), torch.full_like(total, -torch.inf))
    total = torch.where((error != 0) & even, torch.nextafter(total, toward), total)
    return total.float()
