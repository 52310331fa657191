"""dtype="auto" on a CPU: measured per model and machine, cached, explained (speculum.models.dtypes).

Timings here are fake (``_Candidate.step_ms`` replaced) wherever a decision is asserted: real timings are only
run to check that measuring works end to end, never compared.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

import speculum
from speculum import accel, exact, machine, models
from speculum.cli import app
from speculum.models import dtype_probe, dtypes

from tiny_models import tiny_config

PROMPT = "w1 w2 w3 w4 w1 w2 w3"
FAST, SLOW = {1: 1.0, 4: 2.0, 8: 3.0}, {1: 2.0, 4: 4.0, 8: 6.0}  # _blend: 1.0 and 2.0 ms/token


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(dtypes.MEASURE_ENV, raising=False)
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: True)
    # a machine at rest (other jobs on this one would make every verdict provisional): a quiet load
    # average, and no CPU time read while measuring, so that the load average judges alone
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    monkeypatch.setattr(machine, "cpu_time", lambda: None)


@pytest.fixture
def fake_times(monkeypatch):
    """Replace the timing of a step by fixed numbers per dtype; counts the measurements made."""
    state = {"bfloat16": SLOW, "float32": FAST, "exact_cost": 1.0, "measured": 0}
    real_measure = dtype_probe._measure

    def step_ms(candidate, shape):
        times = dict(state["bfloat16" if candidate.dtype is torch.bfloat16 else "float32"])
        if exact.is_exact(candidate.runner.model):  # bfloat16 timed in exact mode costs this much more
            times = {width: ms * state["exact_cost"] for width, ms in times.items()}
        return times

    def counting_measure(config, prepack, exact=False):
        state["measured"] += 1
        return real_measure(config, prepack, exact)

    monkeypatch.setattr(dtype_probe._Candidate, "step_ms", step_ms)
    monkeypatch.setattr(dtype_probe, "_measure", counting_measure)
    return state


def f32_label() -> str:
    return "prepacked float32" if accel.supported(torch.nn.Linear(4, 4)) else "float32"


def no_measuring(*args, **kwargs):
    raise AssertionError("measured")


def cache_files() -> list:
    root = models.cache_dir() / "dtype"
    return sorted(root.glob("*.json")) if root.exists() else []


# ------------------------------------------------------------------------------------------------ the decision


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])
def test_faster_dtype_is_chosen(model_dir, fake_times, faster):
    fake_times["bfloat16"], fake_times["float32"] = (FAST, SLOW) if faster == "bfloat16" else (SLOW, FAST)
    model, _, choice = models.load_with_dtype_choice(model_dir)
    assert model.dtype is getattr(torch, faster) and choice.dtype is model.dtype
    assert choice.measured and not choice.cached and choice.requested == "auto"
    label = f32_label()
    expected = {label: 1.0, "bfloat16": 2.0} if faster == "float32" else {label: 2.0, "bfloat16": 1.0}
    assert choice.ms_per_token == expected
    assert (
        choice.reason
        == f"auto: {label} {expected[label]:g} ms/token vs bfloat16 {expected['bfloat16']:g} ms/token on this CPU"
    )
    assert choice.describe().startswith(f"{faster} (auto: {label} ")


@pytest.mark.parametrize("bf16_share", [0.99, 0.89, 0.80])
def test_bfloat16_must_win_clearly(model_dir, fake_times, bf16_share):
    """bfloat16 predicted 1% or 11% faster (Gemma 3 270M on an AVX-512-BF16 EPYC, where end to end it
    ran slower) keeps float32; 20% faster chooses bfloat16."""
    fake_times["float32"] = FAST
    fake_times["bfloat16"] = {k: v * bf16_share for k, v in FAST.items()}
    _, _, choice = models.load_with_dtype_choice(model_dir)
    if bf16_share < 1 - dtypes._FLOAT32_MARGIN:
        assert choice.dtype is torch.bfloat16 and "kept" not in choice.reason
    else:
        assert choice.dtype is torch.float32 and "(within 15%: float32 kept)" in choice.reason


def test_bfloat16_is_priced_in_exact_mode_where_it_would_run_so(model_dir, fake_times, monkeypatch):
    """exact="auto" (load's default) turns exact mode on in bfloat16, so bfloat16 is timed with exact
    mode's cost: where that cost eats bfloat16's lead, float32 (exact without it) is chosen."""
    fake_times["float32"] = FAST
    fake_times["bfloat16"] = {k: v * 0.7 for k, v in FAST.items()}  # 30% faster than float32 ...
    fake_times["exact_cost"] = 1.3  # ... but 9% slower in exact mode
    _, _, plain = models.load_with_dtype_choice(model_dir)  # exact not asked: bfloat16 as it is
    assert plain.dtype is torch.bfloat16 and plain.ms_per_token["bfloat16"] == pytest.approx(0.7)
    model, _, priced = models.load_with_dtype_choice(model_dir, exact="auto")
    assert fake_times["measured"] == 2  # a verdict of its own, cached apart from the plain one
    assert model.dtype is torch.float32 and priced.dtype is torch.float32
    assert priced.ms_per_token["bfloat16"] == pytest.approx(0.91)
    assert "vs bfloat16 in exact mode 0.91 ms/token" in priced.reason
    assert len(cache_files()) == 2
    assert models.load_with_dtype_choice(model_dir, exact=True)[2].cached  # True and "auto" time alike
    fake_times["exact_cost"] = 1.05  # cheap exactness: bfloat16 still wins clearly
    monkeypatch.setenv(dtypes.MEASURE_ENV, "refresh")
    spec = speculum.load(model_dir)  # exact="auto" by default
    assert spec.dtype_choice.dtype is torch.bfloat16 and spec.exact.enabled
    assert "in exact mode" in spec.dtype_choice.reason
    assert fake_times["measured"] == 3


def test_float32_that_would_not_fit_in_memory_gives_bfloat16(model_dir, fake_times, monkeypatch):
    config = tiny_config("llama")
    need = 4 * (
        config.num_hidden_layers * dtype_probe._layer_params(config) + 2 * config.vocab_size * config.hidden_size
    )
    monkeypatch.setattr(dtypes, "_available_memory", lambda: int(need / dtypes._MEMORY_SHARE) + 1)
    assert models.choose_dtype("auto", "cpu", config).dtype is torch.float32  # fits
    monkeypatch.setattr(dtypes, "_available_memory", lambda: need)
    choice = models.choose_dtype("auto", "cpu", config)
    assert choice.dtype is torch.bfloat16 and "free memory: bfloat16" in choice.reason
    assert fake_times["measured"] == 1  # the timings stay cached; free memory is checked on every load
    monkeypatch.setattr(dtypes, "_available_memory", lambda: None)
    assert models.choose_dtype("auto", "cpu", config).dtype is torch.float32


def test_prepack_off_times_stock_float32(model_dir, fake_times):
    _, _, choice = models.load_with_dtype_choice(model_dir, prepack=False)
    assert set(choice.ms_per_token) == {"float32", "bfloat16"}


def test_cpu_without_native_bf16_gives_float32_without_measuring(model_dir, monkeypatch):
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(dtype_probe, "_measure", no_measuring)
    model, _, choice = models.load_with_dtype_choice(model_dir)
    assert model.dtype is torch.float32 and choice.dtype is torch.float32
    assert not choice.measured and "no native bfloat16" in choice.reason
    assert cache_files() == []


def test_explicit_dtypes_untouched(model_dir, monkeypatch):
    monkeypatch.setattr(dtype_probe, "_measure", no_measuring)
    for asked, expected in [("float32", torch.float32), ("bf16", torch.bfloat16), (torch.float16, torch.float16)]:
        model, _, choice = models.load_with_dtype_choice(model_dir, dtype=asked)
        assert model.dtype is expected and choice.dtype is expected
        assert choice.reason == "asked for" and not choice.measured
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    assert models.choose_dtype("bfloat16").dtype is torch.bfloat16
    with pytest.raises(speculum.InvalidInputError, match="dtype"):
        models.choose_dtype("int8")
    assert cache_files() == []


def test_cuda_auto_unchanged(monkeypatch):
    monkeypatch.setattr(dtype_probe, "_measure", no_measuring)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    choice = models.choose_dtype("auto", "cuda:0", tiny_config("llama"))
    assert choice.dtype is torch.float16 and "no bfloat16" in choice.reason
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert models.choose_dtype("auto", "cuda", tiny_config("llama")).dtype is torch.bfloat16


def test_measuring_can_be_switched_off(model_dir, monkeypatch):
    monkeypatch.setenv(dtypes.MEASURE_ENV, "0")
    monkeypatch.setattr(dtype_probe, "_measure", no_measuring)
    model, _, choice = models.load_with_dtype_choice(model_dir)
    assert model.dtype is torch.bfloat16 and not choice.measured  # the CPU-flag rule
    assert f"{dtypes.MEASURE_ENV}=0" in choice.reason
    # a device map: no measuring either (accelerate's hooks keep weights from being prepacked)
    monkeypatch.delenv(dtypes.MEASURE_ENV)
    assert models.choose_dtype("auto", "cpu", tiny_config("llama"), measure=False).dtype is torch.bfloat16


def test_failed_measurement_falls_back_on_the_flag_rule(model_dir, monkeypatch, caplog):
    def broken(candidate, record=True):
        raise RuntimeError("no oneDNN today")

    monkeypatch.setattr(dtype_probe._Candidate, "time_round", broken)
    with caplog.at_level(logging.WARNING, logger="speculum"):
        model, _, choice = models.load_with_dtype_choice(model_dir)
    assert model.dtype is torch.bfloat16 and "measuring failed" in choice.reason
    assert "no oneDNN today" in caplog.text
    assert cache_files() == []  # nothing remembered: the next load tries again


# ------------------------------------------------------------------------------------------------ the cache


def test_decision_is_cached_and_reused(model_dir, fake_times, caplog):
    with caplog.at_level(logging.INFO, logger="speculum"):
        _, _, first = models.load_with_dtype_choice(model_dir)
    assert fake_times["measured"] == 1 and not first.cached and first.seconds > 0
    assert "dtype float32 (auto:" in caplog.text and "measured in" in caplog.text
    (path,) = cache_files()
    data = json.loads(path.read_text())
    assert data["ms_per_token"] == first.ms_per_token and data["inputs"]["threads"] == torch.get_num_threads()
    fake_times["bfloat16"] = {k: v / 10 for k, v in FAST.items()}  # would now win, if measured again
    model, _, second = models.load_with_dtype_choice(model_dir)
    assert fake_times["measured"] == 1  # not measured again
    assert second.cached and second.dtype is torch.float32 is model.dtype
    assert second.ms_per_token == first.ms_per_token and second.describe().endswith("measured earlier, cached)")


def test_refresh_measures_again(model_dir, fake_times, monkeypatch):
    models.load_with_dtype_choice(model_dir)
    fake_times["bfloat16"], fake_times["float32"] = FAST, SLOW
    monkeypatch.setenv(dtypes.MEASURE_ENV, "refresh")
    model, _, choice = models.load_with_dtype_choice(model_dir)
    assert fake_times["measured"] == 2 and not choice.cached and model.dtype is torch.bfloat16
    monkeypatch.delenv(dtypes.MEASURE_ENV)
    assert models.load_with_dtype_choice(model_dir)[2].dtype is torch.bfloat16  # the new decision is kept
    assert fake_times["measured"] == 2


def test_thread_count_or_model_shape_change_the_key(model_dir, fake_times, tmp_path):
    models.load_with_dtype_choice(model_dir)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        models.load_with_dtype_choice(model_dir)
    finally:
        torch.set_num_threads(threads)
    assert fake_times["measured"] == 2 and len(cache_files()) == 2
    # another shape of the same architecture: measured again
    other = tiny_config("llama")
    other.intermediate_size *= 2
    models.choose_dtype("auto", "cpu", other)
    assert fake_times["measured"] == 3 and len(cache_files()) == 3
    models.choose_dtype("auto", "cpu", other)
    assert fake_times["measured"] == 3  # the same one: cached


def test_cache_key_covers_cpu_software_and_shape(monkeypatch):
    config = tiny_config("llama")
    key, inputs = dtype_probe.cache_key(config, True)
    assert dtype_probe.cache_key(tiny_config("llama"), True)[0] == key  # deterministic
    assert dtype_probe.cache_key(config, False)[0] != key
    assert dtype_probe.cache_key(tiny_config("qwen2"), True)[0] != key
    wider = tiny_config("llama")
    wider.hidden_size = 64
    assert dtype_probe.cache_key(wider, True)[0] != key
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert dtype_probe.cache_key(config, True)[0] != key
    monkeypatch.undo()
    monkeypatch.setattr(machine, "cpu_identity", lambda: {**inputs["cpu"], "name": "Another CPU"})
    assert dtype_probe.cache_key(config, True)[0] != key
    monkeypatch.setattr(machine, "cpu_identity", lambda: {**inputs["cpu"], "flags": "0" * 16})
    assert dtype_probe.cache_key(config, True)[0] != key


@pytest.mark.parametrize(
    "content",
    [
        "{ not json",
        "",
        '["a list"]',
        '{"version": 1, "key": "another", "ms_per_token": {"float32": 1, "bfloat16": 2}}',
        "KEY:" + json.dumps({"float32": -1.0, "bfloat16": 2.0}),
        "KEY:" + json.dumps({"float32": "fast", "bfloat16": 2.0}),
        "KEY:" + json.dumps({"float32": 1.0}),
    ],
)
def test_corrupt_cache_is_ignored_and_rewritten(model_dir, fake_times, content):
    _, _, first = models.load_with_dtype_choice(model_dir)
    (path,) = cache_files()
    if content.startswith("KEY:"):
        data = json.loads(path.read_text())
        data["ms_per_token"] = json.loads(content[4:])
        content = json.dumps(data)
    path.write_text(content)
    model, _, again = models.load_with_dtype_choice(model_dir)
    assert fake_times["measured"] == 2 and not again.cached and again.dtype is first.dtype is model.dtype
    assert json.loads(path.read_text())["ms_per_token"] == first.ms_per_token  # rewritten, whole
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_cache_still_chooses(model_dir, fake_times, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECULUM_CACHE", str(blocker))
    _, _, choice = models.load_with_dtype_choice(model_dir)
    assert choice.dtype is torch.float32 and fake_times["measured"] == 1


# ------------------------------------------------------------------------------------------------ real measuring


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_real_measurement_runs_on_tiny_models(arch):
    """The real timing path end to end (no assertion on the numbers), leaving torch's RNG alone."""
    rng = torch.get_rng_state()
    choice = models.choose_dtype("auto", "cpu", tiny_config(arch))
    assert torch.equal(torch.get_rng_state(), rng)
    assert choice.dtype in (torch.float32, torch.bfloat16) and choice.measured and choice.seconds > 0
    assert set(choice.ms_per_token) == {f32_label(), "bfloat16"}
    assert all(ms > 0 for ms in choice.ms_per_token.values())


def test_crowded_cpu_cuts_repetitions(monkeypatch):
    rounds = []
    real = dtype_probe._Candidate.time_round

    def counting(candidate, record=True):
        rounds.append(record)
        return real(candidate, record)

    monkeypatch.setattr(dtype_probe._Candidate, "time_round", counting)
    monkeypatch.setattr(dtype_probe, "_BUDGET_S", 0.0)  # over budget at once: one recorded round after the warm-up
    assert models.choose_dtype("auto", "cpu", tiny_config("llama")).measured
    assert rounds == [False, False, True, True]
    rounds.clear()
    monkeypatch.setattr(dtype_probe, "_BUDGET_S", 1e9)
    models.choose_dtype("auto", "cpu", tiny_config("qwen2"))
    assert rounds == [False, False] + [True] * 2 * dtype_probe._REPS


def test_stack_sizes_and_slices(monkeypatch):
    config = tiny_config("llama")
    config.num_hidden_layers = 8
    full = dtype_probe._layer_params(config)
    stack, layers = dtype_probe._build_stack(config)  # tiny layers: all of them are timed together
    assert layers == 8.0 and stack.config.num_hidden_layers == 8 and stack.config.vocab_size == dtype_probe._SMALL_VOCAB
    monkeypatch.setattr(dtype_probe, "_STACK_MIN_BYTES", 4 * full * 3 - 1)
    assert dtype_probe._build_stack(config)[1] == 3.0  # 3 layers hold the least bytes to time
    monkeypatch.setattr(dtype_probe, "_STACK_MAX_BYTES", 4 * full // 2)  # one layer is too big: half of one
    stack, layers = dtype_probe._build_stack(config)
    assert stack.config.num_hidden_layers == 1 and 0.3 < layers < 0.7
    timed = sum(p.numel() for p in stack.model.layers.parameters())
    assert layers == pytest.approx(timed / full)
    assert stack.config.intermediate_size < config.intermediate_size
    assert stack.config.head_dim == config.hidden_size // config.num_attention_heads  # heads kept whole
    choice = models.choose_dtype("auto", "cpu", config)  # and it measures
    assert choice.measured


def test_head_is_sliced_for_big_vocabularies(monkeypatch):
    seen = []
    real = dtype_probe._Candidate.step_ms

    def spy(candidate, shape):
        seen.append((candidate.head.out_features, shape.head_rows))
        return real(candidate, shape)

    monkeypatch.setattr(dtype_probe._Candidate, "step_ms", spy)
    monkeypatch.setattr(dtype_probe, "_HEAD_MAX_WEIGHTS", 32 * 16)  # 16 rows of a 32-wide head
    assert models.choose_dtype("auto", "cpu", tiny_config("llama", vocab_size=64)).measured
    assert seen == [(16, 4.0), (16, 4.0)]  # both candidates: 64 rows timed as 16, scaled by 4


def test_step_prediction_scales_layers_and_head():
    """Whole-model step = runner overhead once + layers x (model layers / stack layers) + head x slices."""
    candidate = dtype_probe._Candidate.__new__(dtype_probe._Candidate)
    candidate.runner = type("R", (), {"lazy_head": False})()
    candidate.total = {1: 0.010, 4: 0.012, 8: 0.014}
    candidate.layers = {1: 0.008, 4: 0.010, 8: 0.012}
    candidate.head_best = {1: 0.001, 4: 0.002, 8: 0.003}
    shape = dtype_probe._Shape(layers=10.0, head_rows=2.0, hidden=32)
    assert candidate.step_ms(shape) == pytest.approx({1: 84.0, 4: 106.0, 8: 128.0})
    candidate.runner.lazy_head = True  # one head row per committed token: 1, 2 and 3
    candidate.head_best = {1: 0.001}
    assert candidate.step_ms(shape) == pytest.approx({1: 84.0, 4: 106.0, 8: 128.0})
    assert dtype_probe._blend({1: 84.0, 4: 106.0, 8: 128.0}) == pytest.approx(0.5 * 84 + 0.25 * 53 + 0.25 * 128 / 3)


# ------------------------------------------------------------------------------------------------ surfaces


def test_load_sets_dtype_choice_and_the_draft_follows(model_dir, fake_times):
    fake_times["bfloat16"], fake_times["float32"] = FAST, SLOW
    spec = speculum.load(model_dir, draft=model_dir)
    assert spec.dtype_choice.dtype is torch.bfloat16 is spec.model.dtype
    assert spec.draft_model.dtype is torch.bfloat16  # measured once, for the target
    assert fake_times["measured"] == 1
    explicit = speculum.load(model_dir, dtype="float32")
    assert explicit.dtype_choice.reason == "asked for" and explicit.dtype_choice.dtype is torch.float32


def test_cli_generate_stats_prints_the_dtype_line(model_dir, fake_times):
    args = ["generate", PROMPT, "--model", model_dir, "--method", "anpd", "--max-new-tokens", "4", "--no-stream"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    line = f"dtype: float32 (auto: {f32_label()} 1 ms/token vs bfloat16 in exact mode 2 ms/token on this CPU, measured"
    assert f"{line} in " in result.output
    result = CliRunner().invoke(app, args)  # cached now
    assert f"{line} earlier, cached)" in result.output
    result = CliRunner().invoke(app, [*args, "--dtype", "bfloat16"])
    assert "dtype: bfloat16 (asked for)" in result.output
    result = CliRunner().invoke(app, [*args, "--no-stats"])
    assert "dtype:" not in result.output
