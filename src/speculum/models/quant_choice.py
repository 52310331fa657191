"""``quantization="auto"``: whether a GGUF model decodes faster on the file's own blocks here, measured.

The file's matrices of its first decoder layers (enough that they stream from memory, ~64 MB
de-quantized) are timed on speculum's quantized kernel and, de-quantized, on the kernel the
model would otherwise run (``dtype`` as chosen, prepacked where ``load`` prepacks), at one row (a
plain decode step) and at five (a verification), interleaved, the fastest of a few repetitions kept.
The GGUF's blocks are chosen when their mean over the two is faster. Cached per machine, software,
threads and model (``<cache>/dtype/quant-*.json``); a measurement taken while the CPU was busy is
provisional and taken again at rest (:func:`speculum.machine.measured`). Without AVX-512 VNNI or
AVX2 the kernel's portable build is far slower than the de-quantized weights' kernels: not measured there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

from speculum import accel, machine
from speculum.kernels import KernelUnavailable, quant
from speculum.kernels.gguf_blocks import dequantize
from speculum.models.gguf_weights import BLOCKS_FILE, BlockFile, QuantizedLinear

logger = logging.getLogger("speculum")

_VERSION = 1
_ROWS = (1, 5)  # a plain decode step, a verification of four drafts
_SAMPLE_BYTES = 64 << 20  # de-quantized float32 bytes of matrices timed together: more than a CPU cache holds
_REPS = 3


@dataclass(frozen=True)
class QuantizationChoice:
    """What ``quantization="auto"`` chose and why (``ms``: predicted linear-layer milliseconds per
    token by candidate and row count, empty when nothing was measured)."""

    quantization: str
    reason: str
    ms: dict[str, dict[int, float]] = field(default_factory=dict)
    cached: bool = False
    provisional: bool = False  # measured while other work loaded the CPU: measured again by a load at rest

    def describe(self) -> str:
        if not self.ms:
            return f"{self.quantization} ({self.reason})"
        timed = "; ".join(
            f"{name} " + " / ".join(f"{ms:.1f}" for ms in by_rows.values()) + " ms" for name, by_rows in self.ms.items()
        )
        rows = " / ".join(str(r) for r in _ROWS)
        when = "measured earlier, cached" if self.cached else "measured now"
        when += ", while the CPU was busy" if self.provisional else ""
        return f"{self.quantization} ({self.reason}: linear layers at {rows} rows, {timed}; {when})"


def choose_quantization(converted: Path | None, dtype: torch.dtype, prepack: bool) -> QuantizationChoice:
    """``"gguf"`` or ``"none"`` for the model converted in ``converted`` (None: not a GGUF model),
    against its de-quantized layers in ``dtype``."""
    if converted is None or not (converted / BLOCKS_FILE).is_file():
        return QuantizationChoice("none", "auto: not a GGUF file")
    blocks = BlockFile(converted)
    if not blocks.formats:
        return QuantizationChoice("none", "auto: the file holds no quantized matrix")
    if quant.native_isa() == "portable":
        return QuantizationChoice("none", "auto: this CPU has neither AVX-512 VNNI nor AVX2 for the quantized kernel")
    key = _cache_key(converted, blocks, dtype, prepack)
    try:
        verdict = machine.measured(
            machine.cache_dir() / "dtype" / f"quant-{key}.json",
            _VERSION,
            lambda: _measure(blocks, dtype, prepack),
            lambda ms: {"key": key, "ms": ms},
            lambda doc: {name: {int(r): float(v) for r, v in rows.items()} for name, rows in doc["ms"].items()},
            what="quantization choice",
        )
    except KernelUnavailable as error:
        return QuantizationChoice("none", f"auto: {error}")
    ms = verdict.value
    mean = {name: sum(rows.values()) / len(rows) for name, rows in ms.items()}
    faster = "gguf" if mean["gguf"] < mean["none"] else "none"
    reason = "auto: the file's blocks are faster here" if faster == "gguf" else "auto: de-quantized is faster here"
    return QuantizationChoice(faster, reason, ms, verdict.cached, verdict.provisional)


def _cache_key(converted: Path, blocks: BlockFile, dtype: torch.dtype, prepack: bool) -> str:
    inputs = {
        "model": converted.name,
        "formats": blocks.formats,
        "dtype": str(dtype),
        "prepack": prepack,
        "cpu": machine.cpu_identity(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernel": quant.native_isa(),
        "source": quant.source_digest(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _sample(blocks: BlockFile) -> tuple[list[str], float]:
    """The matrices of the first layers (in the file's order) up to ``_SAMPLE_BYTES``, and the whole
    model's weight count over theirs (what the sample's time is scaled by)."""
    sizes = {name: rows * cols for name, (_, rows, cols) in blocks.formats.items()}
    layers = [n for n in blocks.formats if ".layers." in n] or list(blocks.formats)
    chosen, total = [], 0
    for name in sorted(layers, key=lambda n: (_layer_index(n), n)):
        chosen.append(name)
        total += 4 * sizes[name]
        if total >= _SAMPLE_BYTES:
            break
    return chosen, sum(sizes.values()) / sum(sizes[n] for n in chosen)


def _layer_index(name: str) -> int:
    parts = name.split(".layers.", 1)[-1].split(".", 1)[0]
    return int(parts) if parts.isdigit() else 0


@torch.inference_mode()
def _measure(blocks: BlockFile, dtype: torch.dtype, prepack: bool) -> dict[str, dict[int, float]]:
    module = quant.load()
    names, scale = _sample(blocks)
    quantized, dense = [], []
    for name in names:
        weight = blocks.read(name)
        quantized.append(QuantizedLinear(quant.pack(weight), None, module))
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(dequantize(weight).to(dtype), requires_grad=False)
        dense.append(accel.PackedLinear(linear) if prepack and accel.packs(dtype) else linear)
    candidates = {"gguf": (quantized, torch.float32), "none": (dense, dtype)}
    best = {name: dict.fromkeys(_ROWS, float("inf")) for name in candidates}
    generator = torch.Generator().manual_seed(0)
    for rep in range(_REPS + 1):  # the first round warms up (page faults, packing, kernel dispatch)
        for rows in _ROWS:
            for name, (layers, in_dtype) in candidates.items():
                inputs = [torch.randn(rows, layer.in_features, generator=generator).to(in_dtype) for layer in layers]
                started = time.perf_counter()
                for layer, x in zip(layers, inputs, strict=True):
                    layer(x)
                spent = (time.perf_counter() - started) * 1e3 * scale
                if rep:
                    best[name][rows] = min(best[name][rows], spent)
    logger.info("speculum: quantization timings (linear ms per token by rows): %s", best)
    return best
