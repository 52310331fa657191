"""speculum's exact attention kernel (speculum.kernels.attention): every build gives the same bits,
a query's output depends only on that query and the keys it sees, and it is attention."""

import pytest
import torch

from speculum import exact_attention
from speculum.kernels import attention


@pytest.fixture(scope="module")
def builds():
    found = {}
    for isa in attention.runnable_isas():
        try:
            found[isa] = attention.load(isa)
        except attention.KernelUnavailable as error:
            if isa == "portable":  # a compiler is part of the test machine
                raise
            pytest.fail(f"the portable build compiles but the {isa} one does not: {error}")
    return found


def runs(selections):
    """The kernel's description of which keys each (row, query) pair sees, as exact mode builds it."""
    pairs = [(b, j) for b, row in enumerate(selections) for j in range(len(row))]
    plan = exact_attention._Plan(
        selections=selections, short=pairs, long=[], rows=torch.zeros(0, dtype=torch.long), row_of={},
        columns=slice(0, 0), seen=None, everyone_short=True,
    )  # fmt: skip
    return plan.runs()


def reference(q, k, v, selections, scale):
    """Each query alone in float64 over exactly its keys."""
    batch, heads, queries, dim = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(batch, queries, heads, dim, dtype=torch.float64)
    for b, row in enumerate(selections):
        for j, selection in enumerate(row):
            cols = exact_attention._columns(selection)
            if len(cols) == 0:
                continue
            kk, vv = (t[b][:, cols].double().repeat_interleave(groups, 0) for t in (k, v))
            one = torch.nn.functional.scaled_dot_product_attention(q[b, :, j : j + 1].double(), kk, vv, scale=scale)
            out[b, j] = one[:, 0]
    return out


def layout(dim, dtype, seed=0):
    """Two rows of three queries: a chain over a run of columns, and a tree whose last node sees listed
    columns; a pair that sees nothing."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 3, dim, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 90, dim, generator=gen).to(dtype) for _ in range(2))
    listed = torch.cat([torch.arange(5, 70), torch.tensor([80, 85])])
    selections = [[slice(0, 40), slice(0, 41), slice(0, 0)], [slice(5, 70), slice(5, 71), listed]]
    return q, k, v, selections


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_every_build_gives_the_same_bits_and_it_is_attention(builds, dtype, dim):
    q, k, v, selections = layout(dim, dtype)
    outs = {isa: attention.attend(module, q, k, v, runs(selections), dim**-0.5) for isa, module in builds.items()}
    first = next(iter(outs.values()))
    assert first.shape == (2, 3, 6, dim) and first.dtype == dtype
    for isa, out in outs.items():
        assert torch.equal(out, first), isa
    assert torch.count_nonzero(first[0, 2]) == 0  # a pair that sees no key
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    expected = reference(q, k, v, selections, dim**-0.5)
    assert torch.allclose(first.double(), expected, atol=tolerance)


def test_a_query_gets_the_same_bits_whatever_shares_its_call(builds):
    q, k, v, selections = layout(128, torch.float32, seed=1)
    module = builds[attention.runnable_isas()[0]]
    together = attention.attend(module, q, k, v, runs(selections), 0.1)
    for b, row in enumerate(selections):
        for j, selection in enumerate(row):
            cols = exact_attention._columns(selection)
            # alone, its keys copied out of the cache and seen as one run
            k1, v1 = k[b : b + 1][:, :, cols].contiguous(), v[b : b + 1][:, :, cols].contiguous()
            alone = attention.attend(module, q[b : b + 1, :, j : j + 1], k1, v1, runs([[slice(0, len(cols))]]), 0.1)
            assert torch.equal(alone[0, 0], together[b, j]), (b, j)


def test_the_choice_is_made_once_and_bad_settings_are_refused(monkeypatch):
    attention.kernel.cache_clear()
    monkeypatch.setenv(attention.ENV, "float64")
    assert attention.kernel() is None and attention.implementation() == "float64"
    attention.kernel.cache_clear()
    monkeypatch.setenv(attention.ENV, "kernel")
    assert attention.kernel() is not None and attention.implementation().startswith("kernel@")
    attention.kernel.cache_clear()
    monkeypatch.setenv(attention.ENV, "fast")
    with pytest.raises(ValueError, match="SPECULUM_EXACT_ATTENTION"):
        attention.kernel()
    monkeypatch.undo()
    attention.kernel.cache_clear()
