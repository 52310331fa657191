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

from speculum import accel, machine


class DraftVocabProjection(nn.Module):
    """``hidden [..., H] -> logits [..., len(draft_vocab)]`` with the target's frozen LM-head rows."""

    def __init__(self, draft_vocab: torch.Tensor, hidden_size: int):
        super().__init__()
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # saved: which tokens
        # the rows themselves come from the target (attach), never from the checkpoint
        self.register_buffer("weight", torch.zeros(len(draft_vocab), hidden_size), persistent=False)
        self.attached = False
        self.packed: nn.Module | None = None  # speculum.accel.PackedLinear over the rows (see for_inference)

    def attach(self, lm_head_weight: torch.Tensor) -> None:
        """Take the draft vocabulary's rows of the target's LM head (``[vocab, H]``), in float32."""
        self._take(lm_head_weight.detach()[self.draft_vocab.to(lm_head_weight.device)])

    def attach_to(self, target: nn.Module) -> None:
        """Take the draft vocabulary's rows of ``target``'s LM head (see :func:`lm_head_rows`)."""
        self._take(lm_head_rows(target, self.draft_vocab))

    def _take(self, rows: torch.Tensor) -> None:
        self.weight = rows.to(self.weight.device, torch.float32).contiguous()
        self.packed = None
        self.attached = True

    def for_inference(self) -> bool:
        """Ready the rows for drafting; returns whether they are now bfloat16. Where the device
        computes bfloat16 natively they are kept in it: heads only propose, so rounding changes what
        they draft, never the output, and the projection of a round's frames costs a fraction of
        float32's. Elsewhere on a CPU, float32 rows are prepacked for oneDNN as the target's layers
        are (speculum.accel), which makes them about twice as fast as the stock kernel: a noticeable
        part of a plain step saved per drafted round. Results equal the stock kernel's up to float
        rounding."""
        if not self.attached:
            return False
        if machine.native_bf16(self.weight.device):
            self.weight = self.weight.to(torch.bfloat16)
            return True
        if self.packed is None and self.weight.device.type == "cpu" and accel.packs(self.weight.dtype):
            self.packed = accel.PackedLinear.of(self.weight)
            self.weight = self.weight.new_empty(0, self.weight.shape[1])  # the packed copy is the one used
        return False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.attached:
            raise RuntimeError("attach the target's LM head first (DraftVocabProjection.attach)")
        if self.packed is not None:
            return self.packed(hidden.float()).to(hidden.dtype)
        return (hidden.to(self.weight.dtype) @ self.weight.T).to(hidden.dtype)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the target's token ids."""
        return self.draft_vocab[index]


def lm_head_rows(model: nn.Module, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of the target's LM-head matrix. A head kept in a GGUF file's blocks
    de-quantizes only those rows: the whole of a 150k-token head takes seconds, a draft
    vocabulary's rows a fraction of that."""
    head = model.get_output_embeddings()
    if hasattr(head, "weight_rows"):  # speculum.models.gguf_weights.QuantizedLinear
        return head.weight_rows(index)
    weight = lm_head_weight(model)
    return weight.detach()[index.to(weight.device)]


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The target's LM-head matrix ``[vocab, H]`` (also when prepacked for oneDNN)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None and hasattr(head, "dense"):  # speculum.accel.PackedLinear, a QuantizedLinear
        weight = head.dense()
    return weight
