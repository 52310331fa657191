"""speculum.bench: datasets, method specs, summary arithmetic, interleaving, run_bench, the CLI command."""

from __future__ import annotations

import json
import string

import pytest
import torch
import typer
from typer.testing import CliRunner

from speculum.bench import datasets as ds
from speculum.bench.command import bench
from speculum.bench.method_specs import MethodSpec, parse_method_spec, parse_methods, parse_value, split_method_specs
from speculum.bench.report import summarize_records, to_markdown
from speculum.bench.runner import BenchResult, compare_tokens, interleaved_order, run_bench
from speculum.errors import InvalidInputError

# ----------------------------------------------------------------------------------------------
# datasets


@pytest.mark.parametrize("name", ["humaneval", "gsm8k", "mt_bench", "wmt16", "mbpp"])
def test_vendored_sets_load_with_limit(name):
    prompts = ds.load_dataset(name, limit=3)
    assert len(prompts) == 3
    for p in prompts:
        assert p.dataset == name
        assert p.text.strip() and p.raw.strip()
        assert p.question_id is not None
    assert len(ds.load_dataset(name, limit=None)) >= 80


def test_humaneval_is_raw_code_completion():
    row = json.loads(
        (ds.resources.files("speculum.data") / "humaneval.jsonl").read_text(encoding="utf-8").splitlines()[0]
    )
    p = ds.load_humaneval(1)[0]
    assert p.question_id == "HumanEval/0"
    assert p.raw == row["prompt"] and p.text == row["prompt"]
    assert p.chat_default is False
    assert p.render(False) == row["prompt"]


def test_prompt_contents():
    gsm = ds.load_gsm8k(1)[0]
    assert "step by step" in gsm.text and "Janet" in gsm.text and gsm.chat_default
    mt = ds.load_mt_bench(1)[0]
    assert mt.question_id == 81 and mt.category == "writing"
    assert mt.render(True) == [{"role": "user", "content": mt.text}]
    assert "Rewrite your previous response" not in mt.text  # first turn only
    wmt = ds.load_wmt16(1)[0]
    assert wmt.text == "Translate German to English: Obama empfängt Netanyahu"
    mbpp = ds.load_mbpp(1)[0]
    assert "assert min_cost(" in mbpp.text and mbpp.question_id == 1


def test_spec_bench_question_file(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]},
        {"question_id": 201, "category": "translation", "turns": ["Translate: Hallo"]},
        {"question_id": 301, "category": "qa", "turns": ["Who?"], "reference": ["x"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    prompts = ds.load_dataset(str(path))
    assert [p.question_id for p in prompts] == [81, 201, 301]
    assert prompts[0].text == "first turn" and prompts[0].category == "writing"
    assert prompts[0].dataset == "question"
    assert len(ds.load_dataset(str(path), limit=2)) == 2
    sets = ds.load_datasets([f"humaneval,{path}"], limit=1)
    assert list(sets) == ["humaneval", "question"]


def test_bad_datasets(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown dataset 'nope'.*humaneval"):
        ds.load_dataset("nope")
    with pytest.raises(InvalidInputError, match="not found"):
        ds.load_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n', encoding="utf-8")
    with pytest.raises(InvalidInputError, match="turns"):
        ds.load_dataset(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(InvalidInputError, match="line 1"):
        ds.load_dataset(str(broken))


def test_split_names():
    assert ds.split_names(["humaneval,gsm8k", "mt_bench", "gsm8k"]) == ["humaneval", "gsm8k", "mt_bench"]
    assert ds.split_names(None) == []


# ----------------------------------------------------------------------------------------------
# method specs


def test_parse_value_types():
    assert parse_value("5") == 5 and isinstance(parse_value("5"), int)
    assert parse_value("0.5") == 0.5
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("none") is None
    assert parse_value("heuristic") == "heuristic"


def test_parse_method_spec():
    m = parse_method_spec("anpd:num_speculative_tokens=5,tree=true,length-policy=fixed,alpha=0.25")
    assert m == MethodSpec(
        "anpd:num_speculative_tokens=5,tree=true,length-policy=fixed,alpha=0.25",
        "anpd",
        {"num_speculative_tokens": 5, "tree": True, "length_policy": "fixed", "alpha": 0.25},
    )
    assert parse_method_spec(" prompt_lookup ") == MethodSpec("prompt_lookup", "prompt_lookup", {})
    assert parse_method_spec("hf_generate").is_transformers
    # "#tag": a row of its own running the same method again (an A/A comparison)
    assert parse_method_spec("autoregressive#2") == MethodSpec("autoregressive#2", "autoregressive", {})
    assert parse_method_spec("anpd:tree=true#b") == MethodSpec("anpd:tree=true#b", "anpd", {"tree": True})


def test_a_tagged_config_file_is_the_same_config_in_a_row_of_its_own(tmp_path):
    from speculum import SpeculativeConfig

    path = tmp_path / "tuned.json"
    SpeculativeConfig(method="anpd", num_speculative_tokens=5).save(path)
    plain, again = parse_method_spec(str(path)), parse_method_spec(f"{path}#2")
    assert again.label == f"{path}#2" != plain.label
    assert (again.name, again.params) == (plain.name, plain.params) == ("anpd", plain.params)
    assert plain.params.get("num_speculative_tokens") == 5


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty"),
        (":k=1", "no method name"),
        ("anpd:", "nothing after"),
        ("anpd:k", "bad parameter 'k'"),
        ("anpd:k=", "bad parameter"),
        ("anpd:=3", "bad parameter"),
        ("anpd:k=1,k=2", "given twice"),
        ("anpd:2x=1", "bad parameter name"),
        ("#2", "a tag after '#'"),
        ("anpd#", "a tag after '#'"),
        ("anpd#a b", "a tag after '#'"),
    ],
)
def test_parse_method_spec_errors(spec, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_method_spec(spec)


def test_unknown_method_is_refused():
    with pytest.raises(InvalidInputError, match="unknown method 'nope'.*autoregressive"):
        parse_method_spec("nope:k=1", known=["autoregressive", "anpd"])


def test_split_method_specs():
    assert split_method_specs("autoregressive,anpd:num_speculative_tokens=5,tree=true,prompt_lookup") == [
        "autoregressive",
        "anpd:num_speculative_tokens=5,tree=true",
        "prompt_lookup",
    ]
    assert split_method_specs(["a:k=1", "b,c:x=2,y=3"]) == ["a:k=1", "b", "c:x=2,y=3"]
    with pytest.raises(InvalidInputError):
        split_method_specs("a,,b")
    with pytest.raises(InvalidInputError, match="twice"):
        parse_methods("a,b,a")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_interleaved_order_balances_positions_and_neighbours(n):
    from collections import Counter

    ms = [f"m{j}" for j in range(n)]
    cycle = n if n % 2 == 0 or n <= 2 else 2 * n
    orders = [interleaved_order(ms, i) for i in range(cycle)]
    assert interleaved_order(ms, 0)[0] == "m0"
    assert all(sorted(order) == ms for order in orders)  # every method once per prompt
    for pos in range(n):  # every method equally often in every position
        assert set(Counter(order[pos] for order in orders).values()) == {cycle // n}
    if n > 2:  # every method right after every other one equally often (a rotation: always the same one)
        pairs = Counter((order[j], order[j + 1]) for order in orders for j in range(n - 1))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert [interleaved_order(ms, i) for i in range(cycle, 2 * cycle)] == orders
    assert interleaved_order([], 5) == []


def test_compare_tokens():
    assert compare_tokens([1, 2, 3], [1, 2, 3]) is None
    assert compare_tokens([1, 2, 4], [1, 2, 3]) == 2
    assert compare_tokens([1, 2], [1, 2, 3]) == 2


# ----------------------------------------------------------------------------------------------
# summary arithmetic


def _rec(dataset, qid, method, new, wall, *, steps=None, drafted=None, accepted=None, times=None, equal=None):
    r = {
        "dataset": dataset,
        "question_id": qid,
        "category": "",
        "method": method,
        "new_tokens": new,
        "wall_time": wall,
        "accept_lengths": steps,
        "target_forwards": len(steps) if steps else None,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "equal_to_baseline": equal,
        "first_mismatch": None if equal in (True, None) else 3,
        "token_ids": [],
    }
    if times:
        r.update(time_prefill=times[0], time_draft=times[1], time_verify=times[2], time_other=times[3])
    return r


def test_summary_arithmetic():
    records = [
        _rec("a", 1, "ar", 10, 2.0, steps=[1] * 10, times=(0.0, 0.0, 2.0, 0.0), equal=True),
        _rec("a", 1, "pl", 10, 1.0, steps=[3, 3, 4], drafted=12, accepted=7, times=(0.1, 0.1, 0.7, 0.1), equal=True),
        _rec("a", 2, "ar", 20, 2.0, steps=[1] * 20, times=(0.0, 0.0, 2.0, 0.0), equal=True),
        _rec("a", 2, "pl", 20, 4.0, steps=[2] * 10, drafted=30, accepted=10, times=(0.2, 0.2, 3.4, 0.2), equal=False),
        _rec("b", 1, "ar", 5, 1.0, steps=[1] * 5, equal=True),
        _rec("b", 1, "pl", 5, 0.5, steps=[5], drafted=4, accepted=4, equal=True),
    ]
    groups = summarize_records(records, ["ar", "pl"], "ar")
    assert list(groups) == ["a", "b", "overall"]
    a_ar, a_pl = groups["a"]["ar"], groups["a"]["pl"]
    assert a_ar["tokens_per_second"] == pytest.approx(30 / 4.0)
    assert a_pl["tokens_per_second"] == pytest.approx(30 / 5.0)
    assert a_ar["speedup"] == pytest.approx(1.0)
    assert a_pl["speedup"] == pytest.approx((30 / 5.0) / (30 / 4.0))
    # per-prompt ratios: prompt 1: 10/1 vs 10/2 -> 2.0; prompt 2: 20/4 vs 20/2 -> 0.5
    assert a_pl["speedup_mean_per_prompt"] == pytest.approx((2.0 + 0.5) / 2)
    assert a_ar["mean_acceptance_length"] == pytest.approx(1.0)
    assert a_pl["mean_acceptance_length"] == pytest.approx(30 / 13)
    assert a_pl["draft_acceptance_rate"] == pytest.approx(17 / 42)
    assert a_ar["draft_acceptance_rate"] is None
    assert (a_pl["identical"], a_pl["compared"]) == (1, 2)
    assert a_pl["time_verify_pct"] == pytest.approx(100 * 4.1 / 5.0)
    assert a_pl["time_draft_pct"] == pytest.approx(100 * 0.3 / 5.0)
    ov = groups["overall"]["pl"]
    assert ov["prompts"] == 3 and ov["new_tokens"] == 35
    assert ov["speedup"] == pytest.approx((35 / 5.5) / (35 / 5.0))
    assert (ov["identical"], ov["compared"]) == (2, 3)
    assert groups["b"]["pl"]["draft_acceptance_rate"] == pytest.approx(1.0)

    result = BenchResult(records, ["ar", "pl"], "ar", ["a", "b"], meta={"dtype": "bfloat16", "check_lossless": True})
    md = to_markdown(result.summary())
    assert "| `pl` | 3 | 35 |" in md
    assert "2/3 outputs identical" in md and "a/2 at token 3" in md
    assert "near-ties" in md


def test_summary_without_baseline():
    records = [_rec("a", 1, "pl", 10, 1.0)]
    row = summarize_records(records, ["pl"], None)["overall"]["pl"]
    assert row["speedup"] is None and row["identical"] is None and row["mean_acceptance_length"] is None


# ----------------------------------------------------------------------------------------------
# run_bench with a fake model (no API needed)


class _FakeStats:
    def __init__(self, n, steps):
        self.n, self.steps = n, steps

    def to_dict(self):
        return {
            "new_tokens": self.n,
            "wall_time": 0.01,
            "accept_lengths": self.steps,
            "target_forwards": len(self.steps),
            "draft_forwards": 0,
            "drafted_tokens": 2 * len(self.steps),
            "accepted_tokens": self.n - len(self.steps),
            "mean_acceptance_length": self.n / len(self.steps),
            "draft_acceptance_rate": 0.5,
            "time_prefill": 0.001,
            "time_draft": 0.001,
            "time_verify": 0.007,
            "time_other": 0.001,
        }


class _FakeResult:
    def __init__(self, ids, steps):
        self.token_ids = ids
        self.text = ""
        self.stats = _FakeStats(len(ids), steps)


class _FakeSpec:
    """Answers like ``speculum.load(...)``: ``bad`` methods differ from the baseline at token 2."""

    tokenizer = None
    draft_model = None

    def __init__(self):
        self.calls = []

    def encode_prompt(self, prompt):
        text = prompt if isinstance(prompt, str) else prompt[0]["content"]
        return [ord(c) % 50 for c in text[:20]]

    def generate(self, ids, method, max_new_tokens, temperature, top_p, top_k, seed):
        self.calls.append((tuple(ids), method))
        out = [(sum(ids) + i) % 50 for i in range(max_new_tokens)]
        if method == "bad":
            out[2] += 1
        return _FakeResult(out, [1] * max_new_tokens if method == "ar" else [2] * (max_new_tokens // 2))


@pytest.fixture
def fake_configs(monkeypatch):
    monkeypatch.setattr(MethodSpec, "to_config", lambda self: self.name)


def test_run_bench_fake(fake_configs, tmp_path):
    spec = _FakeSpec()
    seen = []
    methods = [MethodSpec("ar", "autoregressive"), MethodSpec("good", "good"), MethodSpec("bad", "bad")]
    # the label "ar" names the method autoregressive, so it is the baseline
    result = run_bench(
        spec,
        {"x": ds.load_mt_bench(3), "y": ds.load_humaneval(3)},
        methods,
        limit=2,
        max_new_tokens=6,
        warmup=1,
        progress=False,
        fail_fast=True,
        on_prompt=seen.append,
    )
    assert result.baseline == "ar"
    assert len(result.records) == 2 * 2 * 3 == sum(len(recs) for recs in seen)
    assert [[r["method"] for r in recs] for recs in seen] == [["ar", "good", "bad"]] * 4  # a prompt at a time
    # warm-up: one call per method on the first prompt, not recorded
    assert [c[1] for c in spec.calls[:3]] == ["autoregressive", "good", "bad"]
    # interleaving: prompt i runs the methods rotated by i
    main_calls = [c[1] for c in spec.calls[3:]]
    assert main_calls[:6] == ["autoregressive", "good", "bad", "good", "bad", "autoregressive"]
    by = {(r["dataset"], r["question_id"], r["method"]): r for r in result.records}
    assert by[("mt_bench", 81, "good")]["equal_to_baseline"] is True
    assert by[("mt_bench", 81, "bad")]["equal_to_baseline"] is False
    assert by[("mt_bench", 81, "bad")]["first_mismatch"] == 2
    rec = by[("humaneval", "HumanEval/0", "good")]
    for key in (
        "new_tokens",
        "wall_time",
        "accept_lengths",
        "tokens_per_second",
        "mean_acceptance_length",
        "draft_acceptance_rate",
        "time_draft",
        "time_verify",
        "time_other",
        "token_ids",
        "category",
    ):
        assert key in rec
    assert rec["new_tokens"] == 6 and rec["accept_lengths"] == [2, 2, 2]
    summary = result.summary()
    assert summary["groups"]["overall"]["bad"]["identical"] == 0
    assert summary["mismatches"]["bad"][0]["first_mismatch"] == 2
    paths = result.write(tmp_path / "out")
    lines = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["method"] == "ar"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["baseline"] == "ar"
    assert "## overall" in open(paths["summary_md"]).read()


def test_run_bench_resumes_from_earlier_records(fake_configs):
    """Prompts recorded by an interrupted run are not run again; the others keep their seeds and order."""
    sets = {"x": ds.load_mt_bench(3), "y": ds.load_humaneval(3)}
    methods = [MethodSpec("ar", "autoregressive"), MethodSpec("good", "good")]
    kw = dict(limit=2, max_new_tokens=6, warmup=1, progress=False, fail_fast=True, seed=10)
    full_spec = _FakeSpec()
    full = run_bench(full_spec, sets, methods, **kw)
    earlier = [r for r in full.records if r["dataset"] == "mt_bench"]  # the first two prompts
    spec = _FakeSpec()
    resumed = run_bench(spec, sets, methods, previous=earlier, **kw)
    assert resumed.records[: len(earlier)] == earlier
    assert [(r["dataset"], r["question_id"], r["method"]) for r in resumed.records] == [
        (r["dataset"], r["question_id"], r["method"]) for r in full.records
    ]
    # warm-up on the first prompt still to run, then only the two HumanEval prompts, in the full run's order
    humaneval_ids = {tuple(c[0]) for c in full_spec.calls[2 + 4 :]}
    assert len(spec.calls) == 2 + 4 and {tuple(c[0]) for c in spec.calls} == humaneval_ids
    assert [c[1] for c in spec.calls[2:]] == [c[1] for c in full_spec.calls[2 + 4 :]]
    assert [r["token_ids"] for r in resumed.records] == [r["token_ids"] for r in full.records]
    assert any("resumed: 2 of 4 prompts" in n for n in resumed.notes)


def test_run_bench_records_failures(fake_configs):
    class Broken(_FakeSpec):
        def generate(self, ids, method, **kw):
            if method == "boom":
                raise RuntimeError("kaputt")
            return super().generate(ids, method, **kw)

    result = run_bench(
        Broken(), {"x": ds.load_wmt16(2)}, ["autoregressive", "boom"], max_new_tokens=4, warmup=0, progress=False
    )
    assert result.errors == {"boom": "RuntimeError: kaputt"}
    assert {r["method"] for r in result.records} == {"autoregressive"}
    assert "kaputt" in result.to_markdown()


def test_hf_assisted_skipped_without_draft(fake_configs):
    result = run_bench(
        _FakeSpec(), {"x": ds.load_wmt16(1)}, ["autoregressive", "hf_assisted"], warmup=0, progress=False
    )
    assert result.methods == ["autoregressive"]
    assert any("hf_assisted" in n for n in result.notes)


# ----------------------------------------------------------------------------------------------
# end to end on a tiny random model through the real API


def _tiny_spec():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    import speculum

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.ascii_lowercase + string.digits + " .,:\n()=+-_'\"[]{}":
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # far from argmax ties
    return speculum.Speculum(model, tok)


def test_run_bench_end_to_end_tiny_model(tmp_path):
    pytest.importorskip("speculum.api", reason="speculum.api (the lead's API) is not importable yet")
    spec = _tiny_spec()
    result = run_bench(
        spec,
        "humaneval,mt_bench",
        "autoregressive,prompt_lookup,hf_generate,hf_prompt_lookup",
        limit=1,
        max_new_tokens=12,
        warmup=0,
        progress=False,
        fail_fast=True,
    )
    assert result.baseline == "autoregressive" and not result.errors
    assert len(result.records) == 2 * 4
    for r in result.records:
        assert r["new_tokens"] == 12 and r["equal_to_baseline"] is True, r
    overall = result.summary()["groups"]["overall"]
    assert overall["autoregressive"]["mean_acceptance_length"] == pytest.approx(1.0)
    assert overall["prompt_lookup"]["identical"] == 2


# ----------------------------------------------------------------------------------------------
# the command's argument errors (no model is loaded)


def _app():
    app = typer.Typer()
    app.command("bench")(bench)

    @app.command("other")
    def other() -> None:  # a second command keeps "bench" a subcommand, as in the real CLI
        pass

    return app


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--dataset", "humaneval,missing/question.jsonl"], "dataset file not found"),
        (["--methods", "anpd:k"], "bad parameter 'k'"),
        (["--methods", "autoregressive,nonexistent_method"], "unknown method"),
        (["--methods", "prompt_lookup:no_such_option=3"], "no_such_option"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_command_argument_errors(args, needle):
    res = CliRunner().invoke(_app(), ["bench", *args])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.replace("│", " ").split())  # rich wraps the message in a box
    assert needle in flat
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_command_resumes_an_interrupted_run(model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["bench", "--model", model_dir, "--dataset", "wmt16", "--limit", "3", "--max-new-tokens", "4",
            "--methods", "autoregressive,prompt_lookup", "--warmup", "0", "--no-progress",
            "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(_app(), args)
    assert res.exit_code == 0, res.output
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads((out / "run.json").read_text())["settings"]["limit"] == 3
    meta = json.loads((out / "summary.json").read_text())["meta"]  # what load decided, with the run
    assert meta["row_padding"]["rows"] == 1 and "no padding" in meta["row_padding"]["reason"]
    # interrupted while the second prompt's records were written: its first line whole, its second cut
    (out / "records.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])
    res = CliRunner().invoke(_app(), [*args, "--resume"])
    assert res.exit_code == 0, res.output
    assert "1 prompts (2 records) kept" in res.output
    resumed = (out / "records.jsonl").read_text().splitlines()
    assert resumed[:2] == lines[:2]  # the first prompt's records as they were (their timings included)
    assert [json.loads(x)["question_id"] for x in resumed] == [json.loads(x)["question_id"] for x in lines]
    assert all(json.loads(x)["equal_to_baseline"] for x in resumed)
    assert "resumed: 2 records" in (out / "summary.md").read_text()
    # a finished run resumes to itself; other settings, or no run file, are refused with one message
    res = CliRunner().invoke(_app(), [*args, "--resume"])
    assert res.exit_code == 0 and "3 prompts (6 records) kept" in res.output
    assert (out / "records.jsonl").read_text().splitlines() == resumed
    res = CliRunner().invoke(_app(), [*args[:-2], "--out", str(out), "--max-new-tokens", "5", "--resume"])
    assert res.exit_code == 2 and "max_new_tokens 4 (now 5)" in " ".join(res.output.split())
    (out / "run.json").unlink()
    res = CliRunner().invoke(_app(), [*args, "--resume"])
    assert res.exit_code == 2 and "run.json" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(_app(), [*args[:-2], "--resume"])
    assert res.exit_code == 2 and "--out" in " ".join(res.output.replace("│", " ").split())


def test_transformers_rows_run_on_the_stock_model():
    """With speculum's prepacked weights, transformers' rows swap the stock layers back in, untimed."""
    from speculum import accel

    spec = _tiny_spec()
    if not accel.prepack(spec.model):
        pytest.skip("oneDNN prepacking unavailable")
    seen = []
    original = spec.model.generate

    def spy(*args, **kwargs):
        seen.append(accel.is_packed(spec.model))
        return original(*args, **kwargs)

    spec.model.generate = spy
    result = run_bench(
        spec, "humaneval", "autoregressive,hf_generate", limit=1, max_new_tokens=8, warmup=0, progress=False,
        fail_fast=True,
    )  # fmt: skip
    assert seen == [False]  # stock layers during transformers' call
    assert accel.is_packed(spec.model)  # and packed again for speculum's rows
    assert all(r["equal_to_baseline"] for r in result.records)


def test_a_repeated_baseline_gives_the_runs_noise_floor(fake_configs, tmp_path):
    """``autoregressive#2`` runs plain decoding again, in its own place of the interleaving: the
    report gives its ratio to the baseline per set, with the per-prompt range."""
    spec = _FakeSpec()
    methods = parse_methods("autoregressive,autoregressive#2,anpd", known=["autoregressive", "anpd"])
    result = run_bench(
        spec, {"x": ds.load_mt_bench(3), "y": ds.load_humaneval(3)}, methods,
        limit=2, max_new_tokens=6, warmup=0, progress=False, fail_fast=True,
    )  # fmt: skip
    assert result.baseline == "autoregressive"
    assert [c[1] for c in spec.calls].count("autoregressive") == 2 * 4  # twice per prompt
    overall = result.summary()["groups"]["overall"]
    repeat = overall["autoregressive#2"]
    assert repeat["identical"] == repeat["compared"] == 4
    assert repeat["speedup_min_per_prompt"] <= repeat["speedup"] <= repeat["speedup_max_per_prompt"]
    text = open(result.write(tmp_path / "out")["summary_md"]).read()
    assert "## Noise floor" in text
    row = next(line for line in text.splitlines() if line.startswith("| `autoregressive#2` ÷ `autoregressive`"))
    assert row.count("×") == 3  # mt_bench, humaneval, overall
    plain = run_bench(
        _FakeSpec(), {"x": ds.load_mt_bench(3)}, parse_methods("autoregressive,anpd", known=["autoregressive", "anpd"]),
        limit=1, max_new_tokens=6, warmup=0, progress=False, fail_fast=True,
    )  # fmt: skip
    assert "Noise floor" not in open(plain.write(tmp_path / "plain")["summary_md"]).read()
