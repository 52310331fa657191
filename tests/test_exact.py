"""Exact mode (speculum.exact): in bfloat16, greedy output of every method equals plain bfloat16
decoding, a seeded sampled text equals plain seeded sampling, and a batched row equals its prompt
alone, on the five tiny architectures, with short queries' attention on speculum's kernel and in
float64.

The tiny models' LM heads are flattened so that near-ties are common: without exact mode these
comparisons part on some prompts in bfloat16 (float32 keeps them apart)."""

import dataclasses

import pytest
import torch

import speculum
from speculum import exact
from speculum.errors import InvalidInputError
from speculum.sampling import PositionNoise, SamplingParams
from test_batch import LENGTHS, OUROBOROS_SMALL, PROMPTS, run_rows

from helpers import RandomTreeDrafter, build_drafter, generate_ids, save_random_heads
from tiny_models import ARCHS, VOCAB, perturbed_copy, repetitive_prompt, tiny_model

NEW = 32


def near_tie_model(arch: str, seed: int = 0):
    model = tiny_model(arch, seed=seed, dtype=torch.bfloat16)
    with torch.no_grad():  # a flatter head: the two best logits are often within bfloat16 rounding
        model.get_output_embeddings().weight.mul_(0.25)
    return model


def prompts():
    gen = torch.Generator().manual_seed(3)
    return [repetitive_prompt(24, 5, s) for s in range(3)] + [
        torch.randint(3, VOCAB, (20,), generator=gen).tolist() for _ in range(5)
    ]


@pytest.fixture(scope="module", autouse=True)
def short_and_long_queries():
    """Queries of the tiny models' texts see 20 to 60 keys: with 40 as the line, every text crosses from
    the short queries' computation to one call per query mid-way."""
    from speculum import exact_attention

    line = exact_attention.SHORT_KEYS
    exact_attention.SHORT_KEYS = 40
    yield
    exact_attention.SHORT_KEYS = line


@pytest.fixture(scope="module", params=["kernel", "float64"])
def attention_path(request):
    """Every test here runs on both computations of short queries' attention: speculum's kernel (the
    widest build this CPU runs) and float64 SDPA (what CPUs without AVX-512 run)."""
    from speculum.kernels import attention

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(attention.ENV, request.param)
        attention.kernel.cache_clear()
        assert (attention.kernel() is not None) == (request.param == "kernel")
        yield request.param
    attention.kernel.cache_clear()


@pytest.fixture(scope="module", params=ARCHS)
def exact_arch(request, attention_path, tmp_path_factory):
    model = near_tie_model(request.param)
    draft = perturbed_copy(model, 0.4)
    path = tmp_path_factory.mktemp(request.param)
    heads = {kind: save_random_heads(kind, model, path / kind) for kind in ("medusa", "ctc")}
    choice = exact.make_exact(model)
    if not choice.guaranteed:
        pytest.skip(f"this CPU's bfloat16 linear kernels round a row by its neighbours: {choice.describe()}")
    refs = [generate_ids(model, p, build_drafter("autoregressive"), NEW)[0] for p in prompts()]
    return request.param, model, draft, heads, refs


def make(method, model, draft, heads, ref, row=0):
    if method == "random_tree":
        return RandomTreeDrafter(ref, VOCAB, seed=row)
    params = {
        "anpd": {"tree": True, "adaptive": True},
        "lookahead": {"window_size": 3, "ngram_size": 3, "guess_set_size": 2, "pool_from_prompt": True},
        "draft_model": {"num_speculative_tokens": 4},
        "ouroboros": OUROBOROS_SMALL,
        "medusa": {"heads": heads["medusa"]},
        "ctc": {"heads": heads["ctc"]},
    }.get(method, {})
    uses_draft = method in ("draft_model", "ouroboros", "auto")
    return build_drafter(method, draft if uses_draft else None, VOCAB, target=model, **params)


METHODS = ["prompt_lookup", "anpd", "lookahead", "draft_model", "ouroboros", "medusa", "ctc", "auto", "random_tree"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_bfloat16_equals_plain_bfloat16(exact_arch, method):
    arch, model, draft, heads, refs = exact_arch
    if method in ("medusa", "ctc") and arch == "gpt2":
        pytest.skip("the test heads read a plain-head architecture's hidden states")
    drafted = 0
    for i, (prompt, ref) in enumerate(zip(prompts(), refs, strict=True)):
        out, stats = generate_ids(model, prompt, make(method, model, draft, heads, ref, i), NEW)
        assert out == ref, f"prompt {i}"
        drafted += stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("method", ["autoregressive", "anpd", "draft_model", "random_tree"])
def test_batched_bfloat16_row_equals_its_prompt_alone(exact_arch, method):
    arch, model, draft, heads, _ = exact_arch
    plain = build_drafter("autoregressive")
    alone = [generate_ids(model, p, plain, n)[0] for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    drafters = [make(method, model, draft, heads, ref, i) for i, ref in enumerate(alone)]
    outputs, _ = run_rows(model, drafters)
    assert outputs == alone


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model", "random_tree"])
def test_seeded_sampled_bfloat16_equals_plain_seeded_sampling(exact_arch, method):
    arch, model, draft, heads, refs = exact_arch
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    for i, prompt in enumerate(prompts()[:4]):

        def noise(seed=i):
            return PositionNoise(torch.Generator().manual_seed(seed))

        plain, _ = generate_ids(model, prompt, build_drafter("autoregressive"), NEW, sampling, noise=noise())
        drafter = make(method, model, draft, heads, plain, i)
        out, _ = generate_ids(model, prompt, drafter, NEW, sampling, torch.Generator().manual_seed(9), noise=noise())
        assert out == plain, f"prompt {i}"


def test_make_exact_switches_attention_and_is_idempotent():
    model = tiny_model("llama", dtype=torch.bfloat16)
    choice = exact.make_exact(model)
    assert model.config._attn_implementation == exact.EXACT_ATTENTION
    assert choice.enabled and choice.rows == exact.ROWS
    assert exact.make_exact(model) is choice
    assert "attention per query" in choice.describe()


def test_split_linear_layers_give_the_same_rows():
    """Forwards over more rows than a piece hold are split; every row comes out as one full call's
    would in float64 (where a linear's rounding cannot depend on the split)."""
    linear = torch.nn.Linear(24, 40).double()
    x = torch.randn(3, 17, 24, dtype=torch.float64)
    full = linear(x)
    calls = []

    def counted(rows):
        calls.append(rows.numel() // 24)
        return linear(rows)

    split = exact._split_rows(counted, 24, min_rows=1)(x)
    assert split.shape == full.shape and torch.allclose(split, full)
    assert calls == [16, 16, 16, 3]
    calls.clear()
    padded = exact._split_rows(counted, 24, min_rows=4)(x[:1, :3])
    assert padded.shape == (1, 3, 40) and torch.allclose(padded, full[:1, :3])
    assert calls == [4]
    calls.clear()
    exact._split_rows(counted, 24, min_rows=4)(x[:1, :4])
    exact._split_rows(counted, 24, min_rows=4)(x[:1, :17])
    assert calls == [4, 16, 4]


def test_min_invariant_rows_is_measured_on_the_module():
    """A module whose output for a row depends on the other rows, or on their count, is found out."""

    class Scale(torch.nn.Module):  # row-wise by construction: no kernel choice can change a row
        in_features = 8

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

        def forward(self, x):
            return x * self.weight

    class Mixing(Scale):
        def forward(self, x):
            return super().forward(x) + x.sum() * 1e-3

    class ByRowCount(Scale):  # one kernel for a single row, another for more
        def forward(self, x):
            return super().forward(x) + (1e-3 if x.shape[0] == 1 else 0.0)

    class BySmallCount(Scale):  # one kernel up to 4 rows, another from 5
        def forward(self, x):
            return super().forward(x) + (1e-3 if x.shape[0] <= 4 else 0.0)

    assert exact.min_invariant_rows(Scale()) == 1
    assert exact.min_invariant_rows(Mixing()) is None
    assert exact.min_invariant_rows(ByRowCount()) == 2
    assert exact.min_invariant_rows(BySmallCount()) == 5


def test_a_model_whose_kernels_part_by_row_count_is_padded():
    """Where one row and several round differently, one-row calls are padded (to two rows or more,
    as this CPU's float32 kernels need), and the
    model's output then equals plain decoding's whatever the layout (here in float32, where the
    planted difference is far above rounding)."""
    model = tiny_model("qwen2")
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            plain = module.forward
            module.forward = lambda x, plain=plain: plain(x) + (0.05 if x.numel() == x.shape[-1] else 0.0)
    from speculum.costs import machine_key
    from speculum.runner import ModelRunner

    choice = exact.make_exact(model)
    padded_key = machine_key(ModelRunner(model))
    model._speculum_exact = dataclasses.replace(choice, padded=())
    assert machine_key(ModelRunner(model)) != padded_key  # a curve measured unpadded is not this model's
    model._speculum_exact = choice
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert choice.guaranteed and sum(count for _, rows, count in choice.padded) == linears
    assert min(rows for _, rows, _ in choice.padded) >= 2 and "down_proj padded to" in choice.describe()
    prompt = repetitive_prompt(20, 4, 2)
    plain_out, _ = generate_ids(model, prompt, build_drafter("autoregressive"), 16)
    drafted, stats = generate_ids(model, prompt, build_drafter("anpd", tree=True), 16)
    assert drafted == plain_out and stats.drafted_tokens > 0


def _alone(query, key, value, b, j, columns, groups, scaling):
    """Query j of row b attending alone to ``columns`` of its row, as plain decoding would call it."""
    from speculum.exact_attention import exact_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups
    k, v = key[b : b + 1, :, columns], value[b : b + 1, :, columns]
    out, _ = exact_attention_forward(module, query[b : b + 1, :, j : j + 1], k, v, None, scaling=scaling)
    return out[0, 0]


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("groups", [1, 3])
def test_a_query_attends_as_it_would_alone(monkeypatch, attention_path, mask_kind, groups):
    """Every query of a forward (a chain, a tree, batch rows with leftover columns) gets the same bits
    as the same query alone over exactly the keys it sees, in order, on both sides of SHORT_KEYS,
    on the kernel and in float64; and that is attention (close to stock SDPA in float32)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from speculum import exact_attention

    monkeypatch.setattr(exact_attention, "SHORT_KEYS", 16)
    gen = torch.Generator().manual_seed(groups)
    rows, queries, columns, heads = 3, 6, 20, 2 * groups
    q = torch.randn(rows, heads, queries, 16, generator=gen).bfloat16()
    k, v = (torch.randn(rows, 2, columns, 16, generator=gen).bfloat16() for _ in range(2))
    lengths = [14, 4, 9]  # cached columns per row: the queries see 5 to 20 keys
    seen = torch.zeros(rows, queries, columns, dtype=torch.bool)
    for r, length in enumerate(lengths):
        seen[r, :, :length] = True
        for j in range(queries):  # row 0 a chain, the others trees (node j sees node 0 and itself)
            ancestors = range(j + 1) if r == 0 else {0, j}
            seen[r, j, [columns - queries + a for a in ancestors]] = True
    if mask_kind == "none":  # one row, a chain at the end of the cache: the causal case
        q, k, v, seen, lengths = q[:1], k[:1], v[:1], seen[:1], [columns - queries]
        seen[0, :, : columns - queries] = True
        mask = None
    else:
        mask = (
            seen[:, None]
            if mask_kind == "bool"
            else torch.zeros(rows, 1, queries, columns).masked_fill(~seen[:, None], torch.finfo(torch.float32).min)
        )
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups
    ours, _ = exact_attention.exact_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == (q.shape[0], queries, heads, 16) and ours.dtype == torch.bfloat16
    counts = set()
    for b in range(q.shape[0]):
        for j in range(queries):
            visible = seen[b, j].nonzero()[:, 0]
            counts.add(len(visible))
            assert torch.equal(ours[b, j], _alone(q, k, v, b, j, visible, groups, 0.25)), (b, j)
    assert min(counts) <= 16 < max(counts)  # both computations ran
    stock, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), seen[:, None], scaling=0.25)
    assert torch.allclose(ours.float(), stock, atol=2e-2)


def test_exact_is_resolved_by_dtype_and_bad_values_are_refused():
    assert exact.wants_exact("auto", torch.bfloat16)[0] is True
    assert exact.wants_exact("auto", torch.float32)[0] is False
    assert exact.wants_exact(True, torch.float32)[0] is True
    with pytest.raises(InvalidInputError, match="exact must be"):
        exact.wants_exact("sometimes", torch.bfloat16)
    with pytest.raises(InvalidInputError, match="exact must be"):
        speculum.load("does-not-matter", exact="sometimes")


def test_engine_runs_with_an_exact_gemma3_sliding_window():
    """Gemma 3's sliding-window layers keep their windows under the exact attention (masks are the
    runner's or transformers' sdpa masks): the exact model's float32 output equals the stock one's."""
    stock = tiny_model("gemma3")
    model = tiny_model("gemma3")
    exact.make_exact(model)
    prompt = repetitive_prompt(30, 7, 1)
    ref, _ = generate_ids(stock, prompt, build_drafter("autoregressive"), 20)
    out, _ = generate_ids(model, prompt, build_drafter("anpd", tree=True), 20)
    assert out == ref


def test_a_prefill_takes_its_rows_whole_and_a_wide_step_is_split():
    """A prefill runs every layout alike, so its rows go to each linear layer in one call (pieces of 16
    would read every weight once per piece); a forward over more rows after it is split."""
    from speculum.runner import ModelRunner

    model = tiny_model("llama", dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.down_proj
    calls = []
    original = layer.forward
    layer.forward = lambda x: calls.append(x.numel() // x.shape[-1]) or original(x)
    exact.make_exact(model)
    calls.clear()
    runner = ModelRunner(model)
    cache = runner.new_cache()
    runner.prefill(cache, repetitive_prompt(40, 5, 0))
    assert calls == [40]
    calls.clear()
    runner.forward(cache, list(range(3, 23)))
    assert calls == [16, 4]


def test_an_exact_prefill_runs_the_same_pieces_however_a_server_splits_it(monkeypatch):
    """A server prefills a prompt a budget at a time among other work; an exact model's prefill still
    runs the pieces a whole prefill runs (ends at multiples of PREFILL_PIECE), so the prompt's keys
    and values are the same bits."""
    from speculum.engine import Joining, Request
    from speculum.runner import ModelRunner

    monkeypatch.setattr(exact, "PREFILL_PIECE", 8)
    assert exact.prefill_end(torch.nn.Module(), 3, 5, 30) == 5  # not exact: where asked
    model = near_tie_model("llama")
    exact.make_exact(model)
    assert [exact.prefill_end(model, d, w, 30) for d, w in ((0, 5), (0, 13), (8, 9), (16, 40), (24, 29))] == [
        8,
        8,
        16,
        30,
        30,
    ]
    runner = ModelRunner(model)
    pieces = []
    original = runner._prefill_piece
    monkeypatch.setattr(runner, "_prefill_piece", lambda c, ids, h: pieces.append(len(ids)) or original(c, ids, h))
    prompt = repetitive_prompt(31, 5, 0)
    caches = {}
    for budget in (None, 3, 5, 13):
        pieces.clear()
        request = Request(prompt, build_drafter("autoregressive"), SamplingParams(), max_new_tokens=4)
        joining = Joining(runner, request)
        while not joining.prefill(budget):
            pass
        assert pieces == [8, 8, 8, 6], budget
        caches[budget] = joining.cache
    for budget in (3, 5, 13):
        for ours, whole in zip(caches[budget].layers, caches[None].layers, strict=True):
            assert torch.equal(ours.keys, whole.keys) and torch.equal(ours.values, whole.values)
