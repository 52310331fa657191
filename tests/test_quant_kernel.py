"""speculum's quantized row kernel: GGUF blocks read exactly, and its product the same bits as its
torch reference, in every row whatever the row count, slot or thread count (portable and native builds)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from speculum.kernels import KernelUnavailable, quant
from speculum.kernels.gguf_blocks import FORMATS, decode, dequantize
from speculum.models import gguf_weights

gguf = pytest.importorskip("gguf")

NATIVE = quant.native_isa()
ISAS = quant.runnable_isas()  # every build this CPU runs: the same bits from each
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these; the K types get random blocks
_F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2]}
_F16_AT["Q6_K"] = [208]


def _module(isa: str):
    try:
        return quant.load(isa)
    except KernelUnavailable as error:
        if isa != "portable":
            _module("portable")  # a compiler that builds the portable kernel must build this one too
            raise
        pytest.skip(str(error))  # pragma: no cover - a machine without a C++ compiler


def random_blocks(name: str, n: int, k: int, seed: int = 0, size: float = 0.05) -> np.ndarray:
    """Valid random blocks of type ``name`` for an [n, k] matrix, weights about ``size`` at most."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    top = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "Q8_0": 128, "Q4_0": 8, "Q5_0": 16}.get(name, 31)
    for at in _F16_AT[name]:
        scale = rng.uniform(0.3, 1.0, size=(n, k // fmt.block)) * size / top
        if at == 2 and name in ("Q4_1", "Q5_1"):
            scale = -scale * 8  # the minimum m, below zero
        raw[..., at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, k // fmt.block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decoded_blocks_dequantize_as_gguf_does(name):
    raw = random_blocks(name, 19, 512, seed=3)
    weight = decode(raw, name, (19, 512))
    expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(19, 512)
    assert np.array_equal(dequantize(weight).numpy().view(np.uint32), expected.view(np.uint32))
    rows = torch.tensor([18, 0, 7])  # and from the packed layout, as the embedding reads rows
    again = gguf_weights.unpack_rows(quant.pack(weight), rows)
    assert torch.equal(dequantize(again), dequantize(weight)[rows])


def _correctly_rounded(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to float32, from the exact rational value (nearest, ties to even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))


def test_fused_multiply_add_rounds_once_where_float64_would_round_twice():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(3000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 3000)
    b = rng.standard_normal(3000).astype(np.float32)
    c = rng.standard_normal(3000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 3000)
    # (1 + 2^-23) + 2^-24 - 2^-60 lies just below a float32 midpoint: float64 rounds it onto the
    # midpoint, whose tie then goes up to the even neighbour; rounded once it goes down
    a[:2], b[:2] = [2**-24 * (1 + 2**-18), -(2**-24) * (1 + 2**-18)], [1 - 2**-18, 1 - 2**-18]
    c[:2] = [1 + 2**-23, -(1 + 2**-23)]
    out = quant.fused_multiply_add(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    expected = np.array(
        [_correctly_rounded(*v) for v in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)], np.float32
    )
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert out[0] == np.float32(1 + 2**-23) and out[1] == -np.float32(1 + 2**-23)
    naive = (a.astype(np.float64) * b + c).astype(np.float32)  # the double rounding the test is about
    assert naive[0] == np.float32(1 + 2**-22)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_equals_its_torch_reference(isa, name):
    module = _module(isa)
    n, k = 37, 512  # a width that pads to 48 columns
    weight = decode(random_blocks(name, n, k, seed=1), name, (n, k))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, k, generator=gen)
    x[3, 40] = 30.0  # an outlier: its unit quantizes coarser, the others do not care
    x[5] = 0.0  # an all-zero row (scale 0)
    bias = torch.randn(n, generator=gen)
    out = quant.linear(module, x, quant.pack(weight), bias)
    assert torch.equal(out, quant.reference_linear(x, weight, bias))
    exact = x @ dequantize(weight).T + bias  # and it is the product, up to 8-bit activations
    assert ((out - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_every_row_the_same_bits_at_any_row_count_slot_and_thread_count(isa, name):
    module = _module(isa)
    n, k = 70, 768
    packed = quant.pack(decode(random_blocks(name, n, k, seed=4), name, (n, k)))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([quant.linear(module, x[i : i + 1], packed) for i in range(40)])
    for start, count in [(0, 2), (3, 3), (5, 4), (9, 7), (1, 8), (10, 9), (20, 16), (0, 40)]:
        assert torch.equal(quant.linear(module, x[start : start + count], packed), alone[start : start + count])
    for width in (1, 2, 4):  # column blocks per register tile: the kernel picks one by row count
        assert torch.equal(quant.linear(module, x[:3], packed, width=width), alone[:3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant.linear(module, x, packed), alone)
    finally:
        torch.set_num_threads(threads)


def test_portable_and_native_builds_agree():
    if NATIVE == "portable":
        pytest.skip("this CPU runs the portable build only")
    n, k = 50, 1024
    for name in sorted(FORMATS):
        packed = quant.pack(decode(random_blocks(name, n, k, seed=6), name, (n, k)))
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
        assert torch.equal(quant.linear(_module("portable"), x, packed), quant.linear(_module(NATIVE), x, packed))


@pytest.mark.parametrize("isa", ISAS)
def test_layers_in_one_group_call_give_each_the_bits_of_its_own_call(isa):
    module = _module(isa)
    k = 512
    weights = [decode(random_blocks(name, n, k, seed=i), name, (n, k)) for i, (name, n) in
               enumerate([("Q4_K", 70), ("Q6_K", 16), ("Q8_0", 33)])]  # fmt: skip
    packed = [quant.pack(w) for w in weights]
    biases = [None, torch.randn(16), None]
    for rows in (1, 3, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        group = quant.linear_group(module, x, packed, biases)
        for out, p, bias in zip(group, packed, biases, strict=True):
            assert torch.equal(out, quant.linear(module, x, p, bias))
