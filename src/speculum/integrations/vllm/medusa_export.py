"""speculum's Medusa heads in the checkpoint layout of vLLM's ``medusa`` method.

    speculum export vllm-medusa HEADS_DIR OUT_DIR --model MODEL
    LLM(model=MODEL, speculative_config={"method": "medusa", "model": OUT_DIR, "num_speculative_tokens": K})

The mapping is exact: vLLM's ``ResidualBlock`` is ``x + SiLU(Linear(x))`` per layer, as speculum's
``ResBlock`` (with ``medusa_fc_bias``, since speculum's linears have a bias), and speculum's heads
share the target's LM head over a draft vocabulary, which is vLLM's ``original_lm_head`` (one head
for all) of ``truncated_vocab_size`` rows with ``token_map`` naming their tokens. The rows are the
target's, taken from it here: speculum's checkpoint names the tokens, not the rows. A draft
vocabulary that covers the whole vocabulary is written in token order, without a ``token_map``
(vLLM ignores one unless the vocabulary is truncated). vLLM 0.32 loads a ``token_map`` only with
``model_loader_extra_config={"enable_weights_track": False}``: it registers the map as a parameter
while loading, then refuses it as one the checkpoint did not initialise.

vLLM drafts one chain, each head's top-1 token, where speculum drafts a tree; vLLM verifies every
drafted token, so its output is its plain decoding's either way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from speculum.errors import CheckpointError, InvalidInputError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def vllm_medusa_layout(heads, lm_head_weight: torch.Tensor, vocab_size: int) -> tuple[dict[str, Any], dict]:
    """``(config, tensors)`` of vLLM's Medusa checkpoint for speculum's ``heads`` (a
    ``speculum.heads.MedusaHeads``) over a target whose LM head is ``lm_head_weight [vocab, H]``
    and whose config says ``vocab_size`` (vLLM sizes the heads' vocabulary from it)."""
    rows, hidden = lm_head_weight.shape
    if rows != vocab_size:
        raise InvalidInputError(
            f"the target's LM head has {rows} rows but its config says vocab_size={vocab_size}: vLLM's Medusa "
            "maps draft tokens by the config's vocabulary, so the heads would draft other tokens"
        )
    if hidden != heads.hidden_size:
        raise CheckpointError(f"the heads read hidden states of size {heads.hidden_size}, the target's are {hidden}")
    draft_vocab = heads.projection.draft_vocab.detach().cpu().long()
    in_range = draft_vocab.numel() > 0 and 0 <= int(draft_vocab.min()) and int(draft_vocab.max()) < rows
    if not in_range or draft_vocab.numel() != draft_vocab.unique().numel():
        raise CheckpointError("the heads' draft vocabulary repeats a token or names one outside the target's")
    tensors: dict[str, torch.Tensor] = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach().float().cpu()
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach().float().cpu()
    whole = draft_vocab.numel() == rows
    if whole:  # the same tokens in token order: no token_map, which vLLM reads only for a truncated one
        draft_vocab = torch.arange(rows)
    else:
        tensors["token_map"] = draft_vocab.clone()
    # vLLM takes "lm_heads.0.weight" as its one shared head when original_lm_head is set
    tensors["lm_heads.0.weight"] = lm_head_weight.detach()[draft_vocab.to(lm_head_weight.device)].float().cpu()
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": int(heads.hidden_size),
        "vocab_size": int(vocab_size),
        "num_heads": int(heads.num_heads),
        "num_hidden_layers": int(heads.num_layers),
        "truncated_vocab_size": int(draft_vocab.numel()),
        "medusa_fc_bias": True,
        "original_lm_head": True,
        "torch_dtype": "float32",
    }
    return config, {name: tensor.contiguous() for name, tensor in tensors.items()}


def target_vocab_size(target) -> int:
    config = target.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.vocab_size)


def export_vllm_medusa(
    heads_dir: str | os.PathLike[str], target, out_dir: str | os.PathLike[str], *, force: bool = False
) -> dict[str, Any]:
    """Write the Medusa heads in ``heads_dir`` (``speculum train medusa``), trained for ``target``,
    as vLLM's Medusa checkpoint in ``out_dir``: ``config.json`` and ``model.safetensors``, both or
    neither (written in a temporary folder beside it, then renamed into place). An existing
    non-empty ``out_dir`` is refused unless ``force``. Returns the config written."""
    import safetensors.torch

    from speculum.heads import load_draft_head
    from speculum.heads.projection import lm_head_weight

    heads_dir, out_dir = Path(heads_dir), Path(out_dir)
    if not heads_dir.is_dir():
        raise InvalidInputError(f"{str(heads_dir)!r} is not a directory of Medusa heads")
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidInputError(f"{str(out_dir)!r} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise InvalidInputError(f"{str(out_dir)!r} is not empty (--force replaces it)")
    heads = load_draft_head(heads_dir, "medusa", target)  # refuses ctc heads and heads of another target
    config, tensors = vllm_medusa_layout(heads, lm_head_weight(target), target_vocab_size(target))
    fingerprint = heads.checkpoint_config.get("model_fingerprint")
    config["speculum"] = {"heads": str(heads_dir), "model_fingerprint": fingerprint}

    parent = out_dir.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=parent))
    except OSError as exc:
        raise InvalidInputError(f"cannot write beside {str(out_dir)!r}: {exc}") from None
    try:
        safetensors.torch.save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        _put_in_place(staging, out_dir.absolute())
    except OSError as exc:
        raise InvalidInputError(f"cannot write {str(out_dir)!r}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return config


def _put_in_place(staging: Path, out_dir: Path) -> None:
    """Rename ``staging`` to ``out_dir``; an old ``out_dir`` is moved aside first and removed after."""
    old = None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    try:
        os.replace(staging, out_dir)  # an empty out_dir is replaced as well
    except OSError:
        if old is not None:
            os.replace(old / out_dir.name, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
