"""quantization="gguf": a GGUF model's linear layers on the file's own blocks, and lossless decoding
on them: every method's greedy text equals plain decoding of the same quantized model, batched rows
equal their prompt alone, sampling follows the quantized model; bad values are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speculum import models
from speculum.errors import InvalidInputError
from speculum.kernels import quant
from speculum.kernels.gguf_blocks import decode
from speculum.models import gguf_weights
from speculum.sampling import SamplingParams
from test_quant_kernel import NATIVE, _module, random_blocks

from helpers import build_drafter, fit_pvalue, generate_ids
from tiny_models import perturbed_copy, repetitive_prompt, tiny_model, write_tiny_gguf

gguf = pytest.importorskip("gguf")


# ------------------------------------------------------------------------------- a quantized tiny model


def quantize_linears(model: nn.Module, kinds=("Q8_0", "Q4_0", "Q5_1"), isa: str | None = None) -> nn.Module:
    """``model`` with each linear layer's weight quantized by gguf-py (types in turn) and computed on
    the quantized kernel, as ``quantization="gguf"`` computes a GGUF's; the embedding stays as it is."""
    module = _module(isa or NATIVE)
    swaps = []
    for i, (name, layer) in enumerate((n, m) for n, m in model.named_modules() if type(m) is nn.Linear):
        kind = kinds[i % len(kinds)]
        values = layer.weight.detach().float().numpy()
        raw = gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind))
        packed = quant.pack(decode(raw, kind, values.shape))
        swaps.append((name, gguf_weights.QuantizedLinear(packed, layer.bias, module)))
    for name, new in swaps:
        model.set_submodule(name, new)
    gguf_weights.group_siblings(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "mistral"])
@pytest.mark.parametrize("method", ["prompt_lookup", "anpd", "lookahead", "draft_model", "auto"])
def test_every_method_equals_plain_decoding_of_the_quantized_model(arch, method):
    target = quantize_linears(tiny_model(arch))
    draft = quantize_linears(perturbed_copy(tiny_model(arch), scale=0.2), kinds=("Q4_1",))
    prompt = repetitive_prompt(24)
    plain, _ = generate_ids(target, prompt, build_drafter("autoregressive", target=target), max_new_tokens=40)
    params = {"num_speculative_tokens": 4} if method != "lookahead" else {}
    drafter = build_drafter(method, draft_model=draft if method in ("draft_model", "auto") else None, target=target,
                            **params)  # fmt: skip
    ids, stats = generate_ids(target, prompt, drafter, max_new_tokens=40)
    assert ids == plain
    assert stats.drafted_tokens > 0


def test_sampling_follows_the_quantized_model():
    """Draft-model speculative sampling on a quantized target: chi-square against the target's own
    (warped) distribution of two tokens, computed with the quantized layers."""
    from speculum import engine
    from speculum.runner import ModelRunner
    from speculum.sampling import warp
    from speculum.stats import Stats

    model = quantize_linears(tiny_model("llama", vocab_size=16))
    draft = quantize_linears(perturbed_copy(tiny_model("llama", vocab_size=16), scale=0.3), kinds=("Q4_0",))
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], sampling)[0]
        exact = {}
        for a in torch.nonzero(p1 > 0).flatten().tolist():
            p2 = warp(model(torch.tensor([prompt + [a]])).logits[0, -1], sampling)[0]
            for b in torch.nonzero(p2 > 0).flatten().tolist():
                exact[(a, b)] = p1[a].item() * p2[b].item()
    drafter = build_drafter("draft_model", draft, 16, target=model, num_speculative_tokens=3)
    gen = torch.Generator().manual_seed(5)
    counts = dict.fromkeys(exact, 0)
    trials = 1500
    for _ in range(trials):
        steps = engine.run(ModelRunner(model), prompt, drafter, sampling, 2, frozenset(), gen, Stats(), None)
        counts[tuple(t for step in steps for t in step)] += 1
    assert fit_pvalue(counts, exact, trials) > 1e-3


# ------------------------------------------------------------------------------- a GGUF file


def write_quantized_gguf(path, kinds: dict[str, str], hidden=256, inter=512, seed=0):
    """A tiny Llama GGUF whose matrices have the GGUF types ``kinds`` gives by tensor role (random
    valid blocks)."""
    counter = iter(range(1000))

    def matrix(writer, name, role, rows, cols):
        raw = random_blocks(kinds[role], rows, cols, seed=seed * 1000 + next(counter), size=0.3)
        writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kinds[role]))

    return write_tiny_gguf(path, hidden=hidden, inter=inter, seed=seed, matrix=matrix)


K_QUANT_KINDS = {"embedding": "Q4_K", "head": "Q6_K", "attention": "Q4_K", "values": "Q6_K", "mlp": "Q5_K",
                 "down": "Q6_K"}  # fmt: skip


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models.loading, "_hub_reachable", lambda timeout=3.0: False)


@pytest.fixture
def quantized_gguf(tmp_path_factory):
    return write_quantized_gguf(tmp_path_factory.mktemp("gguf") / "tiny-k.gguf", K_QUANT_KINDS)


def test_gguf_layers_keep_the_files_blocks_and_stay_exact(isolated_cache, quantized_gguf):
    import speculum

    spec = speculum.load(str(quantized_gguf), dtype="float32", quantization="gguf", exact=False)
    report = spec.quantization
    assert report.layers == {"Q4_K": 6, "Q5_K": 4, "Q6_K": 5} and report.embedding == "Q4_K"
    assert not report.dequantized and report.sibling_groups == 4  # q/k/v and gate/up of 2 blocks
    plain = speculum.load(str(quantized_gguf), dtype="float32", exact=False, quantization="none")  # de-quantized
    assert plain.quantization is None
    ids = torch.tensor([[1, 5, 6, 7, 3, 4, 9, 10, 11, 12]])
    with torch.no_grad():
        quantized, dense = spec.model(ids).logits, plain.model(ids).logits
    # the same model up to 8-bit activations: transformers' reordering of q and k rows was followed
    assert ((quantized - dense).norm() / dense.norm()).item() < 0.03
    assert spec.model.get_input_embeddings()(ids).equal(plain.model.get_input_embeddings()(ids))
    prompt = "hello world foo bar hello world foo bar hello world"
    reference = spec.generate(prompt, "autoregressive", max_new_tokens=24).token_ids
    for method in ("prompt_lookup", "anpd", "auto"):
        assert spec.generate(prompt, method, max_new_tokens=24).token_ids == reference, method
    batch = spec.generate([prompt, "the a the a hello", prompt[:20]], "prompt_lookup", max_new_tokens=16)
    for text, result in zip([prompt, "the a the a hello", prompt[:20]], batch, strict=True):
        assert result.token_ids == spec.generate(text, "autoregressive", max_new_tokens=16).token_ids


def test_bfloat16_exact_mode_on_gguf_layers(isolated_cache, quantized_gguf):
    import speculum

    spec = speculum.load(str(quantized_gguf), dtype="bfloat16", quantization="gguf", exact=True)
    assert "row kernel" in spec.exact.describe() or spec.exact.guaranteed
    prompt = "hello world foo bar hello world foo bar"
    reference = spec.generate(prompt, "autoregressive", max_new_tokens=20).token_ids
    assert spec.generate(prompt, "prompt_lookup", max_new_tokens=20).token_ids == reference


def test_bad_quantization_is_refused(isolated_cache, tmp_path):
    import speculum

    with pytest.raises(InvalidInputError, match="quantization must be one of"):
        speculum.load("anything", quantization="int4")
    with pytest.raises(InvalidInputError, match="CPU only"):
        speculum.load("anything", quantization="gguf", device="cuda")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(InvalidInputError, match="needs a GGUF file"):
        models.load_with_dtype_choice(str(tmp_path / "plain"), dtype="float32", quantization="gguf")


def test_cli_refuses_a_bad_quantization(isolated_cache):
    from typer.testing import CliRunner

    from speculum.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "--quantization", "int3"])
    assert result.exit_code == 2
    assert "quantization must be one of" in result.output


def test_auto_quantization_measures_caches_and_says_why(isolated_cache, quantized_gguf, monkeypatch):
    import speculum
    from speculum.models import quant_choice

    spec = speculum.load(str(quantized_gguf), quantization="auto", exact=False)
    choice = spec.quantization_choice
    assert set(choice.ms) == {"gguf", "none"} and all(set(ms) == {1, 5} for ms in choice.ms.values())
    assert (spec.quantization is not None) == (choice.quantization == "gguf")
    assert "measured now" in choice.describe()
    if choice.quantization == "gguf":  # the rest of the model then runs in float32
        assert spec.dtype_choice.dtype is torch.float32
    again = speculum.load(str(quantized_gguf), quantization="auto", exact=False).quantization_choice
    if not choice.provisional:  # (one measured while other work loaded the CPU is measured again at rest)
        assert again.cached and again.quantization == choice.quantization and again.ms == choice.ms
    # the verdict follows the timings: the faster mean over one row and five (a cheap step, a dear verification)
    monkeypatch.setattr(quant_choice, "_measure", lambda *a: {"gguf": {1: 9.0, 5: 40.0}, "none": {1: 20.0, 5: 21.0}})
    monkeypatch.setattr(quant_choice, "_cache_key", lambda *a: "forced")
    converted = next((models.cache_dir() / "models").iterdir())
    assert quant_choice.choose_quantization(converted, torch.float32, True).quantization == "none"


def test_auto_quantization_stays_off_without_blocks_or_vnni(isolated_cache, quantized_gguf, tmp_path, monkeypatch):
    import speculum
    from speculum.models import quant_choice

    assert "not a GGUF file" in quant_choice.choose_quantization(None, torch.float32, True).describe()
    monkeypatch.setattr(quant_choice.quant, "native_isa", lambda: "portable")
    spec = speculum.load(str(quantized_gguf), quantization="auto", exact=False)
    assert spec.quantization is None and "neither AVX-512 VNNI nor AVX2" in spec.quantization_choice.reason


def test_quantized_layers_turn_exact_mode_on(isolated_cache, quantized_gguf):
    """8-bit activations turn a last-bit difference of float32 attention into a whole step of their
    scale, so exact mode (attention per query) is on with quantized layers, float32 included: a
    verification forward's logits are then plain decoding's, bit for bit."""
    import speculum

    spec = speculum.load(str(quantized_gguf), dtype="float32", quantization="gguf")
    assert spec.exact.enabled and "quantized layers" in spec.exact.describe()
    ids = torch.tensor([[1, 5, 6, 7, 3, 4, 9, 10, 11, 12, 5, 6]])
    with torch.no_grad():
        whole = spec.model(ids).logits[0]
        out = spec.model(ids[:, :6], use_cache=True)
        past, steps = out.past_key_values, [out.logits[0, -1]]
        for t in range(6, 12):
            out = spec.model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[0, -1])
    assert torch.equal(torch.stack(steps), whole[5:])


def test_cli_stats_say_what_was_quantized_and_why(isolated_cache, quantized_gguf):
    from typer.testing import CliRunner

    from speculum.cli import app

    for quantization, expected in (("gguf", "quantized layers: gguf"), ("auto", "quantization: ")):
        result = CliRunner().invoke(
            app,
            ["generate", "hello world", "--model", str(quantized_gguf), "--quantization", quantization,
             "--max-new-tokens", "4", "--method", "autoregressive", "--stats"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert expected in result.output


def test_sibling_layers_in_one_call_give_each_the_bits_of_its_own_call():
    model = quantize_linears(tiny_model("qwen2"))
    attention = model.model.layers[0].self_attn
    group = attention.q_proj.siblings
    assert group is not None and group is attention.k_proj.siblings is attention.v_proj.siblings
    assert model.model.layers[0].mlp.gate_proj.siblings is model.model.layers[0].mlp.up_proj.siblings
    x, other = torch.randn(5, attention.q_proj.in_features), torch.randn(5, attention.q_proj.in_features)
    alone = [quant.linear(m._module, x, m.packed, m.bias) for m in group.members]
    assert torch.equal(attention.k_proj(x), alone[1])  # any member first: the group is computed
    assert torch.equal(attention.q_proj(x), alone[0]) and torch.equal(attention.v_proj(x), alone[2])
    attention.q_proj(x)
    assert torch.equal(attention.k_proj(other), quant.linear(group._module, other, group.members[1].packed,
                                                             group.members[1].bias))  # fmt: skip
    ids = torch.tensor([[1, 5, 6, 7, 3, 4, 9, 10]])
    with torch.no_grad():
        grouped = model(ids).logits
        for layer in model.modules():
            if isinstance(layer, gguf_weights.QuantizedLinear):
                layer.siblings = None
        assert torch.equal(model(ids).logits, grouped)


def test_draft_heads_take_only_their_rows_of_a_quantized_lm_head(isolated_cache, quantized_gguf, monkeypatch):
    import speculum
    from speculum import accel
    from speculum.heads.medusa import MedusaHeads

    spec = speculum.load(str(quantized_gguf), dtype="float32", quantization="gguf", exact=False)
    head = spec.model.get_output_embeddings()
    assert isinstance(head, gguf_weights.QuantizedLinear) and head.format == "Q6_K"
    unpacked = []
    unpack = gguf_weights.unpack_rows
    monkeypatch.setattr(gguf_weights, "unpack_rows", lambda packed, rows: unpacked.append(len(rows)) or
                        unpack(packed, rows))  # fmt: skip
    vocab = torch.tensor([5, 0, head.out_features - 1, 3])  # out of order
    heads = MedusaHeads(head.in_features, 2, vocab)
    heads.projection.attach_to(spec.model)
    assert unpacked == [len(vocab)]  # the draft vocabulary's rows only, not the whole head
    dense = head.dense()
    assert torch.equal(heads.projection.weight, dense[vocab])
    assert accel.output_size(spec.model) == dense.shape[0] == head.out_features
