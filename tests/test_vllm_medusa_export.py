"""``speculum export vllm-medusa``: the exported checkpoint, read back with plain torch into vLLM's
Medusa forward (re-implemented here from vllm/model_executor/models/medusa.py), gives the logits
speculum's heads give; bad input ends in exit code 2 and leaves nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from speculum.cli import app
from speculum.heads import MedusaHeads, load_draft_head, save_draft_head

from helpers import save_random_heads
from tiny_models import VOCAB, tiny_model, word_tokenizer

runner = CliRunner()


def _target(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _heads(target, path, draft_vocab, num_layers=2, seed=0) -> str:
    torch.manual_seed(seed)
    heads = MedusaHeads(target.config.hidden_size, 3, draft_vocab, num_layers=num_layers)
    for p in heads.parameters():  # (residual blocks start at zero)
        torch.nn.init.normal_(p, std=0.3)
    save_draft_head(heads, path, target)
    return str(path)


def vllm_medusa_logits(out: Path, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa on ``hidden [N, H]``: ``[N, heads, vocab]`` (-inf outside a token_map)."""
    config = json.loads((out / "config.json").read_text())
    weights = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert config["model_type"] == "medusa" and config["original_lm_head"] and config["medusa_fc_bias"]
    lm_head = weights["lm_heads.0.weight"]
    assert lm_head.shape == (config["truncated_vocab_size"], config["hidden_size"])
    token_map = weights.get("token_map")
    assert (token_map is not None) == (config["truncated_vocab_size"] < config["vocab_size"])
    logits = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):  # ResidualBlock: x + SiLU(Linear(x)) per layer
            layer = f"blocks.{i}.layers.{j}"
            x = x + torch.nn.functional.silu(x @ weights[f"{layer}.weight"].T + weights[f"{layer}.bias"])
        head = x @ lm_head.T
        if token_map is not None:
            full = torch.full((*head.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., token_map] = head
            head = full
        logits.append(head)
    return torch.stack(logits, dim=1)


def speculum_logits(heads_dir: str, target, hidden: torch.Tensor) -> torch.Tensor:
    """speculum's heads on ``hidden``, scattered from the draft vocabulary into the whole one."""
    heads = load_draft_head(heads_dir, "medusa", target)
    with torch.no_grad():
        draft = heads(hidden)
    full = torch.full((*draft.shape[:-1], VOCAB), -torch.inf)
    full[..., heads.projection.draft_vocab] = draft
    return full


@pytest.mark.parametrize("vocab", ["reduced", "whole, reordered"])
def test_exported_heads_give_speculums_logits(model_dir, tmp_path, vocab):
    target = _target(model_dir)
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    heads_dir = _heads(target, tmp_path / "heads", order[:40] if vocab == "reduced" else order)
    out = tmp_path / "vllm-medusa"
    done = runner.invoke(app, ["export", "vllm-medusa", heads_dir, str(out), "--model", model_dir])
    assert done.exit_code == 0, done.output
    assert "--speculative-config" in done.output and '"method": "medusa"' in done.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
    hidden = torch.randn(16, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    ours, theirs = speculum_logits(heads_dir, target, hidden), vllm_medusa_logits(out, hidden)
    assert torch.allclose(theirs, ours, atol=1e-5)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))  # vLLM drafts each head's top-1


def test_export_refuses_bad_input_with_exit_2(model_dir, tmp_path):
    target = _target(model_dir)
    heads_dir = _heads(target, tmp_path / "heads", torch.arange(VOCAB))
    ctc_dir = save_random_heads("ctc", target, tmp_path / "ctc")
    other = tmp_path / "other-model"
    tiny_model("llama", seed=5).save_pretrained(other)
    word_tokenizer().save_pretrained(other)
    not_heads = tmp_path / "empty"
    not_heads.mkdir()
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], "not a directory of Medusa heads"),
        ([str(not_heads), str(tmp_path / "o2")], "not a draft-head checkpoint"),
        ([ctc_dir, str(tmp_path / "o3")], "holds 'ctc' heads"),
        ([heads_dir, str(tmp_path / "o4"), "--model", str(other)], "another model"),
    ]
    for args, message in cases:
        done = runner.invoke(app, ["export", "vllm-medusa", *args, *(["--model", model_dir] * ("--model" not in args))])
        assert done.exit_code == 2, (args, done.output)
        assert message in " ".join(done.output.split()), done.output
        assert not Path(args[1]).exists()

    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    done = runner.invoke(app, ["export", "vllm-medusa", heads_dir, str(out), "--model", model_dir])
    assert done.exit_code == 2 and "not empty" in done.output
    assert (out / "keep.txt").read_text() == "mine"
    done = runner.invoke(app, ["export", "vllm-medusa", heads_dir, str(out), "--model", model_dir, "--force"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
