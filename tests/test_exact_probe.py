"""Exact mode's linear probe (``speculum.exact.min_invariant_rows``, ``make_linears_exact``): every slot
of every call is checked, and layers whose kernels may differ (a bias or none, a ``PackedLinear``'s
small-forward mode) are measured apart, against fake kernels whose rounding is planted."""

import pytest
import torch

from speculum import accel, exact

FEATURES = 8
NUDGE = 1e-2  # far above float32 rounding: a planted difference, not a rounding one


def rowwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A fake square kernel that is row-wise by construction: no row count or slot changes a row."""
    return x * weight.diagonal()


def nudged(out: torch.Tensor, rows: int, slot: int) -> torch.Tensor:
    """``out`` with one slot of calls of exactly ``rows`` rows rounded apart."""
    flat = out.reshape(-1, out.shape[-1])
    if flat.shape[0] == rows:
        flat = flat.clone()
        flat[slot] += NUDGE
    return flat.reshape(out.shape)


class InnerSlot(torch.nn.Module):
    """A layer whose kernel rounds one inner slot of one row count apart (slot 1 of 8-row calls, as a
    bfloat16 1536x8960 ``F.linear`` on an AMX Xeon rounds rows 1 and 7 while row 0 agrees)."""

    in_features = FEATURES

    def __init__(self, rows: int, slot: int):
        super().__init__()
        self.rows, self.slot = rows, slot
        self.weight = torch.nn.Parameter(torch.randn(FEATURES, FEATURES))

    def forward(self, x):
        return nudged(rowwise(x, self.weight), self.rows, self.slot)


@pytest.mark.parametrize("slot", [1, 3, 6])
def test_a_call_that_rounds_one_inner_slot_apart_is_found(slot):
    """Calls of 8 rows part in one inner slot: calls of 8 rows or fewer are padded to 9."""
    assert exact.min_invariant_rows(InnerSlot(8, slot)) == 9


@pytest.mark.parametrize("slot", [1, 5, 9, 14])
def test_full_calls_that_round_one_inner_slot_apart_are_not_guaranteed(slot):
    assert exact.min_invariant_rows(InnerSlot(exact.ROWS, slot)) is None


class Model(torch.nn.Module):
    def __init__(self, *layers: torch.nn.Module):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def test_layers_with_and_without_bias_are_measured_apart(monkeypatch):
    """With a bias the kernel (addmm) is row-count invariant, without one (mm) it rounds a lone row
    apart: the layer without a bias is padded even where a layer of its shape with one came first."""

    def linear(x, weight, bias=None):
        out = rowwise(x, weight)
        return out + bias if bias is not None else nudged(out, 1, 0)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    with_bias, without = torch.nn.Linear(FEATURES, FEATURES), torch.nn.Linear(FEATURES, FEATURES, bias=False)
    padded, guaranteed = exact.make_linears_exact(Model(with_bias, without))
    assert guaranteed and padded == (("1", 2, 1),)  # layers.1, the one without a bias
    row = torch.randn(1, FEATURES)
    pair = torch.cat([row, torch.randn(1, FEATURES)])
    with torch.inference_mode():
        assert torch.equal(without(row)[0], without(pair)[0])  # a lone row computed as in a pair


def packed(min_rows: int = 1, dense_rows: int = 0) -> accel.PackedLinear:
    """A ``PackedLinear`` in the given small-forward mode; its packed kernel is faked by the test."""
    layer = accel.PackedLinear.__new__(accel.PackedLinear)
    torch.nn.Module.__init__(layer)
    layer.in_features = layer.out_features = FEATURES
    layer.packed_weight = torch.randn(FEATURES, FEATURES)
    layer.bias, layer.rows = None, None  # the oneDNN path (rows: speculum's row kernel, unused here)
    layer.min_rows, layer.dense_rows = min_rows, dense_rows
    layer.dense_weight = layer.packed_weight.clone() if dense_rows else None
    return layer


def test_packed_layers_in_other_small_forward_modes_are_measured_apart(monkeypatch):
    """A ``PackedLinear`` whose one-row forwards run on the stock kernel (``dense_rows``) rounds them
    apart from its packed kernel's: it is padded even where a packed layer of its shape, run on the
    packed kernel alone, came first and needs no padding."""
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, weight, bias=None: nudged(rowwise(x, weight), 1, 0))
    monkeypatch.setattr(accel.torch.ops, "mkldnn", FakeMkldnn())
    plain, dense = packed(), packed(dense_rows=1)
    padded, guaranteed = exact.make_linears_exact(Model(plain, dense))
    assert guaranteed and padded == (("1", 2, 1),)


class FakeMkldnn:
    """``torch.ops.mkldnn`` with a row-wise fake of the packed kernel."""

    @staticmethod
    def _linear_pointwise(x, weight, bias, *args):
        return rowwise(x, weight)


def test_the_verdict_key_tells_apart_what_chooses_the_kernel():
    base = torch.nn.Linear(FEATURES, FEATURES)
    assert exact._verdict_key(base) == exact._verdict_key(torch.nn.Linear(FEATURES, FEATURES))
    assert exact._verdict_key(base) != exact._verdict_key(torch.nn.Linear(FEATURES, FEATURES, bias=False))
    modes = {exact._verdict_key(packed(m, d)) for m, d in ((1, 0), (4, 0), (1, 2), (4, 2))}
    assert len(modes) == 4
