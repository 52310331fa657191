"""The target's own LM head, restricted to a draft vocabulary, as the output layer of draft heads.

Medusa heads and the CTC draft module predict tokens through the target's (frozen) LM head, as
their papers do. A 262k-token head (Gemma 3) costs as much as half a target step per row on a
CPU, so draft heads use the rows of the ``draft_vocab`` tokens only: the tokens the target
predicts most often on the training text (chosen when the data is built; coverage is reported).
A token outside it is never drafted (the target still produces it, as its bonus token). The rows
are taken from the target at load time, not stored in the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


class DraftVocabProjection(nn.Module):
    """``hidden [..., H] -> logits [..., len(draft_vocab)]`` with the target's frozen LM-head rows."""

    def __init__(self, draft_vocab: torch.Tensor, hidden_size: int):
        super().__init__()
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # saved: which tokens
        # the rows themselves come from the target (attach), never from the checkpoint
        self.register_buffer("weight", torch.zeros(len(draft_vocab), hidden_size), persistent=False)
        self.attached = False

    def attach(self, lm_head_weight: torch.Tensor) -> None:
        """Take the draft vocabulary's rows of the target's LM head (``[vocab, H]``), in float32."""
        rows = lm_head_weight.detach()[self.draft_vocab.to(lm_head_weight.device)]
        self.weight = rows.to(self.weight.device, torch.float32).contiguous()
        self.attached = True

    def for_inference(self) -> bool:
        """Keep the rows in bfloat16 where the device computes it natively (returns whether it
        does): heads only propose, so rounding changes what they draft, never the output, and on an
        avx512_bf16 CPU 8 frames × 16,384 rows × 1,536 cost 1.7 ms instead of 9.4 (issue #20)."""
        from speculum.models.dtypes import native_bf16

        fast = self.attached and native_bf16(self.weight.device)
        if fast:
            self.weight = self.weight.to(torch.bfloat16)
        return fast

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.attached:
            raise RuntimeError("attach the target's LM head first (DraftVocabProjection.attach)")
        return (hidden.to(self.weight.dtype) @ self.weight.T).to(hidden.dtype)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the target's token ids."""
        return self.draft_vocab[index]


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The target's LM-head matrix ``[vocab, H]`` (also when prepacked for oneDNN)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None and hasattr(head, "packed_weight"):  # speculum.accel.PackedLinear
        weight = head.packed_weight.to_dense()
    return weight
