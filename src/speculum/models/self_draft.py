"""Self-drafts: the target's own first N layers, final norm and LM head as a draft model (``draft="self:N"``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from speculum.errors import InvalidInputError


def parse_draft_spec(draft: str) -> int | None:
    """``"self:N"`` -> N (the target's first N layers as the draft); any other string -> None (a model name)."""
    if not isinstance(draft, str) or not draft.strip():
        raise InvalidInputError(f"draft must be a non-empty string, got {draft!r}")
    text = draft.strip()
    if not text.lower().startswith("self"):
        return None
    head, sep, tail = text.partition(":")
    if head.lower() != "self" or not sep:
        if head.lower() == "self" and not sep:
            raise InvalidInputError("self-draft needs a layer count: use 'self:N', e.g. 'self:4'")
        return None  # e.g. a model directory called "selfish-model"
    try:
        n = int(tail.strip())
    except ValueError as e:
        raise InvalidInputError(f"bad self-draft {draft!r}: N in 'self:N' must be an integer, got {tail!r}") from e
    if n < 1:
        raise InvalidInputError(f"bad self-draft {draft!r}: N must be at least 1")
    return n


def _decoder(model: Any) -> Any:
    inner = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
    if inner is None:
        inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if not isinstance(layers, torch.nn.ModuleList) or getattr(model, "lm_head", None) is None:
        raise InvalidInputError(
            f"self-drafts need a decoder with `model.layers` and `lm_head` (Llama, Qwen2, Gemma 3, Mistral, ...); "
            f"{type(model).__name__} has another layout"
        )
    return inner


def make_self_draft(model: Any, num_layers: int) -> Any:
    """A causal LM made of ``model``'s first ``num_layers`` decoder layers, final norm and LM head.

    The weights are shared with ``model`` (nothing is copied; like transformers' ``assistant_early_exit``).
    It runs an ordinary forward with its own cache; its logits equal those of ``model`` cut after
    ``num_layers`` layers. Casting or moving it also casts or moves the shared parts of ``model``.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise InvalidInputError(f"self-draft layer count must be an integer, got {num_layers!r}")
    inner = _decoder(model)
    total = len(inner.layers)
    if not 1 <= num_layers < total:
        raise InvalidInputError(
            f"self-draft layer count must be between 1 and {total - 1} for this model, got {num_layers}"
        )
    from accelerate import init_empty_weights  # lazily: only self-drafts need accelerate

    config = copy.deepcopy(model.config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = list(text_config.layer_types)[:num_layers]
    text_config.num_hidden_layers = num_layers
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=True):
        draft = type(model)(config)
    draft_inner = _decoder(draft)
    for child_name, child in inner.named_children():
        if child_name == "layers":
            draft_inner.layers = torch.nn.ModuleList(list(inner.layers)[:num_layers])
        else:
            setattr(draft_inner, child_name, child)
    for child_name, child in model.named_children():
        if child is not inner:
            setattr(draft, child_name, child)
    shared = {id(t) for t in list(model.parameters()) + list(model.buffers())}  # (offloaded ones are on meta)
    leftovers = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if id(t) not in shared]
    if leftovers:
        raise InvalidInputError(f"cannot build a self-draft for {type(model).__name__}: unshared parts {leftovers[:5]}")
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.eval()
    draft.requires_grad_(False)
    return draft
