"""GGUF quantized blocks read into one shape: integer codes, integer sub-block scales, float block scales.

Every type speculum computes on is one of two forms (``q`` the unsigned codes, ``j`` the sub-block
of ``G`` weights, the float scales per block of ``S``):

* one-scale: ``w = A * a_j * (q - c)`` — Q4_0, Q5_0, Q8_0 (``a_j`` = 1), Q6_K;
* two-scale: ``w = A * a_j * q - B * b_j`` — Q4_1, Q5_1 (``a_j`` = ``b_j`` = 1, ``B`` = -m), Q4_K, Q5_K.

The block layouts are ggml's (``ggml-quants.c``); :func:`dequantize` rounds in the order ``gguf``'s
own de-quantization does, so its floats equal ``gguf.quants.dequantize``'s bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group: int  # G: weights per integer-scaled sub-block
    block: int  # S: weights per float scale
    block_bytes: int
    two_scale: bool
    offset: int = 0  # c of the one-scale types
    sub_scales: bool = False  # a_j stored (else 1)
    sub_mins: bool = False  # b_j stored (else 1), two-scale only


FORMATS = {
    f.name: f
    for f in (
        Format("Q4_0", 4, 32, 32, 18, False, offset=8),
        Format("Q4_1", 4, 32, 32, 20, True),
        Format("Q5_0", 5, 32, 32, 22, False, offset=16),
        Format("Q5_1", 5, 32, 32, 24, True),
        Format("Q8_0", 8, 32, 32, 34, False, offset=128),
        Format("Q4_K", 4, 32, 256, 144, True, sub_scales=True, sub_mins=True),
        Format("Q5_K", 5, 32, 256, 176, True, sub_scales=True, sub_mins=True),
        Format("Q6_K", 6, 16, 256, 210, False, offset=32, sub_scales=True),
    )
}


@dataclass
class BlockWeight:
    """A [N, K] weight in the common form: ``codes`` uint8 [N, K]; ``a``, ``b`` int8 [N, K/G] or None;
    ``A``, ``B`` float32 [N, K/S] (``B`` None for one-scale types)."""

    format: Format
    codes: torch.Tensor
    a: torch.Tensor | None
    b: torch.Tensor | None
    A: torch.Tensor
    B: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight nibble layout: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: bit i of the little-endian 32-bit ``qh`` belongs to weight i."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << 4


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit (scale, min) pairs from their 12 packed bytes (``get_scale_min_k4``)."""
    lo, mid, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: per 64 weights, 32 bytes whose low nibbles are the first 32 and high nibbles the next."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q6_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K: per 128 weights, 64 bytes of low nibbles and 32 bytes of 2-bit highs (``dequantize_row_q6_K``)."""
    ql = ql.reshape(*ql.shape[:-1], 2, 2, 32)  # [half, l / 32, l]
    qh = qh.reshape(*qh.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # quarters 0..3 of a half: l, l+32, l+64, l+96
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = (qh >> shift) & 3
    return (low | (high << 4)).reshape(*ql.shape[:-3], 256)


def decode(raw: np.ndarray, name: str, shape: tuple[int, int]) -> BlockWeight:
    """The blocks of a [N, K] tensor (``raw``: its bytes, as ``gguf.GGUFReader`` gives them) in the common form."""
    fmt = FORMATS[name]
    n, k = shape
    if k % fmt.block:
        raise ValueError(f"{name} rows hold whole blocks of {fmt.block}; got a row of {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // fmt.block, fmt.block_bytes)
    a = b = B = None
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        start = 4 if fmt.two_scale else 2
        qh_bytes = 4 if fmt.bits == 5 else 0
        codes = _nibbles(blocks[..., start + qh_bytes :])
        if qh_bytes:
            codes = codes | _high_bits(blocks[..., start : start + 4])
        A = _f16(blocks, 0)
        if fmt.two_scale:
            B = -_f16(blocks, 2)
    elif name == "Q8_0":
        A = _f16(blocks, 0)
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif name in ("Q4_K", "Q5_K"):
        A, B = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        a, b = sc.astype(np.int8), mn.astype(np.int8)
        if name == "Q4_K":
            codes = _k_nibbles(blocks[..., 16:144])
        else:
            codes = _k_nibbles(blocks[..., 48:176])
            qh = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # [.., l, bit 0..7]
            codes = codes | (np.swapaxes(qh, -1, -2).reshape(codes.shape) << 4)
    elif name == "Q6_K":
        codes = _q6_codes(blocks[..., 0:128], blocks[..., 128:192])
        a = blocks[..., 192:208].view(np.int8).copy()
        A = _f16(blocks, 208)
    else:  # pragma: no cover - FORMATS and this function list the same types
        raise KeyError(name)

    def flat(t: np.ndarray | None, width: int) -> torch.Tensor | None:
        return None if t is None else torch.from_numpy(np.ascontiguousarray(t).reshape(n, width))

    return BlockWeight(
        fmt,
        flat(codes, k),
        flat(a, k // fmt.group),
        flat(b, k // fmt.group),
        flat(A, k // fmt.block),
        flat(B, k // fmt.block),
    )


def dequantize(weight: BlockWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights (of ``rows`` only, if given), rounded as ``gguf.quants.dequantize`` rounds them."""
    fmt = weight.format

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None or rows is None else t[rows]

    codes = weight.codes if rows is None else weight.codes[rows]
    a = weight.a if rows is None else pick(weight.a)
    b = weight.b if rows is None else pick(weight.b)
    A = weight.A if rows is None else weight.A[rows]
    B = weight.B if rows is None else pick(weight.B)
    n, k = codes.shape

    def per_weight(t: torch.Tensor, size: int) -> torch.Tensor:
        return t.float().repeat_interleave(size, dim=1)

    q = codes.float()
    scale = per_weight(A, fmt.block)
    if fmt.sub_scales:
        scale = scale * per_weight(a, fmt.group)
    if not fmt.two_scale:
        return scale * (q - fmt.offset)
    low = per_weight(B, fmt.block)
    if fmt.sub_mins:
        low = low * per_weight(b, fmt.group)
    return scale * q - low
