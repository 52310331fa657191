"""Prepacked linears (float32; bfloat16 where the CPU computes it natively): same function, exact round
trip, and every method still lossless on them."""

import pytest
import torch

from speculum import accel
from speculum.models import dtypes

from helpers import build_drafter, generate_ids
from tiny_models import VOCAB, perturbed_copy, repetitive_prompt, tiny_model

pytestmark = pytest.mark.skipif(not accel.supported(tiny_model("llama")), reason="oneDNN prepacking unavailable")


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


native_bf16 = pytest.mark.skipif(not dtypes.cpu_has_fast_bf16(), reason="this CPU has no native bfloat16")


def test_bfloat16_left_stock_where_the_cpu_emulates_it(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_has_fast_bf16", lambda: False)
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
