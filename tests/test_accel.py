"""Prepacked linears (float32; bfloat16 where the CPU computes it natively): same function, exact round
trip, and every method still lossless on them."""

import pytest
import torch

from speculum import accel, kernels, machine, row_padding
from speculum.runner import ModelRunner

from helpers import build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, repetitive_prompt, tiny_model

pytestmark = pytest.mark.skipif(not accel.supported(tiny_model("llama")), reason="oneDNN prepacking unavailable")


@pytest.fixture(autouse=True)
def _onednn(monkeypatch):
    """These tests are about oneDNN's prepacked layers: bfloat16 too (speculum's row kernel, which
    takes bfloat16 layers where the CPU has AVX-512 BF16 but no AMX, has its own: test_bf16_rows.py)."""
    monkeypatch.setenv(kernels.KERNEL_ENV, "onednn")


@pytest.fixture(autouse=True)
def _at_rest(monkeypatch):
    """A machine at rest: other jobs on this one would make every measured verdict provisional. No CPU
    time is read while measuring: the quiet load average judges alone."""
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(machine, "cpu_time", lambda: None)


def test_prepack_same_logits_and_exact_unpack():
    model = tiny_model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([repetitive_prompt()])
    with torch.no_grad():
        ref = model(ids).logits
        count = accel.prepack(model)
        assert count == 2 * 7 + 1  # q k v o gate up down per layer, plus the LM head
        assert accel.is_packed(model) and accel.output_size(model) == VOCAB
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)
    accel.unpack(model)
    assert not accel.is_packed(model)
    after = model.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_unpacked_context_restores_packing():
    model = tiny_model("llama")
    accel.prepack(model)
    packed = [m for m in model.modules() if isinstance(m, accel.PackedLinear)]
    with accel.unpacked(model, None):
        assert not accel.is_packed(model)
    assert accel.is_packed(model)
    # the same packed layers come back, not a new reorder of the weights (new memory decoded slower)
    assert [m for m in model.modules() if isinstance(m, accel.PackedLinear)] == packed


def test_unpacked_keeps_a_layer_two_models_share_shared():
    target = tiny_model("llama")
    accel.prepack(target)
    draft = torch.nn.Module()
    draft.head = target.lm_head  # as a self-draft holds the target's own LM head, under another parent
    with accel.unpacked(target, draft):
        assert isinstance(draft.head, torch.nn.Linear)
        assert draft.head is target.lm_head  # one dense copy, still shared
    assert draft.head is target.lm_head and isinstance(draft.head, accel.PackedLinear)


native_bf16 = pytest.mark.skipif(not machine.cpu_has_fast_bf16(), reason="this CPU has no native bfloat16")


def test_bfloat16_left_stock_where_the_cpu_emulates_it(monkeypatch):
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    assert accel.prepack(tiny_model("llama", dtype=torch.bfloat16)) == 0
    assert accel.prepack(tiny_model("llama")) > 0  # float32 still is


@native_bf16
def test_bfloat16_prepack_gives_the_stock_layers_bits():
    """oneDNN computes stock bfloat16 linears too (reordering the weight each call): prepacked, the
    logits are the same bits, so texts do not change with prepacking."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([repetitive_prompt()])
    with torch.no_grad():
        ref = model(ids).logits
        assert accel.prepack(model) == 2 * 7 + 1
        assert accel.is_packed(model)
        assert torch.equal(model(ids).logits, ref)
        with accel.unpacked(model):
            assert torch.equal(model(ids).logits, ref)
    accel.unpack(model)
    for key, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, before[key]), key


@native_bf16
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_method_gives_the_same_text_on_a_packed_bfloat16_model(arch):
    """Prepacking changes no bit of a bfloat16 model's outputs, so no method's text changes with it
    (whether a bfloat16 method matches plain decoding is another question: near-ties, see float32)."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    draft = perturbed_copy(model, 0.4)
    prompt = repetitive_prompt(30, 7, 1)
    methods = ["autoregressive", "prompt_lookup", "anpd", "draft_model"]
    stock = {m: generate_ids(model, prompt, build_drafter(m, draft, VOCAB), 40)[0] for m in methods}
    accel.prepack(model)
    accel.prepack(draft)
    for method in methods:
        assert generate_ids(model, prompt, build_drafter(method, draft, VOCAB), 40)[0] == stock[method], method


# ---- padding small forwards to 4 rows (a faster oneDNN kernel on some CPUs; decided by measuring)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=native_bf16)])
def test_padded_rows_give_the_four_row_kernels_results(dtype):
    """A padded layer computes 1-3 rows as the first rows of a 4-row product (zeros below), in any
    input shape, and leaves 4 or more rows (and empty inputs) as they were."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(dtype)
    layer = accel.PackedLinear(linear)
    x = torch.randn(2, 1, 3, 64).to(dtype)  # 6 rows in all
    unpadded = {rows: layer(x.reshape(-1, 64)[:rows]) for rows in range(1, 7)}
    layer.min_rows = 4
    for rows in range(1, 4):
        flat = x.reshape(-1, 64)[:rows]
        four = torch.cat([flat, flat.new_zeros(4 - rows, 64)])
        expected = torch.ops.mkldnn._linear_pointwise(four, layer.packed_weight, layer.bias, "none", [], "")[:rows]
        got = layer(flat[None])  # [1, rows, 64]
        assert got.shape == (1, rows, 96)
        assert torch.equal(got[0], expected)
        torch.testing.assert_close(got[0], unpadded[rows], atol=2e-2, rtol=2e-2)
    for rows in (4, 5, 6):
        assert torch.equal(layer(x.reshape(-1, 64)[:rows]), unpadded[rows])
    assert layer(torch.empty(0, 64, dtype=dtype)).shape == (0, 96)
    assert layer(x).shape == (2, 1, 3, 96)
    assert "min_rows=4" in repr(layer)


def test_methods_stay_exact_with_padded_forwards():
    """Padding changes which kernel runs, for plain decoding as for verification: greedy output still
    equals plain greedy decoding's on the same (padded) model, for chains and trees."""
    model = tiny_model("qwen2")
    draft = perturbed_copy(model, 0.4)
    accel.prepack(model)
    accel.prepack(draft)
    assert accel.set_min_rows(model, 4) == 2 * 7 + 1 and accel.min_rows(model) == 4
    prompt = repetitive_prompt(30, 7, 1)
    plain = generate_ids(model, prompt, build_drafter("autoregressive", draft, VOCAB), 40)[0]
    for method in ["prompt_lookup", "anpd", "draft_model", "lookahead"]:
        ids, stats = generate_ids(model, prompt, build_drafter(method, draft, VOCAB), 40)
        assert ids == plain, method
    assert stats.target_forwards < 40  # something was drafted and verified


class _FakeRunner:
    """Stands in for ModelRunner in the padding measurement: a packed model whose forwards take the
    time ``cost(width, padded)`` (advanced on a fake clock), so the decision is deterministic."""

    def __init__(self, cost, clock, dense_cost=None):
        self.model = tiny_model("llama")
        self.dense_cost = dense_cost
        accel.prepack(self.model)
        self.input_device = torch.device("cpu")
        self.dtype = torch.float32
        self.cost, self.clock, self.forwards = cost, clock, 0
        self.real = ModelRunner(self.model)

    def new_cache(self):
        return self.real.new_cache()

    def prefill(self, cache, ids):
        return self.real.prefill(cache, ids)

    def forward(self, cache, ids):
        self.forwards += 1
        if self.dense_cost is not None and accel.dense_rows(self.model):
            self.clock.now += self.dense_cost(len(ids))
        else:
            self.clock.now += self.cost(len(ids), accel.min_rows(self.model) > 1)
        return self.real.forward(cache, ids)


class _Clock:
    now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_clock(monkeypatch, tmp_path):
    import speculum.costs

    clock = _Clock()
    monkeypatch.setattr(row_padding.time, "perf_counter", clock)
    monkeypatch.delenv(row_padding.PAD_ENV, raising=False)
    monkeypatch.setattr(speculum.costs, "costs_dir", lambda: tmp_path)  # each test its own cache
    return clock


def test_padding_is_chosen_where_it_measures_faster_and_cached(fake_clock):
    runner = _FakeRunner(lambda width, padded: 0.10 if padded else 0.13 + 0.02 * width, fake_clock)
    choice = row_padding.choose_row_padding(runner)
    assert choice.rows == 4 and accel.min_rows(runner.model) == 4 and not choice.cached
    assert choice.ms == {"1": 150.0, "1 padded": 100.0, "2": 170.0, "2 padded": 100.0, "1 dense": 150.0,
                         "2 dense": 170.0}  # fmt: skip
    assert "padded to 4" in choice.describe()
    timed = runner.forwards
    again = _FakeRunner(lambda width, padded: 1.0, fake_clock)  # same machine key: read, not measured
    accel.set_min_rows(again.model, 1)
    cached = row_padding.choose_row_padding(again)
    assert cached.rows == 4 and cached.cached and again.forwards == 0 and timed > 0
    assert accel.min_rows(again.model) == 4


def test_padding_is_left_off_where_it_does_not_pay_and_env_overrides(fake_clock, monkeypatch):
    runner = _FakeRunner(lambda width, padded: 0.099 if padded else 0.100, fake_clock)  # 1%: under the margin
    choice = row_padding.choose_row_padding(runner)
    assert choice.rows == 1 and accel.min_rows(runner.model) == 1 and "no padding" in choice.describe()
    monkeypatch.setenv(row_padding.PAD_ENV, "on")
    assert row_padding.choose_row_padding(runner).rows == 4 and accel.min_rows(runner.model) == 4
    monkeypatch.setenv(row_padding.PAD_ENV, "dense")
    choice = row_padding.choose_row_padding(runner)
    assert choice.dense_rows == 2 and accel.min_rows(runner.model) == 1 and accel.dense_rows(runner.model) == 2
    monkeypatch.setenv(row_padding.PAD_ENV, "0")
    forwards = runner.forwards
    assert row_padding.choose_row_padding(runner).rows == 1 and accel.min_rows(runner.model) == 1
    assert runner.forwards == forwards  # no override measures
    assert accel.dense_rows(runner.model) == 0


def test_the_stock_kernel_is_chosen_for_small_forwards_where_it_measures_faster(fake_clock, monkeypatch):
    """Where the stock kernel runs one- and two-token forwards faster than the packed one (MKL on an
    AVX-512 Xeon), those run on it over dense copies of the weights; wider forwards stay packed. No
    dense copies are kept where they would not fit in memory, or where they do not pay."""
    runner = _FakeRunner(lambda width, padded: 0.15, fake_clock, dense_cost=lambda width: 0.10)
    choice = row_padding.choose_row_padding(runner)
    assert choice.dense_rows == accel.DENSE_ROWS == accel.dense_rows(runner.model) and choice.rows == 1
    assert "stock kernel" in choice.describe() and choice.ms["1 dense"] == 100.0
    layers = [m for m in runner.model.modules() if isinstance(m, accel.PackedLinear)]
    assert all(m.dense_weight is not None and m.dense_rows == 2 for m in layers)
    assert machine_key_of(runner) != machine_key_of(runner, padding=False)

    slower = _FakeRunner(lambda width, padded: 0.10, fake_clock, dense_cost=lambda width: 0.15)
    monkeypatch.setattr(row_padding, "_padding_path", lambda r: fake_clock_path(r, "slower"))
    choice = row_padding.choose_row_padding(slower)
    assert choice.dense_rows == 0 and accel.dense_rows(slower.model) == 0 and "1 dense" in choice.ms
    assert all(m.dense_weight is None for m in slower.model.modules() if isinstance(m, accel.PackedLinear))

    monkeypatch.setattr(row_padding, "DENSE_MEMORY_SHARE", 0.0)  # no room for the copies: not even measured
    monkeypatch.setattr(row_padding, "_padding_path", lambda r: fake_clock_path(r, "no room"))
    cramped = _FakeRunner(lambda width, padded: 0.15, fake_clock, dense_cost=lambda width: 0.10)
    choice = row_padding.choose_row_padding(cramped)
    assert choice.dense_rows == 0 and "1 dense" not in choice.ms


def machine_key_of(runner, **kw):
    from speculum.costs import machine_key

    return machine_key(runner, **kw)


def fake_clock_path(runner, name):
    import speculum.costs

    return speculum.costs.costs_dir() / f"rows-{name}.json"


def test_dense_small_forwards_give_the_stock_kernels_results():
    """A layer with ``dense_rows=2`` computes 1-2 rows exactly as ``nn.Linear`` does and wider inputs
    on the packed kernel as before; ``set_dense_rows(model, 0)`` drops the copies."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    layer = accel.PackedLinear(linear)
    x = torch.randn(5, 64)
    packed = {rows: layer(x[:rows]) for rows in range(1, 6)}
    model = torch.nn.Sequential(layer)
    assert accel.set_dense_rows(model, 2) == 1 and accel.dense_rows(model) == 2
    for rows in (1, 2):
        assert torch.equal(layer(x[:rows][None]), linear(x[:rows][None]))
    for rows in (3, 4, 5):
        assert torch.equal(layer(x[:rows]), packed[rows])
    assert "dense_rows=2" in repr(layer) and torch.equal(layer.to_linear().weight, linear.weight)
    accel.set_dense_rows(model, 0)
    assert layer.dense_weight is None and torch.equal(layer(x[:1]), packed[1])


def test_methods_stay_exact_with_dense_small_forwards():
    """Plain decoding's one-token steps on the stock kernel, verification of wider drafts packed:
    greedy output still equals plain greedy decoding's (float32), for chains and trees."""
    model = tiny_model("qwen2")
    draft = perturbed_copy(model, 0.4)
    accel.prepack(model)
    accel.prepack(draft)
    accel.set_dense_rows(model, 2)
    accel.set_dense_rows(draft, 2)
    prompt = repetitive_prompt(30, 7, 1)
    plain = generate_ids(model, prompt, build_drafter("autoregressive", draft, VOCAB), 40)[0]
    for method in ["prompt_lookup", "anpd", "draft_model", "lookahead"]:
        ids, stats = generate_ids(model, prompt, build_drafter(method, draft, VOCAB), 40)
        assert ids == plain, method
    assert stats.target_forwards < 40


def test_an_unreadable_padding_cache_is_measured_again(fake_clock):
    runner = _FakeRunner(lambda width, padded: 0.10 if padded else 0.15, fake_clock)
    path = row_padding._padding_path(runner)
    path.write_text("{not json")
    assert row_padding.choose_row_padding(runner).rows == 4 and runner.forwards > 0
    assert row_padding._read_padding(path)["1 padded"] == 100.0  # rewritten whole


def test_padding_measurement_leaves_the_cost_key_apart():
    """The cost model's curve is measured on the padded model: its cache key says so (and an unpadded
    model keeps the key it always had)."""
    from speculum.costs import machine_key

    runner = ModelRunner(tiny_model("llama"))
    accel.prepack(runner.model)
    plain = machine_key(runner)
    accel.set_min_rows(runner.model, 4)
    assert machine_key(runner) != plain
    assert machine_key(runner, padding=False) == plain


def test_load_pads_as_measured_and_says_so(model_dir, monkeypatch):
    import speculum

    monkeypatch.setenv(row_padding.PAD_ENV, "on")
    spec = speculum.load(model_dir)
    assert spec.row_padding.rows == 4 and accel.min_rows(spec.model) == 4
    monkeypatch.setenv(row_padding.PAD_ENV, "off")
    spec = speculum.load(model_dir, prepack=False)
    assert spec.row_padding is None and accel.min_rows(spec.model) == 1
