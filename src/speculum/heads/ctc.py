"""CTC-drafter's attention draft module (Wen, Gui, Feng 2024), as the paper describes it.

ONE transformer layer predicts ``slots`` future frames at once (non-autoregressively; the released
code drafts a greedy chain instead). Its inputs are what the loop has when a step begins: the
target's last hidden states over the recent context (``memory``, the last one at position t-1) and
the embedding of the root token (the target's own token at t, already committed). Each slot query is
the fused (hidden state at t-1, root embedding) plus a learned slot embedding (and, with
``slot_blocks``, the slot's own residual block over the fused state, as a Medusa head has: without
them the slots stay near copies of each other, and the frames' distributions with them, and the
module hardly learns); the layer lets the slots attend to each other (no causal mask: they are
predicted together) and to the memory. Each frame's output goes through the target's frozen LM head
over the draft vocabulary (:mod:`speculum.heads.projection`) plus one extra logit: the CTC blank, a
symbol of its own that is never a real token (the released code reuses token 0, ``<unk>``).

With ``refine`` (an experiment, not in the paper), a second layer of the same shape reads the first
pass's frames again with the embedding of each frame's top-1 choice added (the target's token
embedding, or a learned one for the blank), so a frame sees what its neighbours chose, not only what
they might choose: the released code gets the same from its autoregressive chain, one target-sized
step per token; here it costs one more small layer for every frame at once. The first stage is
trained with the same loss, so its choices stay meaningful.

Trained with torch's CTC loss against the target's next ``label_length`` tokens, so the frames
may spread those tokens over the slots with blanks and repeats; at inference the CTC transform
(blanks dropped, adjacent repeats merged, :func:`speculum.drafters.ctc.ctc_collapse`) turns each
candidate alignment into a token sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from speculum.accel import PackedLinear
from speculum.heads.projection import DraftVocabProjection


class CTCDraftModule(nn.Module):
    OPTIONAL_BUFFERS = ("hidden_mean", "hidden_std")  # identity (0, 1) in checkpoints made before them

    def __init__(
        self,
        hidden_size: int,
        draft_vocab: torch.Tensor,
        slots: int = 8,
        label_length: int = 4,
        context: int = 16,
        num_attention_heads: int | None = None,
        ffn_size: int | None = None,
        slot_blocks: bool = False,
        refine: bool = False,
    ):
        super().__init__()
        if slots < label_length or label_length < 1 or context < 1:
            raise ValueError(f"bad CTC module shape: slots={slots}, label_length={label_length}, context={context}")
        heads = num_attention_heads or max(1, hidden_size // 64)
        if hidden_size % heads:
            raise ValueError(f"hidden size {hidden_size} is not divisible by {heads} attention heads")
        self.hidden_size = hidden_size
        self.slots = slots
        self.label_length = label_length
        self.context = context
        self.num_attention_heads = heads
        self.ffn_size = ffn_size or 2 * hidden_size
        self.slot_blocks = slot_blocks
        self.refine = refine
        # the target's hidden states per dimension (mean, spread), measured on the training data: the
        # memory is standardised with them and the output mapped back onto them for the LM head
        self.register_buffer("hidden_mean", torch.zeros(hidden_size))
        self.register_buffer("hidden_std", torch.ones(hidden_size))
        self.norm_memory = nn.LayerNorm(hidden_size)
        self.norm_token = nn.LayerNorm(hidden_size)
        self.memory_position = nn.Parameter(torch.randn(context, hidden_size) * 0.02)  # last row: t-1
        self.fuse = nn.Linear(2 * hidden_size, hidden_size)
        with torch.no_grad():  # start from the hidden state at t-1 (as Medusa's zero-initialised blocks do)
            self.fuse.weight.zero_()
            self.fuse.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.fuse.bias.zero_()
        self.slot_embedding = nn.Parameter(torch.randn(slots, hidden_size) * 0.02)
        if slot_blocks:  # each slot's own residual block over the fused state (zero: start as the identity)
            self.slot_weight = nn.Parameter(torch.zeros(slots, hidden_size, hidden_size))
            self.slot_bias = nn.Parameter(torch.zeros(slots, hidden_size))
        self.layer = self._decoder_layer(zero_branches=slot_blocks)
        if refine:
            # the refining stage starts as the identity (its branches and its input's projection at zero):
            # the refined frames start as the first stage's
            self.refine_layer = self._decoder_layer(zero_branches=True)
            self.blank_embedding = nn.Parameter(torch.zeros(hidden_size))  # the blank's stand-in token embedding
            self.norm_choice = nn.LayerNorm(hidden_size)
            self.choice_in = nn.Linear(hidden_size, hidden_size)
            nn.init.zeros_(self.choice_in.weight)
            nn.init.zeros_(self.choice_in.bias)
        self.norm_out = nn.LayerNorm(hidden_size)
        self.blank = nn.Linear(hidden_size, 1)
        self.projection = DraftVocabProjection(draft_vocab, hidden_size)
        self.packed_layer: PackedDecoderLayer | None = None  # the layers' inference copies (for_inference)
        self.packed_refine_layer: PackedDecoderLayer | None = None

    def _decoder_layer(self, zero_branches: bool) -> nn.TransformerDecoderLayer:
        layer = nn.TransformerDecoderLayer(
            self.hidden_size, self.num_attention_heads, self.ffn_size, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        if zero_branches:  # a residual layer whose branches start at zero is the identity at first
            for branch in (layer.self_attn.out_proj, layer.multihead_attn.out_proj, layer.linear2):
                nn.init.zeros_(branch.weight)
                nn.init.zeros_(branch.bias)
        return layer

    def for_inference(self) -> bool:
        """Ready the module for drafting; returns whether it now drafts in bfloat16 (where the device
        computes it natively: see ``DraftVocabProjection.for_inference``). Elsewhere on a CPU, in
        float32, the projection and the layer's matrices are prepacked for oneDNN: MKL's kernels are
        slow over the few rows (8-17) a draft runs (see :mod:`speculum.accel`)."""
        if self.projection.for_inference():
            self.to(torch.bfloat16)
            return True
        if self.projection.packed is not None and self.packed_layer is None:
            self.__dict__["packed_layer"] = PackedDecoderLayer(self.layer)  # not a submodule: never saved
            if self.refine:
                self.__dict__["packed_refine_layer"] = PackedDecoderLayer(self.refine_layer)
        return False

    def shape(self) -> dict:
        """Constructor arguments besides the draft vocabulary (saved in the checkpoint's config)."""
        names = ("hidden_size", "slots", "label_length", "context", "num_attention_heads", "ffn_size", "slot_blocks",
                 "refine")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    @torch.no_grad()
    def standardize_on(self, hidden: torch.Tensor) -> None:
        """Measure the target's hidden states' per-dimension mean and spread (``hidden [N, H]``)."""
        hidden = hidden.float()
        self.hidden_mean.copy_(hidden.mean(dim=0))
        self.hidden_std.copy_(hidden.std(dim=0).clamp(min=1e-3))

    @property
    def blank_index(self) -> int:
        """The blank's index in the output (after the draft vocabulary's)."""
        return len(self.projection.draft_vocab)

    def forward(
        self,
        memory: torch.Tensor,
        root_embedding: torch.Tensor,
        padding: torch.Tensor | None = None,
        embed=None,
        every_pass: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """``memory [B, W, H]`` (W <= context, right-aligned: row -1 is position t-1), ``root_embedding
        [B, H]``, ``padding [B, W]`` (True: no hidden state there, e.g. before the text began) ->
        logits ``[B, slots, len(draft_vocab) + 1]``, the blank last. With ``refine``: ``embed`` maps
        target token ids to the target's input embeddings (the first stage's choices), the logits
        are the refining stage's; ``every_pass``: the list of every stage's logits (training)."""
        dtype = self.fuse.weight.dtype
        width = memory.shape[1]
        memory = (memory.to(dtype) - self.hidden_mean) / self.hidden_std
        memory = self.norm_memory(memory) + self.memory_position[self.context - width :]
        base = self.fuse(torch.cat([memory[:, -1], self.norm_token(root_embedding.to(dtype))], dim=-1))
        queries = base[:, None, :] + self.slot_embedding
        if self.slot_blocks:
            # every slot's block as one matmul over the weights as stored (an einsum copied them each step)
            blocks = nn.functional.linear(base, self.slot_weight.flatten(0, 1)).view(-1, self.slots, self.hidden_size)
            queries = queries + nn.functional.silu(blocks + self.slot_bias)
        keys = torch.cat([memory, base[:, None, :]], dim=1)  # the fused root token is context too
        if padding is not None:
            padding = torch.cat([padding, padding.new_zeros(padding.shape[0], 1)], dim=1)
        # (training reads the stock layers: the packed copies are for inference, their matrices frozen)
        packed = not self.training and self.packed_layer is not None
        frames = (self.packed_layer if packed else self.layer)(queries, keys, memory_key_padding_mask=padding)
        logits = [self._logits(frames)]
        if self.refine:
            if embed is None:
                raise ValueError("a CTC module with refine needs embed (the target's input embeddings)")
            choice = logits[0].detach().argmax(-1)  # [B, slots]: each frame's top-1, the blank included
            is_blank = choice == self.blank_index
            tokens = self.projection.draft_vocab[choice.clamp(max=self.blank_index - 1)]
            chosen = embed(tokens).to(dtype)
            chosen = torch.where(is_blank[..., None], self.blank_embedding.to(dtype), chosen)
            frames = frames + self.choice_in(self.norm_choice(chosen))
            layer = self.packed_refine_layer if packed else self.refine_layer
            logits.append(self._logits(layer(frames, keys, memory_key_padding_mask=padding)))
        return logits if every_pass else logits[-1]

    def _logits(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.norm_out(frames)
        return torch.cat([self.projection(x * self.hidden_std + self.hidden_mean), self.blank(x)], dim=-1)


class PackedDecoderLayer(nn.Module):
    """``nn.TransformerDecoderLayer`` (pre-norm, batch first, GELU, no dropout: the module's) for
    inference, its matrices prepacked for oneDNN (``speculum.accel.PackedLinear``). The stock
    attention reads its input projections as plain matrices, so it cannot take packed ones; this
    is the same computation, written out. Outputs equal the stock layer's up to float rounding."""

    def __init__(self, layer: nn.TransformerDecoderLayer):
        super().__init__()
        if not layer.norm_first or layer.activation is not nn.functional.gelu:
            raise ValueError("PackedDecoderLayer copies pre-norm GELU layers only")
        self.norm1, self.norm2, self.norm3 = layer.norm1, layer.norm2, layer.norm3
        self.heads = layer.self_attn.num_heads
        hidden = layer.self_attn.embed_dim

        packed = PackedLinear.of
        attend, cross = layer.self_attn, layer.multihead_attn
        self.self_qkv = packed(attend.in_proj_weight, attend.in_proj_bias)
        self.self_out = packed(attend.out_proj.weight, attend.out_proj.bias)
        self.cross_q = packed(cross.in_proj_weight[:hidden], cross.in_proj_bias[:hidden])
        self.cross_kv = packed(cross.in_proj_weight[hidden:], cross.in_proj_bias[hidden:])
        self.cross_out = packed(cross.out_proj.weight, cross.out_proj.bias)
        self.linear1 = packed(layer.linear1.weight, layer.linear1.bias)
        self.linear2 = packed(layer.linear2.weight, layer.linear2.bias)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, rows, hidden = q.shape
        split = lambda x: x.view(batch, x.shape[1], self.heads, hidden // self.heads).transpose(1, 2)  # noqa: E731
        out = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, rows, hidden)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, memory_key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.self_qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.self_out(self._attend(q, k, v, None))
        k, v = self.cross_kv(memory).chunk(2, dim=-1)
        mask = None if memory_key_padding_mask is None else ~memory_key_padding_mask[:, None, None, :]
        x = x + self.cross_out(self._attend(self.cross_q(self.norm2(x)), k, v, mask))
        return x + self.linear2(nn.functional.gelu(self.linear1(self.norm3(x))))
