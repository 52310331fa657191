"""Prepacked float32 linears: same function, exact round trip, and every method still lossless on them."""

import pytest
import torch

from speculum import accel

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


def test_not_applied_to_bfloat16():
    assert accel.prepack(tiny_model("llama", dtype=torch.bfloat16)) == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_methods_lossless_on_packed_model(arch):
    model = tiny_model(arch)
    draft = perturbed_copy(model, 0.4)
    accel.prepack(model)
    accel.prepack(draft)
    prompt = repetitive_prompt(30, 7, 1)
    plain, _ = generate_ids(model, prompt, build_drafter("autoregressive"), 40)
    for method in ["prompt_lookup", "anpd", "draft_model"]:
        out, stats = generate_ids(model, prompt, build_drafter(method, draft, VOCAB), 40)
        assert out == plain, method
