"""Trained draft heads over the target's hidden states (Medusa heads, the CTC draft module): their
checkpoints, and the ones that ship with speculum.

A checkpoint directory holds ``draft_head.safetensors`` and ``config.json``: the kind (``medusa``
or ``ctc``), the module's shape, the target it was trained for (hidden size, vocabulary size,
fingerprint), inference defaults found at training time (Medusa's tree choices) and how it was
trained. A head is refused with a clear error on another target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculum import accel
from speculum.errors import CheckpointError, InvalidInputError
from speculum.heads.checkpoint import CONFIG, check_model, load_checkpoint, model_fingerprint, save_checkpoint
from speculum.heads.ctc import CTCDraftModule
from speculum.heads.medusa import MedusaHeads

FORMAT = "speculum-draft-head"
VERSION = 1
WEIGHTS = "draft_head.safetensors"
KINDS: dict[str, type[nn.Module]] = {"medusa": MedusaHeads, "ctc": CTCDraftModule}
BUNDLED = Path(__file__).parent.parent / "data" / "draft_heads"  # shipped heads, one directory each


def kind_of(module: nn.Module) -> str:
    return next(kind for kind, cls in KINDS.items() if isinstance(module, cls))


def save_draft_head(
    module: nn.Module,
    directory: str | os.PathLike[str],
    target: nn.Module,
    *,
    inference: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write ``module`` (trained for ``target``) as a checkpoint directory, atomically."""
    config = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind_of(module),
        "shape": module.shape(),
        "hidden_size": module.hidden_size,
        "vocab_size": accel.output_size(target),
        "model_fingerprint": model_fingerprint(target),
        "inference": inference or {},
        "training": training or {},
    }
    save_checkpoint(directory, WEIGHTS, module.state_dict(), config, dtype)


def load_draft_head(directory: str | os.PathLike[str], kind: str, target: nn.Module | None = None) -> nn.Module:
    """Read a checkpoint of ``kind``; with ``target``, check it was trained for it and attach the
    target's LM-head rows. The config is kept as ``module.checkpoint_config``."""
    where = str(directory)
    config, state = load_checkpoint(directory, WEIGHTS, FORMAT, VERSION, "draft-head")
    if config.get("kind") != kind:
        raise CheckpointError(f"{where!r} holds {config.get('kind')!r} heads, not {kind!r}")
    if target is not None:
        check_model(config, target, f"{kind} checkpoint", where)
    try:
        module = KINDS[kind](**config["shape"], draft_vocab=state["projection.draft_vocab"])
        for name in getattr(module, "OPTIONAL_BUFFERS", ()):  # checkpoints from before they existed: the defaults
            state.setdefault(name, module.state_dict()[name])
        module.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{kind} checkpoint {where!r} does not fit its config: {exc}") from None
    module.checkpoint_config = config
    if target is not None:
        module.projection.attach_to(target)
    return module.eval()


def bundled_draft_head(kind: str, target: nn.Module) -> Path | None:
    """The shipped checkpoint of ``kind`` trained for ``target`` (matched by fingerprint), if any."""
    fingerprint = None
    for config_path in sorted(BUNDLED.glob("*/" + CONFIG)):
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            continue
        if config.get("kind") != kind:
            continue
        fingerprint = fingerprint or model_fingerprint(target)
        if config.get("model_fingerprint") == fingerprint:
            return config_path.parent
    return None


def resolve_draft_head(kind: str, path: str | os.PathLike[str] | None, target: nn.Module) -> nn.Module:
    """The checkpoint a drafter uses: ``path`` if given, else the shipped one for ``target``."""
    if path is None:
        path = bundled_draft_head(kind, target)
        if path is None:
            command = "ctc-drafter" if kind == "ctc" else "medusa"
            raise InvalidInputError(
                f"no {kind} heads ship for this model: train them with `speculum train {command} --model MODEL "
                f"--out DIR` and give the directory (heads=DIR)"
            )
    return load_draft_head(path, kind, target)


def shared_draft_head(kind: str, path, resources) -> nn.Module:
    """The checkpoint of ``kind`` a drafter uses (``resolve_draft_head``), on the resources' device
    and readied for inference, loaded once per target and shared by every drafter of one
    ``Speculum``: its weights are only read, and each row of a batch has a drafter, which would
    otherwise load and ready its own copy before the batch's first token."""
    key = ("draft_head", kind, str(path), id(resources.target), str(resources.device))
    module = resources.shared.get(key)
    if module is None:
        module = resolve_draft_head(kind, path, resources.target).to(resources.device)
        (module.projection if kind == "medusa" else module).for_inference()
        resources.shared[key] = module
    return module


__all__ = [
    "CTCDraftModule",
    "MedusaHeads",
    "bundled_draft_head",
    "load_draft_head",
    "resolve_draft_head",
    "save_draft_head",
    "shared_draft_head",
]
