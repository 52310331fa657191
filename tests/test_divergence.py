"""The divergence tool names the first module whose output parts from plain decoding's, per layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama import modeling_llama
from typer.testing import CliRunner

from speculum.cli import app
from speculum.errors import InvalidInputError
from speculum.models.divergence import find_divergence

from tiny_models import repetitive_prompt, tiny_model

# float64, every linear computed one row at a time and attention one query at a time over exactly the
# keys it sees: on this model a verification chain's and a batch row's position compute bit for bit
# what plain decoding does, so anything the tool reports there was planted by the test
AGREEING = ("chain", "batch")
EAGER_ATTENTION = modeling_llama.eager_attention_forward
PROMPT = repetitive_prompt(12)


class RowByRowLinear(nn.Linear):
    """A linear layer whose kernel never sees more than one row: batch-invariant by construction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = [nn.functional.linear(flat[i : i + 1], self.weight, self.bias) for i in range(flat.shape[0])]
        return torch.cat(rows).reshape(*x.shape[:-1], -1)


def query_by_query_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager attention for one query at a time, over only the keys its mask lets it see: the
    same call whatever the other queries, rows and masked columns (a kernel's summation order can
    depend on those; on the Xeon with AMX measured here it does, even in float64)."""
    rows, _, queries, _ = query.shape
    out = query.new_empty(rows, queries, query.shape[1], query.shape[3])
    for b in range(rows):
        for i in range(queries):
            seen = slice(None) if attention_mask is None else (attention_mask[b, 0, i] == 0).nonzero()[:, 0]
            q, k, v = query[b : b + 1, :, i : i + 1], key[b : b + 1, :, seen], value[b : b + 1, :, seen]
            one, _ = EAGER_ATTENTION(module, q, k, v, None, scaling)
            out[b, i] = one[0, 0]
    return out, None


@pytest.fixture
def agreeing_model(monkeypatch):
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", query_by_query_attention)
    model = tiny_model("llama", dtype=torch.float64)
    model.config._attn_implementation = "eager"
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowByRowLinear
    return model


def diverge(model, **kwargs):
    kwargs = dict(draft_tokens=3, batch=3, row=1, layouts=AGREEING) | kwargs
    return {r.layout: r for r in find_divergence(model, PROMPT, **kwargs).layouts}


def test_agreeing_layouts_report_nothing(agreeing_model):
    for result in diverge(agreeing_model).values():
        assert result.first is None, (result.layout, result.first)
        assert result.logits_max_abs == 0 and result.argmax_equal


def test_a_module_that_parts_on_several_rows_is_named_first(agreeing_model):
    # layer 1's up_proj rounds differently as soon as its call has more than one row
    target = "model.layers.1.mlp.up_proj"

    def perturb(module, args, output):
        return output * (1 + 1e-12) if args[0].numel() // args[0].shape[-1] > 1 else output

    agreeing_model.get_submodule(target).register_forward_hook(perturb)
    results = diverge(agreeing_model)
    for layout in AGREEING:
        first = results[layout].first
        assert first is not None and first.name == target, (layout, first)
        assert first.kind == "RowByRowLinear" and first.input_equal is True
        assert first.reference_shape.startswith("1 rows") and not first.shape.startswith("1 rows")
        assert results[layout].origins[0].name == target


def test_a_later_draft_node_is_compared_with_its_own_plain_step(agreeing_model):
    # (not in a batch: there the row's eager softmax, in float32, runs over the longer rows' columns too)
    assert diverge(agreeing_model, node=2, layouts=("chain",))["chain"].first is None


def perturb_rows(model, name: str, rows):
    """Perturb ``name``'s output in the batch rows ``rows(batch_size)`` picks, in forwards over a batch."""

    def hook(module, args, output):
        if output.shape[0] < 2:
            return output
        output = output.clone()
        for r in rows(output.shape[0]):
            output[r] += 0.5
        return output

    model.get_submodule(name).register_forward_hook(hook)


def test_the_batch_row_compared_is_the_prompts_own(agreeing_model):
    target = "model.layers.0.self_attn.q_proj"
    perturb_rows(agreeing_model, target, lambda size: [r for r in range(size) if r != 1])
    assert diverge(agreeing_model, layouts=("batch",))["batch"].first is None


def test_the_perturbed_batch_row_is_caught(agreeing_model):
    target = "model.layers.0.self_attn.q_proj"
    perturb_rows(agreeing_model, target, lambda size: [1])
    first = diverge(agreeing_model, layouts=("batch",))["batch"].first
    assert first is not None and first.name == target and first.max_abs == pytest.approx(0.5)


def test_the_tree_node_compared_is_the_chains(agreeing_model):
    # perturb every tree node but the compared one (the root): a wrong pick would report q_proj
    target = "model.layers.0.self_attn.q_proj"

    def hook(module, args, output):
        if output.shape[1] < 2:
            return output
        output = output.clone()
        output[:, 1:] += 0.5
        return output

    agreeing_model.get_submodule(target).register_forward_hook(hook)
    tree = find_divergence(agreeing_model, PROMPT, draft_tokens=2, batch=1, layouts=("tree",)).layouts[0]
    assert all(d.name != target for d in tree.differences)


@pytest.mark.parametrize(
    "kwargs",
    [dict(draft_tokens=0), dict(node=5), dict(batch=2, row=2), dict(layouts=("sideways",)), dict(draft=[1])],
)
def test_bad_input(kwargs):
    with pytest.raises(InvalidInputError):
        find_divergence(tiny_model("llama"), PROMPT, **kwargs)


def test_gpt2_and_gemma3_shapes_are_picked():
    # Conv1D linears, q/k norms over [rows, heads, tokens, head_dim], sliding-window masks
    for arch in ("gpt2", "gemma3"):
        report = find_divergence(tiny_model(arch), PROMPT, draft_tokens=2, batch=2, row=1)
        assert [r.layout for r in report.layouts] == ["chain", "tree", "batch", "batch-chain"]
        assert all(r.argmax_equal for r in report.layouts)


runner = CliRunner()


def test_cli_table(model_dir):
    result = runner.invoke(
        app,
        ["diagnose", "divergence", "--model", model_dir, "--prompt-ids", "3,4,5,6,3,4,5,6", "--dtype", "float32"],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    for layout in ("chain", "tree", "batch", "batch-chain"):
        assert layout in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--batch", "0"],
        ["--row", "4"],
        ["--node", "9"],
        ["--draft-tokens", "0"],
        ["--prompt-ids", "3,x"],
        ["--prompt-ids", "9999"],
        ["--prompt", " "],
        ["--other", "w3 w4"],
    ],
)
def test_cli_bad_input_exit_2(args, model_dir):
    result = runner.invoke(app, ["diagnose", "divergence", "--model", model_dir, "--dtype", "float32", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "error" in result.output.lower()
