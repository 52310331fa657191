"""speculum train acceptance-head: texts, labels, token mixing, the loss, training, resume, the CLI."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import speculum
from speculum.cli import app
from speculum.errors import InvalidInputError
from speculum.heads.acceptance import AcceptanceHead
from speculum.sampling import SamplingParams, warp
from speculum.training.acceptance import (
    DataSettings,
    TrainSettings,
    load_or_make_data,
    make_data,
    train_head,
    weighted_bce,
)
from speculum.training.texts import TrainingText, encode, training_texts

from tiny_models import perturbed_copy, tiny_model, word_tokenizer

TEXT = "w3 w4 w5 w6 w7 w3 w4 w5 w6 w7 w9 w8 w7 w3 w4 w5 w6 w2 w11 w12 w13 w3 w4 w5"


@pytest.fixture(scope="module")
def spec():
    target = tiny_model("llama")
    draft = perturbed_copy(target, scale=0.6)
    return speculum.Speculum(target, word_tokenizer(), draft, word_tokenizer(), name="tiny", draft_name="perturbed")


def test_training_texts_names_slices_and_paths(tmp_path):
    assert len(training_texts("gsm8k[100:]")) == 560 and len(training_texts("mbpp[200:450]")) == 250
    with pytest.raises(InvalidInputError, match=r"wmt16\[100:400\]: wmt16 has 200 texts"):
        training_texts("wmt16[100:400]")  # a slice past the end is refused, not quietly shortened
    mbpp = training_texts(["mbpp[:3]"])
    assert len(mbpp) == 3 and mbpp[0].instruction and "def " in mbpp[0].response
    assert len(training_texts("wmt16[10:20],humaneval[:2]")) == 12
    assert training_texts("stdlib[:2]")[0].source.startswith("stdlib/")
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "q.jsonl").write_text(json.dumps({"turns": ["one", "two"]}) + "\n")
    assert [t.response for t in training_texts([str(tmp_path / "a.txt")])] == [TEXT]
    assert training_texts(str(tmp_path / "q.jsonl"))[0].response == "one\n\ntwo"
    assert len(training_texts([str(tmp_path)])) == 1  # a directory: its text files
    with pytest.raises(InvalidInputError, match="unknown text source"):
        training_texts("nonsense")
    with pytest.raises(InvalidInputError, match="no text"):
        training_texts("mbpp[5:5]")


def test_the_vendored_chat_questions_are_chat_prompts_apart_from_mt_bench():
    """benchmarks/data's questions (written by the Qwen target, issue #20) load as a prompt set of
    MT-bench's eight kinds, laid out as chat, and hold none of MT-bench's own questions."""
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "data" / "qwen2.5-coder-1.5b-chat-questions.jsonl"
    texts = training_texts(str(path))
    assert len(texts) >= 150 and all(t.prompt is not None and t.prompt.chat_default for t in texts)
    assert {t.prompt.category for t in texts} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    }  # fmt: skip
    mt_bench = {t.response.split("\n\n")[0].strip() for t in training_texts("mt_bench")}
    assert not mt_bench & {t.response.strip() for t in texts}
    assert len({t.response for t in texts}) >= 150  # greedy answers: a few pairs gave the same question


def test_encode_marks_where_the_response_starts():
    tok = word_tokenizer()
    ids, start = encode(tok, TrainingText("t", "w1 w2", "w3 w4 w5"), 64)
    assert tok.convert_ids_to_tokens(ids[start:]) == ["w3", "w4", "w5"]
    ids, start = encode(tok, TrainingText("t", "w1 w2", "w3 w4 w5"), start + 1)
    assert len(ids) == start + 1  # cut to max_tokens, the response start kept


@torch.no_grad()
def test_greedy_labels_are_argmax_agreement(spec):
    """No mixing: one row per response position, label 1 exactly where the draft's argmax is the target's."""
    text = TrainingText("t", "", TEXT)
    data = make_data(spec, [text], DataSettings(mixing_ratio=0.0), progress=False)
    ids, start = encode(spec.tokenizer, text, 512)
    x = torch.tensor([ids])
    agree = spec.model(x).logits[0].argmax(-1) == spec.draft_model(x).logits[0].argmax(-1)
    expected = agree[max(start, 1) - 1 : len(ids) - 1].float()
    assert torch.equal(data["label"], expected)
    assert 0 < float(expected.mean()) < 1  # the draft is right only sometimes: the labels say something
    assert data["hidden"].shape == (len(expected), spec.draft_model.config.hidden_size)


@torch.no_grad()
@pytest.mark.parametrize("mixing_ratio", [0.0, 0.5])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_early_rows_hold_the_state_that_produced_the_candidate(spec, temperature, mixing_ratio):
    """An early head scores each candidate from the draft's state that produced it: through the draft's
    LM head that state gives the row's candidate (greedy: as its argmax) with the row's confidence."""
    sampling = SamplingParams(temperature)
    data = make_data(
        spec, [TrainingText("t", "", TEXT)], DataSettings(temperature=temperature, mixing_ratio=mixing_ratio), False
    )
    logits = spec.draft_model.lm_head(data["hidden_before"].float())  # states are stored in float16
    probs = torch.softmax(logits, -1) if sampling.greedy else warp(logits, sampling)
    candidate = data["candidate"].long()
    assert torch.allclose(probs.gather(1, candidate[:, None])[:, 0], data["confidence"], atol=2e-3)
    if sampling.greedy:
        top2 = logits.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-2  # where float16 rounding cannot swap the argmax
        assert int(clear.sum()) > len(clear) // 2
        assert torch.equal(probs.argmax(-1)[clear], candidate[clear])


@torch.no_grad()
def test_sampled_labels_are_acceptance_probabilities(spec):
    """A draft identical to the target is always accepted: min(1, p/q) = 1 at any temperature."""
    same = speculum.Speculum(spec.model, spec.tokenizer, spec.model, spec.tokenizer)
    data = make_data(same, [TrainingText("t", "", TEXT)], DataSettings(temperature=0.7, mixing_ratio=0.0), False)
    assert torch.allclose(data["label"], torch.ones_like(data["label"]))
    soft = make_data(spec, [TrainingText("t", "", TEXT)], DataSettings(temperature=1.0, mixing_ratio=0.0), False)
    assert bool(((soft["label"] > 0) & (soft["label"] <= 1)).all()) and float(soft["label"].min()) < 1


def test_token_mixing_drops_target_positions(spec):
    text = [TrainingText("t", "", TEXT)]
    full = make_data(spec, text, DataSettings(mixing_ratio=0.0), False)
    mixed = make_data(spec, text, DataSettings(mixing_ratio=0.5, seed=3), False)
    again = make_data(spec, text, DataSettings(mixing_ratio=0.5, seed=3), False)
    assert 0 < len(mixed["label"]) < len(full["label"])
    assert torch.equal(mixed["hidden"], again["hidden"])  # seeded


def test_data_cache_is_reused_and_keyed(spec, tmp_path):
    texts = [TrainingText("t", "", TEXT)]
    first, cached = load_or_make_data(spec, texts, DataSettings(), tmp_path / "d.safetensors", progress=False)
    assert not cached
    second, cached = load_or_make_data(spec, texts, DataSettings(), tmp_path / "d.safetensors", progress=False)
    assert cached and torch.equal(first["label"], second["label"])
    _, cached = load_or_make_data(spec, texts, DataSettings(seed=9), tmp_path / "d.safetensors", progress=False)
    assert not cached  # other settings: remade


def test_weighted_bce_by_hand():
    zero = torch.zeros(2)
    assert float(weighted_bce(zero, torch.tensor([1.0, 0.0]), 6.0)) == pytest.approx(math.log(2))
    z = torch.tensor([2.0, 2.0])
    value = (math.log1p(math.exp(-2)) + 6 * math.log1p(math.exp(2))) / 7
    assert float(weighted_bce(z, torch.tensor([1.0, 0.0]), 6.0)) == pytest.approx(value, rel=1e-5)
    soft = float(weighted_bce(torch.zeros(1), torch.tensor([0.25]), 2.0))
    assert soft == pytest.approx((0.25 * math.log(2) + 2 * 0.75 * math.log(2)) / (0.25 + 1.5))


def _toy_data(n=2000, hidden=8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=gen)
    confidence = torch.rand(n, generator=gen)
    before = torch.randn(n, hidden, generator=gen).half()
    return {"hidden": x.half(), "label": (x[:, 0] + 0.5 * x[:, 1] > 0).float(), "confidence": confidence,
            "hidden_before": before,
            "text": torch.arange(n) // 20}  # fmt: skip


def test_the_confidence_input_is_learned(tmp_path):
    """A label only the draft's confidence explains: the head that reads it learns it, the other cannot."""
    data = _toy_data()
    data["label"] = (data["confidence"] > 0.5).float()
    losses = {}
    for reads in (True, False):
        settings = TrainSettings(
            depth=1, w_rej=1.0, epochs=3, lr=3e-3, batch_size=32, confidence_input=reads, early=False
        )
        _, history = train_head(data, settings, tmp_path / str(reads), progress=False, log=lambda _: None)
        losses[reads] = history[-1]["val_loss"]
    assert losses[True] < 0.7 * losses[False]  # without it: chance (log 2)
    assert AcceptanceHead.load(tmp_path / "True").confidence_input


def test_training_lowers_validation_loss_and_resumes(tmp_path):
    data = _toy_data()
    settings = TrainSettings(depth=2, w_rej=1.0, epochs=2, lr=3e-3, batch_size=32, confidence_input=False, early=False)
    head, history = train_head(data, settings, tmp_path, progress=False, log=lambda _: None)
    untrained = AcceptanceHead(8, 2)
    from speculum.training.acceptance import evaluate, split_by_text

    _, val = split_by_text(data, settings.val_fraction, settings.seed)
    before = evaluate(untrained, data, val, settings)["val_loss"]
    assert history[-1]["val_loss"] < 0.6 * before and history[-1]["val_accuracy"] > 0.8
    assert AcceptanceHead.load(tmp_path).training_info["history"] == history
    _, resumed = train_head(
        data,
        TrainSettings(2, 1.0, 3, 3e-3, 32, confidence_input=False, early=False),
        tmp_path,
        resume=True,
        progress=False,
        log=lambda _: None,
    )
    assert len(resumed) == 3 and resumed[:2] == history and resumed[2]["val_loss"] < history[1]["val_loss"]


def test_cli_trains_a_head_that_generate_uses(tmp_path):
    model_dir = tmp_path / "m"
    tiny_model("llama").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "head"
    res = CliRunner().invoke(
        app,
        ["train", "acceptance-head", "--model", str(model_dir), "--draft", "self:1", "--out", str(out),
         "--texts", str(tmp_path / "t.txt"), "--epochs", "1", "--dtype", "float32", "--depth", "1"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    spec = speculum.load(str(model_dir), draft="self:1", dtype="float32")
    plain = spec.generate(TEXT, "autoregressive", max_new_tokens=12)
    params = {"length_policy": "specdecpp", "acceptance_head": str(out), "num_speculative_tokens": 8}
    assert spec.generate(TEXT, "draft_model", max_new_tokens=12, **params).token_ids == plain.token_ids
    res = CliRunner().invoke(
        app,
        ["generate", TEXT, "--model", str(model_dir), "--draft", "self:1", "--dtype", "float32", "--method",
         "draft_model", "--length-policy", "specdecpp", "--param", f"acceptance_head={out}", "--max-new-tokens", "12",
         "--no-stream", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["token_ids"] == plain.token_ids
    other = speculum.load(str(model_dir), draft=str(model_dir), dtype="float32")  # another draft: refused
    with pytest.raises(speculum.CheckpointError):
        other.generate(TEXT, "draft_model", max_new_tokens=4, **params)
    res = CliRunner().invoke(app, ["train", "acceptance-head", "--draft", "self:1", "--out", "x", "--texts", "nope"])
    assert res.exit_code == 2 and "unknown text source" in res.output
