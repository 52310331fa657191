"""Exact mode's attention kernel (attention.cpp): each query over exactly the keys it sees, in their
order, by one fixed sequence of float32 operations, so a query's bits never depend on the forward
around it. Every build (AVX-512, AVX2, portable C++) gives the same bits: they differ only in how wide
the compiler makes the same lane-wise operations.

Where it is not used, :mod:`speculum.exact_attention` keeps its float64 path, which is layout-
invariant by another argument (see there). ``SPECULUM_EXACT_ATTENTION=kernel|float64`` picks one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from speculum import machine
from speculum.kernels import KernelUnavailable, build

logger = logging.getLogger("speculum")

ENV = "SPECULUM_EXACT_ATTENTION"  # "kernel", "float64" or "auto" (the kernel where it builds)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 models keep their own attention
_SOURCE = Path(__file__).with_name("attention.cpp")
_COMMON = ["-O3", "-ffp-contract=off", "-fopenmp"]
_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", *_COMMON],
    "avx2": ["-mavx2", "-mfma", *_COMMON],
    "portable": _COMMON,
}
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma"}, "portable": set()}


def runnable_isas() -> list[str]:
    """The builds this CPU can run, widest first."""
    flags = machine.cpu_flags()
    return [isa for isa, needs in _NEEDS.items() if needs <= flags]


@functools.cache
def source_digest() -> str:
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


@functools.cache
def load(isa: str | None = None) -> ModuleType:
    """The compiled kernel for ``isa`` (default: the widest this CPU runs), built on first use."""
    isa = isa or runnable_isas()[0]
    return build(f"speculum_attention_{isa}_{source_digest()[:8]}", _SOURCE, _FLAGS[isa], "exact attention kernel")


@functools.cache
def kernel() -> ModuleType | None:
    """The kernel exact mode uses in this process (None: the float64 path), chosen once: a process
    never mixes the two, so plain decoding and every verification compute alike. By default the
    AVX-512 build, where the CPU has it (on AVX2 alone the float64 path measured faster);
    ``SPECULUM_EXACT_ATTENTION=kernel`` takes the widest build this CPU runs, portable included."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in ("auto", "kernel", "float64"):
        raise ValueError(f"{ENV} must be kernel, float64 or auto, not {setting!r}")
    if setting == "float64" or (setting == "auto" and "avx512" not in runnable_isas()):
        return None
    try:
        return load("avx512" if setting == "auto" else runnable_isas()[0])
    except KernelUnavailable as error:
        if setting == "kernel":
            raise
        logger.warning("speculum: %s; exact attention stays in float64", error)
        return None


def for_dtype(dtype: torch.dtype) -> ModuleType | None:
    """The kernel exact mode runs a model of ``dtype`` on here (None: the float64 path)."""
    return kernel() if dtype in DTYPES else None


def implementation() -> str:
    """What exact mode's attention runs on here: ``kernel@<source digest>`` or ``float64``."""
    return f"kernel@{source_digest()}" if kernel() is not None else "float64"


def attend(
    module: ModuleType, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: tuple, scale: float
) -> torch.Tensor:
    """Attention of ``query`` [B, H, Q, D] over ``key``/``value`` [B, KVH, T, D]; ``runs`` says which
    keys each (row, query) pair sees (``speculum.exact_attention``'s plan, ``runs()``). Returns
    [B, Q, H, D] in ``query``'s dtype."""
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    out = module.attend(query.contiguous(), key, value, *runs, scale)
    return out if query.dtype == torch.float32 else out.to(query.dtype)
