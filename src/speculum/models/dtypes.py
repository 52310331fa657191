"""Choosing a dtype and checking a device: what ``dtype="auto"`` picks, and why.

- An explicit dtype is used as asked (:func:`resolve_dtype` turns its name into a torch dtype).
- On a CUDA GPU, ``"auto"`` is bfloat16 where the GPU supports it, float16 otherwise.
- On a CPU without native bfloat16 (AVX-512-BF16 or AMX) it is float32: bfloat16 would be emulated.
- On a CPU with native bfloat16 it is measured, not read from the flags (:func:`choose_dtype`). Native
  bfloat16 halves the bytes each decode step streams, but which dtype is faster depends on the
  model's shapes and the CPU: a small model with a big LM head can decode faster in prepacked
  float32. So :mod:`speculum.models.dtype_probe` times both on the model's shapes before it loads
  (cached per machine, software and model shape), and bfloat16 must be predicted at least 15% faster
  to be chosen (``_FLOAT32_MARGIN``: its short measurement is optimistic). A float32 model that would
  take more than 80% of the free memory is loaded in bfloat16 instead (checked on every load).

Set ``SPECULUM_DTYPE_MEASURE=0`` to skip measuring (the flag rule of :func:`resolve_dtype`: bfloat16
wherever the CPU has native bfloat16), e.g. in CI, or ``=refresh`` to measure again. A measurement
that fails falls back on the flag rule too: loading never fails for it. Measured choices per machine
and model: see docs/results.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from speculum import machine
from speculum.errors import InvalidInputError
from speculum.machine import available_memory as _available_memory
from speculum.models import dtype_probe

logger = logging.getLogger(__name__)

MEASURE_ENV = "SPECULUM_DTYPE_MEASURE"

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
        return torch.bfloat16 if machine.cpu_has_fast_bf16() else torch.float32
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


# bfloat16 must be predicted this much faster to be chosen. float32 rounds less, and bfloat16's
# measurement is optimistic on a shared CPU: its kernels (compute-bound where float32's stream memory)
# switch between a fast and a slow phase every few seconds, and a second of timing at start-up tends
# to catch the fast one, so a close call goes to float32 (end-to-end figures: docs/results.md). Where
# bfloat16 halves the bytes of a memory-bound model or AMX computes it, it should win by more than this.
_FLOAT32_MARGIN = 0.15
_MEMORY_SHARE = 0.8  # float32 only if the model takes at most this share of the free memory


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model was loaded in and why (``Speculum.dtype_choice``; ``speculum generate --stats``).

    ``ms_per_token``: each measured candidate's predicted milliseconds per generated token (empty when
    nothing was measured); ``cached``: the measurement was read from the cache; ``seconds``: time spent
    measuring now; ``provisional``: measured while the CPU was busy (``load``: how busy), so measured
    again by a later load at rest.
    """

    dtype: torch.dtype
    reason: str
    requested: str = "auto"
    ms_per_token: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0
    provisional: bool = False
    load: str = ""

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def measured(self) -> bool:
        return bool(self.ms_per_token)

    def describe(self) -> str:
        """One line, e.g. ``float32 (auto: prepacked float32 1.9 ms/token vs bfloat16 2.6 ms/token on this CPU,
        measured in 0.8 s)``."""
        if not self.measured:
            return f"{self.name} ({self.reason})"
        how = "measured earlier, cached" if self.cached else f"measured in {self.seconds:.1f} s"
        if self.provisional:
            how += f"; provisional: measured while the CPU was busy ({self.load}), measured again at rest"
        return f"{self.name} ({self.reason}, {how})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.name,
            "requested": self.requested,
            "reason": self.reason,
            "ms_per_token": dict(self.ms_per_token),
            "cached": self.cached,
            "seconds": round(self.seconds, 3),
            "provisional": self.provisional,
        }


def _requested_name(dtype: str | torch.dtype) -> str:
    return str(dtype).strip().lower().removeprefix("torch.")


def _measure_setting() -> str:
    """``SPECULUM_DTYPE_MEASURE``: "off" (0, false, no, off), "refresh" (measure again, ignoring the
    cache) or "on" (the default)."""
    value = os.environ.get(MEASURE_ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "refresh" if value == "refresh" else "on"


def choose_dtype(
    dtype: str | torch.dtype,
    device: str = "cpu",
    config: Any = None,
    *,
    prepack: bool = True,
    measure: bool = True,
    exact: bool = False,
) -> DtypeChoice:
    """:func:`resolve_dtype` with the reason, where ``"auto"`` on a CPU is measured for the model of ``config``.

    Explicit dtypes are returned as they are; CUDA gets bfloat16 where supported, else float16. On a
    CPU without native bfloat16 it is float32 (bfloat16 would be emulated). Otherwise float32
    (prepacked if ``prepack``) and bfloat16 are timed on the model's shapes (:mod:`speculum.models.dtype_probe`)
    and the faster one chosen, once per machine, software and model shape (cached). Without a
    ``config`` (a transformers config, or a function returning one when needed), with ``measure=False``
    or ``SPECULUM_DTYPE_MEASURE=0``: bfloat16, by the CPU flag. ``SPECULUM_DTYPE_MEASURE=refresh``
    measures again and replaces the cached decision (e.g. one measured while other jobs loaded the CPU).
    A measurement that fails falls back on the flag rule too: loading never fails for it. ``exact``:
    bfloat16 would run in exact mode (:mod:`speculum.exact`), so it is timed that way: where exactness
    costs more than bfloat16 saves, float32 (exact without it) is chosen and no text changes.
    """
    resolved = resolve_dtype(dtype, device)  # validates the name and the device kind first
    requested = _requested_name(dtype)
    if requested != "auto":
        return DtypeChoice(resolved, "asked for", requested)
    if _is_cuda_device(device):
        why = "bfloat16 on this GPU" if resolved is torch.bfloat16 else "float16: this GPU has no bfloat16"
        return DtypeChoice(resolved, f"auto: {why}")
    if not machine.cpu_has_fast_bf16():
        return DtypeChoice(
            torch.float32, "auto: this CPU has no native bfloat16 (AVX-512-BF16 or AMX), bfloat16 would be emulated"
        )
    flag_rule = "auto: this CPU has native bfloat16"
    setting = _measure_setting()
    if setting == "off":
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (not measured: {MEASURE_ENV}=0)")
    if not measure or config is None or str(device) != "cpu":
        where = f" on device {device}" if str(device) != "cpu" else ""
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (not measured{where})")
    try:
        if callable(config):  # read lazily: only this branch needs the model's config
            config = config()
        key = dtype_probe.cache_key(config, prepack, exact)
    except Exception as error:  # noqa: BLE001 - an odd config: no caching, no measuring (the load reports it)
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (not measured: {type(error).__name__})")
    try:
        verdict = dtype_probe.timings(config, prepack, key, refresh=setting == "refresh")
    except Exception as error:  # noqa: BLE001 - measuring is an optimisation: never a reason to fail a load
        logger.warning("speculum: could not time dtypes for this model (%s: %s)", type(error).__name__, error)
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (measuring failed: {type(error).__name__})")
    choice = _decide(verdict.value, verdict.cached, verdict.seconds, exact)
    if verdict.provisional:
        load = verdict.load.describe() if verdict.load is not None else "load unknown"
        choice = replace(choice, provisional=True, load=load)
    if choice.dtype is torch.float32:
        choice = _unless_out_of_memory(choice, config)
    logger.info("speculum: dtype %s", choice.describe())
    return choice


def _unless_out_of_memory(choice: DtypeChoice, config: Any) -> DtypeChoice:
    """bfloat16 after all where the float32 model would take most of the free memory (twice bfloat16's)."""
    free = _available_memory()
    if free is None:
        return choice
    try:
        need = dtype_probe.float32_bytes(config)
    except Exception:  # noqa: BLE001 - no estimate, no override
        return choice
    if need <= _MEMORY_SHARE * free:
        return choice
    why = f"; float32 would take {need / 2**30:.1f} of {free / 2**30:.1f} GiB of free memory: bfloat16"
    return replace(choice, dtype=torch.bfloat16, reason=choice.reason + why)


def _decide(times: dict[str, float], cached: bool, seconds: float, exact: bool = False) -> DtypeChoice:
    """The faster candidate of ``times`` (label -> ms per token), float32 unless bfloat16 wins clearly."""
    f32_label = next(label for label in times if label != "bfloat16")
    f32, bf16 = times[f32_label], times["bfloat16"]
    dtype = torch.bfloat16 if bf16 < f32 * (1 - _FLOAT32_MARGIN) else torch.float32
    half = "bfloat16 in exact mode" if exact else "bfloat16"
    reason = f"auto: {f32_label} {_ms(f32)} ms/token vs {half} {_ms(bf16)} ms/token on this CPU"
    if dtype is torch.float32 and bf16 < f32:
        reason += f" (within {_FLOAT32_MARGIN:.0%}: float32 kept)"
    return DtypeChoice(dtype, reason, ms_per_token=dict(times), cached=cached, seconds=seconds)


def _ms(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"
