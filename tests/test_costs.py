"""The measured cost curve (speculum.costs): its cache file, its key, and models with a short context."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculum
from speculum import costs
from speculum.costs import SIZES, CostFileError, CostModel, measured_cost_model
from speculum.runner import ModelRunner

from tiny_models import tiny_config, tiny_model, word_tokenizer

PROMPT = "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3"


@pytest.fixture
def cost_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)  # at rest: verdicts final
    return tmp_path


def doc(points) -> dict:
    return {"format": costs.FORMAT, "version": costs.VERSION, "points": points}


@pytest.mark.parametrize(
    "points",
    [[[1, 0.01]], [], [[1, 0.01], [1, 0.02]], [[0, 0.01], [2, 0.02]], [[1, 0.01], [2, -1.0]], [["a", 0.01]], 7],
)
def test_a_curve_of_fewer_than_two_sizes_or_bad_points_is_refused(points):
    with pytest.raises(CostFileError) as raised:
        CostModel.from_dict(doc(points))
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, speculum.SpeculumError)
    assert CostModel.from_dict(doc([[1, 0.01], [4, 0.02]])).base(2) == pytest.approx(0.01 + 0.01 / 3)


def test_a_cache_file_holding_one_point_is_measured_again(cost_dir):
    runner = ModelRunner(tiny_model("llama"))
    path = cost_dir / f"{costs.machine_key(runner)}.json"
    path.write_text(json.dumps(doc([[1, 0.01]])))
    model = measured_cost_model(runner)
    assert len(model.points) >= 2 and model.base(3) > 0
    assert len(json.loads(path.read_text())["points"]) == len(model.points)  # rewritten whole


def test_the_cost_key_covers_attention_and_the_lazy_head():
    model = tiny_model("llama")
    eager = ModelRunner(model, lazy_head=False)
    key = costs.machine_key(eager)
    assert costs.machine_key(ModelRunner(model, lazy_head=True)) != key
    other = "sdpa" if model.config._attn_implementation != "sdpa" else "eager"
    model.config._attn_implementation = other
    assert costs.machine_key(eager) != key


@pytest.mark.parametrize(
    ("positions", "sizes", "prefix"),
    [(None, list(SIZES), 256), (4096, list(SIZES), 256), (128, list(SIZES), 65), (48, [1, 2, 4, 8, 16], 33)],
)
def test_the_probe_fits_the_context(positions, sizes, prefix):
    ids, kept = costs.fitting(positions, list(range(256)), SIZES)
    assert kept == sizes and len(ids) == prefix and ids == list(range(256))[-prefix:]
    if positions:
        assert len(ids) - 1 + max(kept) <= positions


def short_gpt2(tmp_path, positions: int) -> str:
    config = tiny_config("gpt2")
    config.n_positions = positions
    torch.manual_seed(0)
    path = tmp_path / f"gpt2-{positions}"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("positions", [128, 48])
def test_the_cost_curve_is_measured_within_a_short_learned_context(cost_dir, tmp_path, positions):
    """GPT-2's positions are a table: a probe past it indexed out of range (256 cached tokens and a
    64-node tree on a 128-position model)."""
    spec = speculum.load(short_gpt2(tmp_path, positions))
    model = measured_cost_model(spec.runner)
    assert [n for n, _ in model.points] == [n for n in SIZES if n <= positions // 2]


def test_a_short_context_model_runs_the_default_method_and_auto_controlled(cost_dir, tmp_path):
    spec = speculum.load(short_gpt2(tmp_path, 128))
    plain = spec.generate(PROMPT, "autoregressive", max_new_tokens=40).token_ids
    assert spec.generate(PROMPT, max_new_tokens=40).token_ids == plain  # the default: auto, controlled
    controlled = speculum.SpeculativeConfig("auto", controller=True)
    result = spec.generate(PROMPT, controlled, max_new_tokens=40)
    assert result.token_ids == plain and result.stats.rounds_drafted + result.stats.rounds_plain > 0
