"""SpecDec++'s acceptance-prediction head (Huang, Guo, Wang 2024) and its checkpoint files.

The head reads the draft model's last hidden state at the position whose input is a drafted token
and predicts the probability that the target accepts that token (given the earlier ones were
accepted). Architecture: D residual blocks ``x + SiLU(Linear(x))`` with their own weights (the
reference code builds its list by multiplying a one-element list, so its blocks share one set of
weights: a bug we do not copy), then ``Linear(H, 1)``; sigmoid of the output = P(accept).

A checkpoint is a directory with ``acceptance_head.safetensors`` and ``config.json``. The config
names the draft model it was trained on (a fingerprint of its shape and a few of its weights),
so a head is refused on another draft with a clear error. Both files are written atomically and
the config, written last, records the weights' SHA-256: a half-written pair is detected.

Beyond the paper, ``confidence_input=True`` also feeds the head the draft's own probability of the
candidate (its confidence, which the drafter computes anyway): a small MLP recovers it from the
hidden state only poorly, and on the Qwen pair it is the best single predictor of acceptance.
``early=True`` (implies confidence_input) reads the hidden state that *produced* the candidate
instead of the one where it is the input: the candidate is then scored as soon as it is drafted, so
the draft can end right after a doubtful token instead of drafting one more, unscored, as the paper
does. That matters where a draft forward costs a sizeable share of a target step (see docs/results.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculum.errors import CheckpointError
from speculum.heads.checkpoint import CONFIG, hidden_size, load_checkpoint, model_fingerprint, save_checkpoint
from speculum.heads.medusa import ResBlock  # Medusa's block, which SpecDec++ reuses

draft_hidden_size = hidden_size  # the names this module has always exported
draft_fingerprint = model_fingerprint

FORMAT = "speculum-acceptance-head"
VERSION = 1
WEIGHTS = "acceptance_head.safetensors"


class AcceptanceHead(nn.Module):
    """(D+1)-layer residual MLP over a hidden state; ``forward`` gives the logit of P(accept)."""

    def __init__(
        self,
        hidden_size: int,
        depth: int = 3,
        draft_fingerprint: str = "",
        confidence_input: bool = False,
        early: bool = False,
    ):
        super().__init__()
        confidence_input = confidence_input or early  # which token was drafted is only known from q
        if not isinstance(hidden_size, int) or hidden_size < 1 or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"bad head shape: hidden_size={hidden_size!r}, depth={depth!r}")
        self.hidden_size = hidden_size
        self.depth = depth
        self.draft_fingerprint = draft_fingerprint
        self.confidence_input = confidence_input
        self.early = early  # scores a candidate from the state that produced it (see the module docstring)
        # [q, log q, log(1-q)] of the candidate: added to the hidden state (zero at initialisation)
        # and, through a skip, to the output, which starts as logit(q) = log q - log(1-q): the head
        # begins as "accepted with the draft's own confidence" and learns corrections from the state
        self.confidence = nn.Linear(3, hidden_size) if confidence_input else None
        self.confidence_skip = nn.Linear(3, 1) if confidence_input else None
        if self.confidence is not None:
            nn.init.zeros_(self.confidence.weight)
            nn.init.zeros_(self.confidence.bias)
            with torch.no_grad():
                self.confidence_skip.weight.copy_(torch.tensor([[0.0, 1.0, -1.0]]))
                self.confidence_skip.bias.zero_()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(depth))  # independent weights
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor, confidence: torch.Tensor | float | None = None) -> torch.Tensor:
        """Logit of P(accept) from the draft's hidden state (and, for a ``confidence_input`` head,
        the draft's probability of the candidate)."""
        x = hidden.to(self.out.weight.dtype)
        skip = 0.0
        if self.confidence is not None:
            if confidence is None:
                raise ValueError("this acceptance head also reads the draft's confidence in the candidate")
            q = torch.as_tensor(confidence, dtype=x.dtype, device=x.device).clamp(1e-6, 1 - 1e-6)
            features = torch.stack([q, q.log(), (1 - q).log()], dim=-1)
            x = x + self.confidence(features)
            skip = self.confidence_skip(features).squeeze(-1)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1) + skip

    @torch.inference_mode()
    def accept_probability(self, hidden: torch.Tensor, confidence: float | None = None) -> torch.Tensor:
        return torch.sigmoid(self(hidden.to(self.out.weight.device), confidence))

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        directory: str | os.PathLike[str],
        *,
        training: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Write ``directory``/acceptance_head.safetensors and config.json (each atomically).

        ``dtype``: how the weights are stored (bfloat16 halves the file, as for the heads that ship
        with speculum); they are read back as float32."""
        config = {
            "format": FORMAT,
            "version": VERSION,
            "hidden_size": self.hidden_size,
            "depth": self.depth,
            "confidence_input": self.confidence_input,
            "early": self.early,
            "draft_fingerprint": self.draft_fingerprint,
            "training": training or {},
        }
        save_checkpoint(directory, WEIGHTS, self.state_dict(), config, dtype)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, draft_model: nn.Module | None = None) -> AcceptanceHead:
        """Read a checkpoint; with ``draft_model``, refuse a head trained for another draft."""
        where = str(directory)
        config, state = load_checkpoint(directory, WEIGHTS, FORMAT, VERSION, "acceptance-head")
        head = cls(
            int(config["hidden_size"]),
            int(config["depth"]),
            str(config.get("draft_fingerprint", "")),
            bool(config.get("confidence_input", False)),
            bool(config.get("early", False)),
        )
        try:
            head.load_state_dict(state)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"acceptance-head checkpoint {where!r} does not fit its config: {exc}") from None
        head.training_info = config.get("training", {})
        if draft_model is not None:
            head.check_draft(draft_model, where)
        return head.eval()

    def check_draft(self, draft_model: nn.Module, where: str = "the acceptance head") -> None:
        hidden = draft_hidden_size(draft_model)
        if hidden != self.hidden_size:
            raise CheckpointError(
                f"{where} reads hidden states of size {self.hidden_size}, the draft model's are {hidden}"
            )
        if self.draft_fingerprint and self.draft_fingerprint != draft_fingerprint(draft_model):
            raise CheckpointError(f"{where} was trained for another draft model (fingerprint mismatch)")


BUNDLED = (
    Path(__file__).parent.parent / "data" / "acceptance_heads"
)  # heads that ship with speculum, one directory each


def bundled_heads(draft_model: nn.Module) -> list[Path]:
    """The shipped heads trained for ``draft_model`` (matched by fingerprint): one per decoding
    temperature they were trained for (the policy picks per request)."""
    found, fingerprint = [], None
    for config in sorted(BUNDLED.glob("*/" + CONFIG)):
        try:
            expected = json.loads(config.read_text()).get("draft_fingerprint")
        except (OSError, ValueError):
            continue
        fingerprint = fingerprint or draft_fingerprint(draft_model)
        if expected == fingerprint:
            found.append(config.parent)
    return found


def bundled_head(draft_model: nn.Module) -> Path | None:
    """The first shipped head for ``draft_model`` (the greedy one where several ship), if any."""
    heads = bundled_heads(draft_model)
    return heads[0] if heads else None
