"""The Python API and the CLI on a tiny model saved to disk: generation, streaming, bad input."""

import json

import pytest
import torch
from typer.testing import CliRunner

import speculum
from speculum import machine
from speculum.cli import app

from tiny_models import VOCAB, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def spec(model_dir):
    return speculum.load(model_dir, draft="self:1", dtype="float32")


PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


def test_generate_every_method_equal(spec):
    base = spec.generate(PROMPT, "autoregressive", max_new_tokens=24)
    assert len(base.token_ids) == 24 and base.stats.mean_acceptance_length == 1.0
    assert base.text == spec.tokenizer.decode(base.token_ids, skip_special_tokens=True)
    for method in ["prompt_lookup", "anpd", "draft_model"]:
        result = spec.generate(PROMPT, method, max_new_tokens=24)
        assert result.token_ids == base.token_ids, method
        assert result.stats.new_tokens == 24


def test_speculative_config_and_params(spec):
    config = speculum.SpeculativeConfig(method="draft_model", num_speculative_tokens=3, length_policy="fixed")
    result = spec.generate(PROMPT, config, max_new_tokens=12)
    assert result.method == "draft_model"
    assert max(result.stats.accept_lengths) <= 4  # K=3 drafts + the bonus token
    again = spec.generate(PROMPT, "draft_model", max_new_tokens=12, num_speculative_tokens=3, length_policy="fixed")
    assert again.token_ids == result.token_ids


def test_machine_defaults_apply_on_cpu_as_a_whole_and_paper_preset_keeps_the_published_ones(spec):
    from speculum.methods import MACHINE_DEFAULTS

    measured = MACHINE_DEFAULTS["cpu"]["draft_model"]
    on_cpu = speculum.SpeculativeConfig("draft_model").options("cpu")
    assert all(getattr(on_cpu, name) == value for name, value in measured.items())
    published = speculum.SpeculativeConfig("draft_model", preset="paper").options("cpu")
    assert published == speculum.SpeculativeConfig("draft_model").options(None)  # no device: the published
    assert published.length_policy != on_cpu.length_policy
    # naming one parameter of the measured setting drops the rest: a fixed policy must not inherit K=20
    fixed = speculum.SpeculativeConfig("draft_model", length_policy="fixed").options("cpu")
    assert fixed.length_policy == "fixed" and fixed.num_speculative_tokens == published.num_speculative_tokens
    # the spec builds its drafters with its device's setting, and the preset is part of the drafter's identity
    assert spec.drafter_for(speculum.SpeculativeConfig("draft_model")).options == on_cpu
    assert spec.drafter_for(speculum.SpeculativeConfig.coerce("draft_model", preset="paper")).options == published
    base = spec.generate(PROMPT, "autoregressive", max_new_tokens=12)
    assert spec.generate(PROMPT, "draft_model", max_new_tokens=12, preset="paper").token_ids == base.token_ids
    with pytest.raises(speculum.InvalidInputError, match="preset"):
        speculum.SpeculativeConfig("draft_model", preset="fast")


def test_a_machine_class_setting_replaces_the_devices_for_its_methods_only(monkeypatch):
    """On a CPU the class is the vector instruction set torch computes with: where that class has a
    measured setting for a method it replaces the device's whole; other classes and methods keep
    the device's."""
    import torch

    from speculum.methods import MACHINE_DEFAULTS, machine_class, machine_defaults

    device = {"lookahead": {"window_size": 4, "ngram_size": 4}, "ctc": {"tree": "prefix"}}
    monkeypatch.setitem(MACHINE_DEFAULTS, "cpu", device)
    monkeypatch.setitem(MACHINE_DEFAULTS, "cpu/avx2", {"lookahead": {"window_size": 2}})
    monkeypatch.setitem(MACHINE_DEFAULTS, "cpu/avx512", {"lookahead": {"window_size": 3}})
    published = speculum.SpeculativeConfig("lookahead", preset="paper").options("cpu")
    # one combination: the class's setting does not inherit the device's other parameters; an
    # AVX-512 CPU with native bfloat16 is a class of its own (here without a setting: the device's)
    cases = (
        ("AVX2", False, "cpu/avx2", 2, published.ngram_size),
        ("AVX2", True, "cpu/avx2", 2, published.ngram_size),
        ("AVX512", False, "cpu/avx512", 3, published.ngram_size),
        ("AVX512", True, "cpu/avx512_bf16", 4, 4),
    )
    for capability, bf16, klass, window, ngram in cases:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda b=bf16: b)
        assert machine_class("cpu") == klass
        options = speculum.SpeculativeConfig("lookahead").options("cpu")
        assert (options.window_size, options.ngram_size) == (window, ngram)
        assert machine_defaults("ctc", "cpu") == {"tree": "prefix"}
    assert machine_class("cuda") == "cuda" and machine_defaults("lookahead", "cuda") == {}


def test_every_measured_setting_of_every_machine_class_is_lossless(spec):
    """Whatever class of CPU the tests run on, each setting some class gets by default decodes
    exactly what plain decoding does (heads' methods: in their own tests, with trained heads)."""
    from speculum.methods import MACHINE_DEFAULTS

    base = spec.generate(PROMPT, "autoregressive", max_new_tokens=16)
    for klass, settings in MACHINE_DEFAULTS.items():
        for method, setting in settings.items():
            if method not in ("medusa", "ctc"):
                assert spec.generate(PROMPT, method, max_new_tokens=16, **setting).token_ids == base.token_ids, klass


def test_sampled_requests_get_the_devices_sampled_setting_and_share_the_pools(spec, monkeypatch):
    """Where a method's CPU setting differs at T > 0: a sampled request runs a drafter built with
    it, a greedy one the greedy setting's, both over one phrase pool; the seeded text is plain
    sampling's either way. (No setting differs on a CPU today: one is put in for the test.)"""
    from speculum.methods import SAMPLED_MACHINE_DEFAULTS

    monkeypatch.setitem(SAMPLED_MACHINE_DEFAULTS, "cpu", {"ouroboros": {"length_policy": "fixed", "draft_guesses": 2}})
    config = speculum.SpeculativeConfig("ouroboros", num_phrase_candidates=2)  # (not a parameter of the setting)
    greedy, sampled = spec.drafter_for(config), spec.drafter_for(config, sampled=True)
    assert greedy is not sampled
    changed = SAMPLED_MACHINE_DEFAULTS["cpu"]["ouroboros"]
    assert all(getattr(sampled.options, k) == v for k, v in changed.items())
    assert any(getattr(greedy.options, k) != v for k, v in changed.items())
    assert greedy.pool is sampled.pool
    assert spec.drafter_for(config, sampled=True) is sampled  # built once
    # a method whose setting does not change for sampling keeps one drafter for both
    assert spec.drafter_for(speculum.SpeculativeConfig("anpd"), sampled=True) is spec.drafter_for(
        speculum.SpeculativeConfig("anpd")
    )
    # naming a parameter of the greedy setting drops the sampled one too (a setting is one combination)
    named = speculum.SpeculativeConfig("ouroboros", window_size=0)
    assert named.options("cpu", sampled=True) == named.options("cpu")

    started = []
    for which, drafter in (("greedy", greedy), ("sampled", sampled)):
        start = drafter.start
        monkeypatch.setattr(drafter, "start", lambda ctx, start=start, which=which: (started.append(which), start(ctx)))
    plain = spec.generate(PROMPT, "autoregressive", max_new_tokens=16, temperature=1.0, seed=3)
    result = spec.generate(PROMPT, config, max_new_tokens=16, temperature=1.0, seed=3)
    assert started == ["sampled"] and result.token_ids == plain.token_ids
    spec.generate(PROMPT, config, max_new_tokens=4)
    assert started == ["sampled", "greedy"]
    spec.forget(config)
    assert spec.drafter_for(config, sampled=True) is not sampled  # forgotten: both are built afresh


def test_auto_with_ouroboros_samples_by_a_noise(spec):
    """auto with Ouroboros as its draft-model part (its default): a seeded text is plain sampling's, and
    a request without a seed samples by a noise of fresh entropy too (Ouroboros' draft picks by it)."""
    config = speculum.SpeculativeConfig("auto", drafters="anpd,prompt_lookup,ouroboros")
    plain = spec.generate(PROMPT, "autoregressive", max_new_tokens=16, temperature=1.0, seed=5)
    assert spec.generate(PROMPT, config, max_new_tokens=16, temperature=1.0, seed=5).token_ids == plain.token_ids
    ids = spec.encode_prompt(PROMPT)
    assert spec.request(ids, config, spec.drafter_for(config, sampled=True), temperature=1.0).noise is not None
    default = speculum.SpeculativeConfig("auto")  # (Ouroboros is its draft-model part)
    assert spec.request(ids, default, spec.drafter_for(default, sampled=True), temperature=1.0).noise is not None
    chain = speculum.SpeculativeConfig("auto", drafters="anpd,draft_model")  # speculative sampling's rule
    assert spec.request(ids, chain, spec.drafter_for(chain, sampled=True), temperature=1.0).noise is None


def test_stream_concatenates_to_text(spec):
    stream = spec.generate(PROMPT, "prompt_lookup", max_new_tokens=20, stream=True)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == stream.result.text
    assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids
    assert len(chunks) == stream.result.stats.target_forwards  # one chunk per step, not per token


def test_chat_messages_use_template(spec):
    ids = spec.encode_prompt([{"role": "user", "content": PROMPT}])
    assert ids == spec.tokenizer(PROMPT)["input_ids"]


def test_sampling_seeded(spec):
    a = spec.generate(PROMPT, "draft_model", max_new_tokens=16, temperature=0.9, top_k=20, seed=3)
    b = spec.generate(PROMPT, "draft_model", max_new_tokens=16, temperature=0.9, top_k=20, seed=3)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(prompt=""), speculum.InvalidInputError),
        (dict(prompt="   "), speculum.InvalidInputError),
        (dict(temperature=-1.0), speculum.InvalidInputError),
        (dict(temperature=float("inf")), speculum.InvalidInputError),
        (dict(temperature=float("nan")), speculum.InvalidInputError),
        (dict(top_p=0.0), speculum.InvalidInputError),
        (dict(top_p=1.5), speculum.InvalidInputError),
        (dict(top_k=-2), speculum.InvalidInputError),
        (dict(max_new_tokens=0), speculum.InvalidInputError),
        (dict(method="telepathy"), speculum.UnknownMethodError),
        (dict(method="prompt_lookup", max_matching_ngram_size=0), speculum.InvalidInputError),
        (dict(method="prompt_lookup", no_such_param=1), speculum.InvalidInputError),
        (dict(prompt=" ".join(["w5"] * 300)), speculum.InvalidInputError),  # longer than the 256-token context
        (dict(prompt=[{"content": "no role"}]), speculum.InvalidInputError),
        (dict(prompt=[1, 2, 999]), speculum.InvalidInputError),
        (dict(prompt=[]), speculum.InvalidInputError),
        (dict(prompt=[-1]), speculum.InvalidInputError),
    ],
)
def test_bad_input_raises_typed_errors(spec, kwargs, error):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(error):
        spec.generate(**kwargs)
    with pytest.raises(error):  # a stream refuses bad input at the call, not at the first iteration
        spec.generate(**kwargs, stream=True)


def test_a_near_zero_temperature_is_greedy(spec):
    """Dividing logits by 1e-40 would make them inf and the probabilities NaN: below 1e-5 is greedy."""
    assert speculum.SamplingParams(temperature=1e-40).greedy
    assert speculum.SamplingParams(temperature=1e-40).temperature == 0.0
    assert not speculum.SamplingParams(temperature=1e-4).greedy
    greedy = spec.generate(PROMPT, "draft_model", max_new_tokens=16).token_ids
    for method in ("autoregressive", "draft_model"):
        assert spec.generate(PROMPT, method, max_new_tokens=16, temperature=1e-40, seed=1).token_ids == greedy


def test_unseeded_sampling_leaves_the_global_rng_alone(spec):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    outputs = {tuple(spec.generate(PROMPT, "prompt_lookup", max_new_tokens=12, temperature=1.0).token_ids)}
    assert torch.equal(torch.get_rng_state(), state)
    for _ in range(4):
        outputs.add(tuple(spec.generate(PROMPT, "prompt_lookup", max_new_tokens=12, temperature=1.0).token_ids))
    assert len(outputs) > 1  # fresh entropy each time
    with pytest.raises(speculum.InvalidInputError):
        spec.generate(PROMPT, max_new_tokens=4, temperature=1.0, seed=-1)


def _stream_text(decode, pieces):
    """Stream ``pieces`` (lists of token ids, one per step) through IncrementalText."""
    from speculum.api import IncrementalText

    calls = []

    def counting_decode(ids):
        calls.append(len(ids))
        return decode(ids)

    text, ids, out = IncrementalText(counting_decode), [], []
    for piece in pieces:
        ids.extend(piece)
        out.append(text.add(ids))
    out.append(text.finish(decode(ids)))
    return out, calls, ids


def test_incremental_text_multibyte_and_leading_spaces():
    import random

    rng = random.Random(0)
    message = "naïve café — 𝛑 ≈ 3.14 🙂 done, déjà vu; " * 8
    data = list(message.encode("utf-8"))  # byte-level tokens: characters split across tokens

    def byte_decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    pieces, i = [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        pieces.append(data[i : i + n])
        i += n
    out, calls, _ = _stream_text(byte_decode, pieces)
    assert "".join(out) == message
    assert all("\ufffd" not in chunk for chunk in out)  # incomplete characters were held back
    assert max(calls[:-1]) <= 16  # short windows, not the whole output at every step
    assert sum(calls[:-1]) <= 8 * len(data)

    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁jump", "s", "▁over", "."]

    def sentencepiece_decode(ids):  # drops the leading space of the text, as Llama/Gemma decoders do
        return "".join(words[i] for i in ids).replace("▁", " ").lstrip(" ")

    ids = [rng.randrange(len(words)) for _ in range(200)]
    pieces = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    out, _, all_ids = _stream_text(sentencepiece_decode, pieces)
    assert "".join(out) == sentencepiece_decode(all_ids)


def test_draft_model_method_needs_a_draft(model_dir):
    plain = speculum.load(model_dir, dtype="float32")
    with pytest.raises(speculum.InvalidInputError, match="draft"):
        plain.generate(PROMPT, "draft_model")


def test_incompatible_draft_refused(model_dir, tmp_path):
    other = tmp_path / "other"
    tiny_model("llama", vocab_size=VOCAB + 8).save_pretrained(other)
    tok = word_tokenizer()
    tok.add_tokens(["extra1", "extra2"])
    tok.save_pretrained(other)
    with pytest.raises(speculum.IncompatibleDraftError):
        speculum.load(model_dir, draft=str(other), dtype="float32")


def test_unknown_model():
    with pytest.raises(speculum.ModelLoadError):
        speculum.load("/no/such/model/dir")


runner = CliRunner()


def test_cli_generate(model_dir):
    result = runner.invoke(
        app,
        [
            "generate",
            PROMPT,
            "--model",
            model_dir,
            "--method",
            "prompt_lookup",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["stats"]["new_tokens"] == 12 and len(payload["token_ids"]) == 12


def test_cli_stream_and_stats(model_dir):
    result = runner.invoke(
        app,
        ["generate", PROMPT, "--model", model_dir, "--method", "anpd", "--max-new-tokens", "8", "--dtype", "float32"],
    )
    assert result.exit_code == 0, result.output
    assert "mean acceptance length" in result.output
    # whether small forwards are padded, and why (the suite turns the measurement off: conftest)
    assert "linear layers: no padding (SPECULUM_ROW_PADDING=0)" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["generate", ""],
        ["generate", PROMPT, "--temperature", "-1"],
        ["generate", PROMPT, "--top-p", "2"],
        ["generate", PROMPT, "--method", "telepathy"],
        ["generate", PROMPT, "--param", "oops"],
        ["generate", PROMPT, "--method", "anpd", "--param", "max_ngram_size=1"],
        ["generate", PROMPT, "--model", "/no/such/dir"],
        ["generate", PROMPT, "--model", "no-such-alias-xyz"],
    ],
)
def test_cli_bad_input_exit_2(args, model_dir):
    if "--model" not in args:
        args = args + ["--model", model_dir]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error" in result.output.lower()


def test_cli_models_lists_aliases():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    for alias in ["gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"]:
        assert alias in result.output


@pytest.mark.parametrize(
    "method,params",
    [
        ("lookahead", {"window_size": 256, "ngram_size": 256, "guess_set_size": 256}),
        ("lookahead", {"window_size": 100, "ngram_size": 10, "guess_set_size": 100}),
        ("ouroboros", {"num_speculative_tokens": 6, "num_phrase_candidates": 200, "ngram_size": 8}),
        ("ouroboros", {"window_size": 100, "guess_set_size": 200, "ngram_size": 6}),
        ("anpd", {"tree": True, "max_tree_nodes": 5000}),
        ("draft_model", {"num_speculative_tokens": 2000}),
        ("prompt_lookup", {"num_speculative_tokens": 2000}),
        ("medusa", {"tree_nodes": 2000}),
    ],
)
def test_settings_whose_trees_are_too_big_are_refused(method, params):
    """Tree size is the product of several parameters: it is capped as such, with one clear error."""
    with pytest.raises(speculum.InvalidInputError, match="at most 1024"):
        speculum.SpeculativeConfig(method, **params)


def test_the_published_tree_settings_are_allowed():
    speculum.SpeculativeConfig("lookahead", window_size=15, ngram_size=5, guess_set_size=15)  # LADE on a GPU
    speculum.SpeculativeConfig("ouroboros")
    speculum.SpeculativeConfig("medusa", tree_nodes=64)
