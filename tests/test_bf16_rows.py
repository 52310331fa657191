"""speculum's bfloat16 row kernel: the product it computes, every row the same bits whatever the row
count, slot or thread count, and lossless decoding on it. The portable build runs on every CPU; the
AVX-512 BF16 build where the CPU has it."""

import os

import pytest
import torch

from speculum import accel, exact, kernels, machine, row_padding
from speculum.runner import ModelRunner

from helpers import build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, repetitive_prompt, tiny_model

NATIVE = kernels.native_isa()
ISAS = ["portable", pytest.param("avx512bf16", marks=pytest.mark.skipif(NATIVE is None, reason="no AVX-512 BF16"))]


def _module(isa: str):
    try:
        return kernels.load(isa)
    except kernels.KernelUnavailable as error:  # pragma: no cover - a machine without a C++ compiler
        pytest.skip(str(error))


def _layer(out_features: int, in_features: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(torch.bfloat16)
    b = (torch.randn(out_features, generator=generator) * 0.1).to(torch.bfloat16) if bias else None
    return weight, b


def _run(module, x, weight, bias):
    packed = kernels.pack_rows(weight)
    return kernels.rows_linear(module, x, packed, kernels.pack_bias(bias), weight.shape[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(128, 96, False), (200, 77, True), (64, 2, True)])
def test_the_product_is_x_times_w_plus_b(isa, out_features, in_features, bias):
    """Widths that are not a multiple of the tile's 64 columns, odd inputs, with and without bias:
    within bfloat16's rounding of the float64 product."""
    module = _module(isa)
    weight, b = _layer(out_features, in_features, bias)
    x = torch.randn(5, in_features).to(torch.bfloat16)
    got = _run(module, x, weight, b)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert got.shape == (5, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)
    assert _run(module, x[:0], weight, b).shape == (0, out_features)
    assert _run(module, x.reshape(5, 1, in_features), weight, b).shape == (5, 1, out_features)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_has_the_same_bits_in_any_call(isa):
    """Every row count from 1 to 40 (one register tile, several, k in chunks), every slot, 1 and 2
    threads: each row's output equals its output alone."""
    module = _module(isa)
    weight, b = _layer(192, 300, bias=True)
    rows = torch.randn(40, 300).to(torch.bfloat16)
    alone = torch.cat([_run(module, rows[i : i + 1], weight, b) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for count_threads in (1, 2):
            torch.set_num_threads(count_threads)
            for start, count in [(0, 40), (3, 1), (5, 2), (1, 4), (7, 5), (2, 9), (11, 16), (0, 33)]:
                assert torch.equal(_run(module, rows[start : start + count], weight, b), alone[start : start + count])
    finally:
        torch.set_num_threads(threads)


def test_packing_round_trips_exactly():
    weight, _ = _layer(100, 37, bias=False)
    packed = kernels.pack_rows(weight)
    assert packed.shape == (128 // 16, 38 // 2, 16, 2)
    assert torch.equal(kernels.unpack_rows(packed, 100, 37), weight)


@pytest.mark.skipif(NATIVE is None, reason="no AVX-512 BF16")
def test_the_native_and_portable_builds_agree():
    weight, b = _layer(256, 512, bias=True)
    x = torch.randn(6, 512).to(torch.bfloat16)
    native, portable = _run(_module(NATIVE), x, weight, b), _run(_module("portable"), x, weight, b)
    torch.testing.assert_close(native.float(), portable.float(), atol=1e-2, rtol=1e-2)


def test_the_choice_follows_the_setting_and_the_cpu(monkeypatch):
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    assert kernels.rows_kernel_wanted()
    monkeypatch.setenv(kernels.KERNEL_ENV, "onednn")
    assert not kernels.rows_kernel_wanted()
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16", "amx_tile"})
    monkeypatch.setenv(kernels.KERNEL_ENV, "auto")
    assert not kernels.rows_kernel_wanted()  # AMX: oneDNN's tile kernels
    monkeypatch.setenv(kernels.KERNEL_ENV, "rows")
    assert kernels.rows_kernel_wanted()
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "fma"})
    assert not kernels.rows_kernel_wanted()  # no AVX-512 BF16: nothing to run it on


# ---- in a model: PackedLinear on the row kernel (where the CPU has AVX-512 BF16)

on_rows = pytest.mark.skipif(NATIVE is None or not machine.cpu_has_fast_bf16(), reason="no AVX-512 BF16")


@pytest.fixture
def rows_kernel(monkeypatch):
    monkeypatch.setenv(kernels.KERNEL_ENV, "rows")


@on_rows
def test_packed_layers_take_the_row_kernel_and_unpack_exactly(rows_kernel):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([repetitive_prompt()])
    with torch.no_grad():
        ref = model(ids).logits
        assert accel.prepack(model) == 2 * 7 + 1
        layers = [m for m in model.modules() if isinstance(m, accel.PackedLinear)]
        assert all(m.kernel == "rows" for m in layers) and "kernel=rows" in repr(layers[0])
        torch.testing.assert_close(model(ids).logits.float(), ref.float(), atol=0.1, rtol=0.05)
    assert row_padding.choose_row_padding(ModelRunner(model)).rows == 1  # nothing to pad
    assert exact.min_invariant_rows(layers[0]) == 1
    accel.unpack(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@on_rows
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_methods_equal_plain_decoding_on_the_row_kernel_in_exact_mode(rows_kernel, arch):
    """Exact mode on the row kernel: every method's greedy text is plain decoding's, token for token."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    draft = perturbed_copy(model, 0.4)
    accel.prepack(model)
    accel.prepack(draft)
    choice = exact.make_exact(model)
    assert choice.guaranteed and not choice.padded and choice.row_kernel
    assert "row kernel" in choice.describe()
    prompt = repetitive_prompt(30, 7, 1)
    plain = generate_ids(model, prompt, build_drafter("autoregressive", draft, VOCAB), 40)[0]
    for method in ["prompt_lookup", "anpd", "draft_model", "lookahead"]:
        assert generate_ids(model, prompt, build_drafter(method, draft, VOCAB), 40)[0] == plain, method


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed midway leaves torch's lock file behind, on which every later build would wait."""
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path))
    lock = kernels.build_dir("speculum_test") / "lock"
    lock.write_text("")
    assert kernels.build_dir("speculum_test") == lock.parent and lock.exists()  # a build may be running
    old = lock.stat().st_mtime - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernels.build_dir("speculum_test")
    assert not lock.exists()
