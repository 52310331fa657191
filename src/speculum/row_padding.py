"""Row padding: how a prepacked model's one- and two-token forwards run fastest on this machine.

oneDNN's kernels for 1-2 rows can be slower than its kernel for 4 (on some AVX-512-BF16 CPUs a
one-token step costs more than a four-token one), while elsewhere the stock kernel over a dense copy
of the weights is the fastest for those forwards. So the loaded model is timed all three ways once
per machine, software and model shape, and the fastest is set on its packed layers
(:func:`choose_row_padding`); the verdict is cached with :func:`speculum.machine.measured`, beside
the cost curves (:func:`speculum.costs.costs_dir`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

from torch import nn

from speculum import costs, machine
from speculum.accel import (
    DENSE_ROWS,
    PackedLinear,
    dense_rows,
    min_rows,
    output_size,
    set_dense_rows,
    set_min_rows,
)
from speculum.cache import crop

logger = logging.getLogger(__name__)

PAD_ROWS = 4  # forwards over fewer rows run as this many where that measures faster
PAD_MARGIN = 0.03  # padding must measure at least this much faster (a wrong call costs a few %)
PAD_ENV = "SPECULUM_ROW_PADDING"  # "0"/"off": never; "on": always (not measured); "refresh": measure again;
# "dense": one- and two-row forwards on the stock kernel (not measured)
_PAD_VERSION = 3  # bumped when the measurement, its key or the file changes: older verdicts are measured again
DENSE_MEMORY_SHARE = 0.5  # the dense copies are only tried if they take at most this share of the free memory


def _dense_copies_fit(model: nn.Module) -> bool:
    """Whether dense copies of the packed weights take at most ``DENSE_MEMORY_SHARE`` of the free memory."""
    free = machine.available_memory()
    need = sum(
        m.in_features * m.out_features * m.packed_weight.element_size()
        for m in model.modules()
        if isinstance(m, PackedLinear)
    )
    return free is not None and need <= DENSE_MEMORY_SHARE * free


@dataclass(frozen=True)
class RowPadding:
    """How a model's small forwards run, and why (``Speculum.row_padding``; ``speculum generate
    --stats``): padded to ``PAD_ROWS`` rows (``rows``), on the stock kernel up to ``dense_rows`` rows,
    or as they are. ``ms``: the measured forwards (one and two tokens, as they are, padded and on the
    stock kernel); ``cached``: the measurement was read from the cache; ``provisional``: "" or why the
    measurement is provisional (taken while the CPU was busy: measured again at rest)."""

    rows: int
    reason: str
    ms: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    dense_rows: int = 0
    provisional: str = ""

    def describe(self) -> str:
        if self.dense_rows:
            what = f"forwards of 1-{self.dense_rows} rows on the stock kernel (a dense copy of the weights kept)"
        elif self.rows > 1:
            what = f"forwards of 1-{PAD_ROWS - 1} rows padded to {PAD_ROWS}"
        else:
            what = "no padding"
        how = ", measured earlier, cached" if self.cached and self.ms else ""
        return f"{what} ({self.reason}{how}{'; ' + self.provisional if self.provisional else ''})"


def _pad_setting() -> str:
    value = os.environ.get(PAD_ENV, "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on"):
        return "on"
    return value if value in ("refresh", "dense") else "auto"


def _set_small_forwards(model: nn.Module, mode: str, *, keep_copies: bool = False) -> None:
    """``mode``: "" (as they are), "padded" or "dense" (see ``RowPadding``). The dense copies are made
    for "dense" and dropped otherwise, unless ``keep_copies`` (while the ways are timed in turn)."""
    set_min_rows(model, PAD_ROWS if mode == "padded" else 1)
    if mode == "dense" or not keep_copies:
        set_dense_rows(model, DENSE_ROWS if mode == "dense" else 0)
    else:
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                layer.dense_rows = 0


def _label(width: int, mode: str) -> str:
    """The key of a timed forward in ``RowPadding.ms``: "1", "2 padded", "1 dense"."""
    return f"{width} {mode}" if mode else str(width)


def choose_row_padding(runner, *, reps: int = 4, budget_s: float = 4.0) -> RowPadding:
    """Measure how ``runner``'s model runs its one- and two-token forwards fastest on this machine: on
    the packed kernel as they are, padded to ``PAD_ROWS`` rows, or on the stock kernel over a dense
    copy of the weights; set it on the model's packed layers, and say why.

    The forwards are timed through the engine's own runner after 64 cached positions, the ways
    interleaved (a slow phase of the CPU then slows them alike), the median of ``reps`` kept;
    padding or the stock kernel is chosen when the one- and two-token forwards together measure at
    least ``PAD_MARGIN`` faster than as they are. The stock kernel is a candidate only where the
    dense copies fit in memory (``DENSE_MEMORY_SHARE``). Where MKL's stock kernel wins the one-token
    step it loses the wider verification forwards to oneDNN's packed one (e.g. on an AVX-512 CPU
    without bf16), so the verification forwards stay packed. Decided once per machine, software and
    model shape (cached beside the cost model; a verdict taken while the CPU was busy is measured
    again at rest, see :func:`speculum.machine.measured`), a few seconds for a 1.5B model.
    ``SPECULUM_ROW_PADDING=0`` turns both off, ``=on`` pads and ``=dense`` uses the stock kernel
    without measuring, ``=refresh`` measures again. The padded rows are zeros whose outputs are
    dropped, and plain decoding runs on the same kernels as the forwards of its width in a
    speculative round; the stock and the packed kernel can differ in the last bits of float32, as
    any two kernels do."""
    model = runner.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        return RowPadding(1, "the model is not prepacked")
    if all(m.rows is not None for m in packed):
        return RowPadding(1, "speculum's row kernel runs every row count alike")
    setting = _pad_setting()
    if setting in ("off", "on", "dense"):
        _set_small_forwards(model, {"on": "padded", "dense": "dense"}.get(setting, ""))
        return RowPadding(min_rows(model), f"{PAD_ENV}={os.environ.get(PAD_ENV)}", dense_rows=dense_rows(model))

    def measure() -> dict[str, float]:
        start = time.perf_counter()
        ms = _time_padding(runner, reps, budget_s)
        logger.info("speculum: timed row padding in %.1f s", time.perf_counter() - start)
        return ms

    try:
        verdict = machine.measured(
            _padding_path(runner),
            _PAD_VERSION,
            measure,
            lambda ms: {"ms": ms},
            _decode_padding,
            refresh=setting == "refresh",
            what="row-padding verdict",
        )
    except Exception as error:  # noqa: BLE001 - an optimisation: never a reason to fail a load
        _set_small_forwards(model, "")
        logger.warning("speculum: could not time row padding (%s: %s)", type(error).__name__, error)
        return RowPadding(1, f"measuring failed: {type(error).__name__}")
    ms, cached = verdict.value, verdict.cached
    totals = {
        mode: ms[_label(1, mode)] + ms[_label(2, mode)] for mode in ("", "padded", "dense") if _label(1, mode) in ms
    }
    best = min(totals, key=totals.get)
    if totals[best] >= totals[""] * (1 - PAD_MARGIN) or (best == "dense" and not _dense_copies_fit(model)):
        best = ""
    _set_small_forwards(model, best)
    reason = (
        f"one-token forward {ms['1']:.1f} ms, padded {ms['1 padded']:.1f}; "
        f"two tokens {ms['2']:.1f} ms, padded {ms['2 padded']:.1f}"
    )
    if "1 dense" in ms:
        reason += f"; on the stock kernel {ms['1 dense']:.1f} and {ms['2 dense']:.1f} ms"
    return RowPadding(min_rows(model), reason, dict(ms), cached, dense_rows(model), verdict.describe_provisional())


def _time_padding(runner, reps: int, budget_s: float) -> dict[str, float]:
    model = runner.model
    vocab = output_size(model)
    ids = [(i * 7919 + 10) % vocab for i in range(66)]
    cache = runner.new_cache()
    runner.prefill(cache, ids[:-2])
    past = len(ids) - 2
    modes = ["", "padded"]
    if _dense_copies_fit(model):
        set_dense_rows(model, DENSE_ROWS)  # the dense copies, made once for the measurement
        modes.append("dense")
    times: dict[str, list[float]] = {_label(width, mode): [] for mode in modes for width in (1, 2)}
    start = time.perf_counter()
    try:
        for rep in range(reps + 1):  # the first round warms every shape up
            for mode in modes if rep % 2 else reversed(modes):
                _set_small_forwards(model, mode, keep_copies=True)
                for width in (1, 2):
                    began = time.perf_counter()
                    out = runner.forward(cache, ids[-width:])
                    out.logits[0].argmax()
                    elapsed = time.perf_counter() - began
                    crop(cache, past)
                    if rep:
                        times[_label(width, mode)].append(elapsed)
            if rep and time.perf_counter() - start > budget_s:
                break
    finally:
        _set_small_forwards(model, "")
    return {label: round(statistics.median(values) * 1e3, 3) for label, values in times.items()}


def _padding_path(runner):
    return costs.costs_dir() / f"rows-{costs.machine_key(runner, padding=False)}.json"


def _decode_padding(doc: dict) -> dict[str, float]:
    """The timings of a row-padding cache file (raises ValueError for odd ones)."""
    ms = doc["ms"]
    base = {"1", "1 padded", "2", "2 padded"}
    if not (set(ms) == base or set(ms) == base | {"1 dense", "2 dense"}):
        raise ValueError("unexpected forwards")
    if not all(machine.finite_positive(v) for v in ms.values()):
        raise ValueError("bad timings")
    return {str(k): float(v) for k, v in ms.items()}


def _read_padding(path) -> dict[str, float] | None:
    """The timings cached at ``path``, or None (missing, unreadable, another version)."""
    found = machine.read_cached(path, _PAD_VERSION, _decode_padding, "row-padding verdict")
    return None if found is None else found[0]
