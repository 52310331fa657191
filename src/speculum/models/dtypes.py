"""Choosing a dtype and checking a device: ``dtype="auto"`` picks what is fast on this machine."""

from __future__ import annotations

import torch

from speculum.errors import InvalidInputError

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
