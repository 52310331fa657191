"""speculum's compiled CPU kernels, built with ``torch.utils.cpp_extension`` at first use and cached.

``bf16_rows``: a bfloat16 linear layer for CPUs with AVX-512 BF16 (bf16_rows.cpp). oneDNN's kernels
stream a one-row product's weights well below the machine's memory rate on these CPUs and round a
row differently by how many rows share the call; this one streams near the memory rate up to about
8 rows, stays within ~10% of oneDNN from 16 rows to a prefill's hundreds, and gives every row the
same bits whatever the row count or thread count (so exact mode needs no padding or pieces for it).
On AMX CPUs oneDNN's tile kernels are left in charge (they multiply many rows far faster);
``SPECULUM_BF16_KERNEL=rows|onednn`` overrides the choice.

Built once per machine kind (the instruction set is in the extension's name, so a cache shared
between CPUs never loads a build the CPU cannot run), in ``~/.cache/speculum/kernels/`` (per torch
version); about 25 s on two cores. A CPU without AVX-512 BF16 builds the
same sums in portable C++ (``isa="portable"``), which the tests run everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from speculum import machine

logger = logging.getLogger("speculum")

STALE_LOCK_S = 600  # a build lock this old is a killed build's (a build takes under a minute)
KERNEL_ENV = "SPECULUM_BF16_KERNEL"  # "rows", "onednn" or "auto" (rows where AVX-512 BF16 and no AMX)
COLUMNS = 64  # output columns per tile: packed widths are padded to a multiple of it
_SOURCE = Path(__file__).with_name("bf16_rows.cpp")
_FLAGS = {
    "avx512bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
    "portable": ["-O3", "-fopenmp"],
}


class KernelUnavailable(RuntimeError):
    """The compiled kernel cannot be built or loaded here (no compiler, a failed build)."""


def native_isa() -> str | None:
    """The instruction set the fast build needs, if this CPU has it ("avx512bf16"), else None."""
    return "avx512bf16" if "avx512_bf16" in machine.cpu_flags() else None


def build_dir(name: str) -> Path:
    """Where extension ``name`` is built and cached (speculum's cache, per torch version). A build
    lock older than ``STALE_LOCK_S`` is removed: it is left by a build that was killed, and torch
    would wait on it forever."""
    path = machine.cache_dir() / "kernels" / f"{name}-torch{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("speculum: removing a stale build lock left by an interrupted build: %s", lock)
            lock.unlink()
    return path


def build(name: str, source: Path, cflags: list[str], what: str) -> ModuleType:
    """Extension ``name`` compiled from ``source`` (built on first use, then loaded from the cache);
    :class:`KernelUnavailable` where it cannot be built."""
    from torch.utils import cpp_extension

    started = time.perf_counter()
    logger.info("speculum: loading the %s (%s; built once, under a minute)", what, name)
    try:
        module = cpp_extension.load(
            name,
            [str(source)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir(name)),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:  # no compiler, or a failed build
        raise KernelUnavailable(f"the {what} could not be built: {error}") from error
    logger.info("speculum: %s ready in %.1f s", what, time.perf_counter() - started)
    return module


@functools.cache
def load(isa: str = "avx512bf16") -> ModuleType:
    """The compiled bfloat16 row kernel for ``isa`` ("avx512bf16" or "portable"), built on first use."""
    return build(f"speculum_bf16_rows_{isa}", _SOURCE, _FLAGS[isa], "bfloat16 row kernel")


def rows_kernel_wanted() -> bool:
    """Whether bfloat16 linear layers run on the row kernel here: ``SPECULUM_BF16_KERNEL``, else
    where the CPU has AVX-512 BF16 but no AMX tiles."""
    setting = os.environ.get(KERNEL_ENV, "auto").strip().lower()
    if setting == "onednn" or native_isa() is None:
        return False
    return setting == "rows" or "amx_bf16" not in machine.cpu_flags()


def rows_kernel() -> ModuleType | None:
    """The native row kernel if it is wanted here and builds (None otherwise, the reason logged)."""
    if not rows_kernel_wanted():
        return None
    try:
        return load(native_isa())
    except KernelUnavailable as error:
        logger.warning("speculum: %s; bfloat16 layers stay on oneDNN", error)
        return None


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [N'/16, K'/2, 16, 2] bfloat16, N' the width padded
    to a multiple of ``COLUMNS`` and K' to an even count, with zeros."""
    n, k = weight.shape
    padded = weight.detach().to(torch.bfloat16)
    if k % 2 or n % COLUMNS:  # a copy only where needed: a model's worth of temporaries would stay mapped
        padded = F.pad(padded, (0, k % 2, 0, -n % COLUMNS))
    n2, k2 = padded.shape
    return padded.view(n2 // 16, 16, k2 // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the kernel adds it: float32, padded with zeros like the packed weight's width."""
    if bias is None:
        return None
    return F.pad(bias.detach().float(), (0, -bias.shape[0] % COLUMNS)).contiguous()


def unpack_rows(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [N, K] weight ``pack_rows`` was given."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)[:out_features, :in_features].contiguous()


def rows_linear(
    module: ModuleType, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W.T + bias`` on the row kernel (``packed`` from :func:`pack_rows`, ``bias`` from :func:`pack_bias`)."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features).to(torch.bfloat16)
    if in_features % 2:
        flat = F.pad(flat, (0, 1))
    out = module.linear(flat.contiguous(), packed, bias if bias is not None else _NO_BIAS)
    if out.shape[1] != out_features:
        out = out[:, :out_features]
    return out.reshape(*x.shape[:-1], out_features)


_NO_BIAS = torch.empty(0)
