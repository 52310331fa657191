"""Checkpoints of trained heads (Medusa heads, the CTC draft module, the acceptance head) and the
fingerprint that ties a head to the model it was trained on.

A checkpoint is a directory with one safetensors file and ``config.json``. Both are written
atomically and the config, written last, records the weights' SHA-256, so a half-written pair is
detected on load. The config carries the fingerprint of the model the head reads (its shape and a
sample of its weights): a head is refused with a clear error on any other model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from speculum.errors import CheckpointError
from speculum.poolfile import write_atomic

CONFIG = "config.json"


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def hidden_size(model: nn.Module) -> int:
    return int(text_config(model).hidden_size)


@torch.no_grad()
def model_fingerprint(model: nn.Module) -> str:
    """Identifies a model: its architecture and shape, its layer count (``self:N`` with another N
    does not pass) and a sample of its weights (nor does another checkpoint of the same shape).

    The weights are rounded to bfloat16 before hashing, so the same model loaded in float32 or
    bfloat16 (``dtype="auto"`` picks either, depending on the CPU) has the same fingerprint."""
    config = text_config(model)
    h = hashlib.sha256()
    for name in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        h.update(f"{name}={getattr(config, name, None)}\n".encode())
    # weights that prepacking (speculum.accel) leaves alone: embedding rows and the final norm
    embeddings = model.get_input_embeddings()
    count = embeddings.num_embeddings
    rows = torch.arange(0, count, max(1, count // 8))[:8]
    # a quantized embedding (quantization="gguf") gives the same rows as the de-quantized one's weight
    table = (
        embeddings.rows(rows) if hasattr(embeddings, "rows") else embeddings.weight[rows.to(embeddings.weight.device)]
    )
    samples = [table[:, :64]]
    norm = getattr(getattr(model, "model", model), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        samples.append(norm.weight.reshape(-1)[:256])
    for sample in samples:
        h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    h.update(f"layers={len(layers) if layers is not None else -1}\n".encode())
    return h.hexdigest()[:32]


def save_checkpoint(
    directory: str | os.PathLike[str],
    weights_name: str,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    dtype: torch.dtype | None = torch.float32,
) -> None:
    """Write ``directory/weights_name`` and ``directory/config.json`` (each atomically, the config
    last, with the weights' SHA-256). Floating tensors are stored as ``dtype`` (None: as they are)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {str(directory)!r}: {exc}") from exc
    state = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    blob = safetensors.torch.save(state)
    write_atomic(directory / weights_name, blob, what="checkpoint file", error=CheckpointError)
    config = {**config, "weights_sha256": hashlib.sha256(blob).hexdigest()}
    data = (json.dumps(config, indent=2) + "\n").encode()
    write_atomic(directory / CONFIG, data, what="checkpoint file", error=CheckpointError)


def load_checkpoint(
    directory: str | os.PathLike[str], weights_name: str, fmt: str, version: int, what: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a checkpoint written by :func:`save_checkpoint`: its config and its tensors (floating
    ones as float32). CheckpointError when it is missing, of another kind, or corrupt."""
    directory = Path(directory)
    where = str(directory)
    try:
        config = json.loads((directory / CONFIG).read_text())
        blob = (directory / weights_name).read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{where!r} is not a {what} checkpoint (missing {exc.filename})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {what} checkpoint {where!r}: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != fmt or config.get("version") != version:
        raise CheckpointError(f"{where!r} is not a version-{version} {what} checkpoint")
    if hashlib.sha256(blob).hexdigest() != config.get("weights_sha256"):
        raise CheckpointError(f"{what} checkpoint {where!r} is corrupt (weights do not match config)")
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in safetensors.torch.load(blob).items()}
    return config, tensors


def check_model(config: dict[str, Any], model: nn.Module, what: str, where: str) -> None:
    """Refuse a head whose config names another model than ``model`` (hidden size, vocabulary, fingerprint)."""
    size = hidden_size(model)
    if int(config.get("hidden_size", -1)) != size:
        raise CheckpointError(
            f"{what} {where!r} reads hidden states of size {config.get('hidden_size')}, the model's are {size}"
        )
    vocab = config.get("vocab_size")
    head = model.get_output_embeddings()  # nn.Linear, or speculum.accel.PackedLinear (no .weight)
    if vocab is not None and int(vocab) != int(head.out_features):
        raise CheckpointError(f"{what} {where!r} was trained for a vocabulary of {vocab} tokens, not this model's")
    expected = config.get("model_fingerprint") or config.get("draft_fingerprint")
    if expected and expected != model_fingerprint(model):
        raise CheckpointError(f"{what} {where!r} was trained for another model (fingerprint mismatch)")
