"""Loading a target or draft: packaged aliases, hub ids, local directories and GGUF files."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from speculum.errors import InvalidInputError, ModelLoadError, SpeculumError
from speculum.exact import wants_exact
from speculum.models import gguf_weights
from speculum.models.convert import _converted_dir, _ensure_packaged, _is_converted, ensure_converted
from speculum.models.dtypes import DtypeChoice, _check_device, choose_dtype, resolve_dtype
from speculum.models.quant_choice import choose_quantization
from speculum.models.registry import DEFAULT_MODEL, PACKAGED_MODELS, _is_installed

logger = logging.getLogger("speculum")

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


def _resolve_source(name_or_path: str, gguf_file: str | None, blocks: bool = False) -> tuple[str, dict[str, Any]]:
    """Where to read from: (path or hub id, extra from_pretrained kwargs). ``blocks``: a GGUF file's
    quantized blocks are wanted beside its converted checkpoint (``quantization="gguf"``)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise InvalidInputError(f"model must be a non-empty string, got {name_or_path!r}")
    name = os.fspath(name_or_path).strip()
    if name in PACKAGED_MODELS and gguf_file is None:
        return str(_ensure_packaged(PACKAGED_MODELS[name], blocks=blocks)), {}
    path = Path(name).expanduser()
    if gguf_file is not None:
        gpath = Path(gguf_file).expanduser()
        if not gpath.is_absolute() and path.is_dir():
            gpath = path / gguf_file
        if gpath.is_file():
            return str(ensure_converted(gpath, blocks=blocks)), {}
        if path.exists() or _looks_like_path(name) or gpath.is_absolute():
            raise ModelLoadError(f"GGUF file not found: {gpath}")
        return name, {"gguf_file": gguf_file}  # a hub repo holding GGUF files
    if path.is_file():
        if name.lower().endswith(".gguf") or _has_gguf_magic(path):
            return str(ensure_converted(path, blocks=blocks)), {}
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
    device_map: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode with gradients off.

    ``name_or_path``: a packaged alias (see :data:`PACKAGED_MODELS`), a Hugging Face hub id, a local HF
    directory, or a local ``.gguf`` file (``gguf_file=`` names a GGUF inside a directory or hub repo).
    GGUF files are dequantised once and cached, keyed by their SHA-256. ``device``: ``cpu``, ``cuda``,
    ``cuda:N`` or ``auto`` (accelerate's ``device_map="auto"``, for targets bigger than one device).
    ``device_map`` (and ``offload_folder`` for ``"disk"`` entries) go to accelerate as they are: a
    target split over several GPUs, or offloaded to CPU or disk. ``dtype="auto"``: see
    :func:`load_with_dtype_choice`.
    """
    model, tokenizer, _ = load_with_dtype_choice(
        name_or_path,
        dtype=dtype,
        device=device,
        gguf_file=gguf_file,
        device_map=device_map,
        offload_folder=offload_folder,
    )
    return model, tokenizer


def load_with_dtype_choice(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    gguf_file: str | None = None,
    device_map: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    prepack: bool = True,
    exact: bool | str = False,
    quantization: str = "none",
) -> tuple[Any, Any, DtypeChoice]:
    """:func:`load_model`, also returning the dtype chosen and why. On a CPU, ``dtype="auto"`` times
    float32 (prepacked when ``prepack``, as ``speculum.load`` does) against bfloat16 on the model's
    shapes from its config before loading it, once per machine and model (cached; see
    :func:`speculum.models.dtypes.choose_dtype`); the model is then loaded once, in the faster dtype.
    ``exact`` (as :func:`speculum.load` takes it): bfloat16 is timed in exact mode where it would run so."""
    # lazily: transformers' auto classes take a second to import, which `import speculum` does not pay
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = _check_device(device)
    kwargs: dict[str, Any] = {}
    if device_map is not None:
        kwargs["device_map"] = _check_device_map(device_map)
        if offload_folder is not None:
            kwargs["offload_folder"] = os.fspath(offload_folder)
        device = "cuda" if _map_uses_cuda(device_map) else "cpu"  # for dtype="auto"
    elif device == "auto":
        kwargs["device_map"] = "auto"
    elif device != "cpu":
        kwargs["device_map"] = device
    resolve_dtype(dtype, device)  # a bad dtype is refused before anything is read or converted
    wanted = check_quantization(quantization, device)
    if wanted == "auto" and (str(device) != "cpu" or device_map is not None):
        wanted = "none"  # the quantized kernel is a CPU kernel
    source, extra = _resolve_source(name_or_path, gguf_file, blocks=wanted != "none")
    has_blocks = (Path(source) / gguf_weights.BLOCKS_FILE).is_file()
    if wanted == "gguf" and not has_blocks:
        raise InvalidInputError(
            f"quantization='gguf' needs a GGUF file or a packaged alias; {name_or_path!r} is not one "
            "(use quantization='none')"
        )
    if wanted == "gguf" and dtype == "auto":
        choice = DtypeChoice(torch.float32, GGUF_DTYPE_REASON)
    else:
        choice = choose_dtype(
            dtype,
            device,
            lambda: _from_pretrained(AutoConfig, source, "config", **extra),  # read only if measuring
            prepack=prepack,
            measure=device_map is None,
            exact=wants_exact(exact, torch.bfloat16)[0],
        )
    quantization_choice = None
    if wanted == "auto":  # measured against the de-quantized model in the dtype it would run in
        quantization_choice = choose_quantization(Path(source) if has_blocks else None, choice.dtype, prepack)
        wanted = quantization_choice.quantization
        if wanted == "gguf" and dtype == "auto":
            choice = DtypeChoice(torch.float32, GGUF_DTYPE_REASON)
    kwargs.update(dtype=choice.dtype, **extra)
    try:
        model = _from_pretrained(AutoModelForCausalLM, source, "model", **kwargs)
        tokenizer = _from_pretrained(AutoTokenizer, source, "tokenizer", **extra)
    except SpeculumError:
        raise
    except Exception as e:  # OSError, safetensors / json / hub errors with their own classes
        raise ModelLoadError(f"cannot load model {name_or_path!r} from {source}: {type(e).__name__}: {e}") from e
    model.eval()
    model.requires_grad_(False)
    model.speculum_quantization = None  # what the GGUF's blocks replaced (None: nothing)
    model.speculum_quantization_choice = quantization_choice  # what quantization="auto" chose and why
    if wanted == "gguf":
        try:
            model.speculum_quantization = gguf_weights.quantize_model(model, Path(source))
        except gguf_weights.KernelUnavailable as error:
            logger.warning("speculum: %s; the model stays de-quantized", error)
    return model, _fix_tokenizer(tokenizer), choice


QUANTIZATIONS = ("auto", "none", "gguf")
GGUF_DTYPE_REASON = (
    "auto with quantization='gguf': the linear layers compute in float32 on the file's blocks, and the rest "
    "runs faster in float32 than in bfloat16 there (no conversion around every layer)"
)


def check_quantization(quantization: str, device: str = "cpu") -> str:
    """``quantization`` checked ("auto", "none" or "gguf"); a bad value, or "gguf" off the CPU, is refused."""
    if quantization not in QUANTIZATIONS:
        raise InvalidInputError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "gguf" and str(device) != "cpu":
        raise InvalidInputError("quantization='gguf' runs on the CPU only (its kernel is a CPU kernel)")
    return quantization


def _check_device_map(device_map: str | dict) -> str | dict:
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise InvalidInputError(
                f"device_map {device_map!r}: use auto, balanced, balanced_low_0, sequential or a dict"
            )
        return device_map
    if not isinstance(device_map, dict) or not device_map:
        raise InvalidInputError(f"device_map must be a strategy name or a non-empty dict, got {device_map!r}")
    for module, where in device_map.items():
        if not isinstance(module, str):
            raise InvalidInputError(f"device_map keys must be module names, got {module!r}")
        if where not in ("cpu", "disk") and not isinstance(where, int):
            _check_device(str(where))
    return device_map


def _map_uses_cuda(device_map: str | dict) -> bool:
    if isinstance(device_map, str):
        return torch.cuda.is_available()
    return any(isinstance(w, int) or str(w).startswith("cuda") for w in device_map.values())


def eos_token_ids(model: Any, tokenizer: Any = None) -> frozenset[int]:
    """The tokens that end a generation: the generation config's, else the model config's, else the
    tokenizer's (the one rule for the engine and for trimming transformers' outputs in the bench)."""
    candidates = (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    )
    for eos in candidates:
        if eos is not None:
            return frozenset([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))
    return frozenset()


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
