"""What every trainer here shares: the on-disk data cache, the validation split, training-state files."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from speculum.errors import CheckpointError
from speculum.poolfile import write_atomic


def cached_tensors(
    cache: Path, key: str, make: Callable[[], dict[str, torch.Tensor]], regenerate: bool = False
) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors in ``cache`` when they were made with the same ``key``, else ``make()``'s, cached
    (atomically). Returns them and whether they came from the cache."""
    if cache.exists() and not regenerate:
        try:
            with safe_open(str(cache), "pt") as f:
                if (f.metadata() or {}).get("key") == key:
                    return {name: f.get_tensor(name) for name in f.keys()}, True  # noqa: SIM118 - not a dict
        except Exception:  # noqa: BLE001 - an unreadable cache is remade
            pass
    data = make()
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(
        cache, safetensors.torch.save(data, metadata={"key": key}), what="training data file", error=CheckpointError
    )
    return data, False


def stored_key(cache: Path) -> str | None:
    """The key a :func:`cached_tensors` file was made with (None: unreadable, or none)."""
    try:
        with safe_open(str(cache), "pt") as f:
            return (f.metadata() or {}).get("key")
    except Exception:  # noqa: BLE001 - not a cache file
        return None


def split_by_text(data: dict[str, torch.Tensor], val_fraction: float, seed: int):
    """Train / validation masks over ``data["text"]`` rows, whole texts held out for validation."""
    texts = torch.unique(data["text"])
    gen = torch.Generator().manual_seed(seed)
    order = texts[torch.randperm(len(texts), generator=gen)]
    n_val = max(1, round(len(texts) * val_fraction)) if len(texts) > 1 and val_fraction > 0 else 0
    val = torch.isin(data["text"], order[:n_val])
    return ~val, val


def torch_bytes(obj) -> bytes:
    """``torch.save`` into bytes (written with write_atomic: never a half-written state file)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
