"""The cost model: what one target forward over an n-node tree costs on this machine.

One model serves the engine's controller, ``speculum tune`` and the studies scripts:

- **Measured** once for the loaded model, dtype, device and thread count (:meth:`CostModel.measure`:
  a few forwards over trees of 1..64 nodes, the sizes interleaved, after a cache of a typical
  prompt length, a few seconds; both cut to fit a short context), and cached on disk
  (:func:`measured_cost_model`) under a key that another CPU, model, dtype, attention
  implementation, LM-head mode, device, thread count or library version never shares. A curve
  measured while the CPU was busy is provisional: measured again by a later load at rest
  (:func:`speculum.machine.measured`).
- **Refined online** (:meth:`CostModel.observe`): every verification forward the engine runs is a
  free sample. Each sample updates a correction factor for its size bucket (an exponential moving
  average of measured / predicted), so the curve follows a machine that got busier, a cache that
  grew long, or a CPU whose measurement was noisy, without forgetting its shape. A curve that reads
  several times off the forwards actually timed (measured while another process held the cores) is
  rescaled whole after a few forwards, and its cache file dropped so the next load measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from speculum import machine
from speculum.accel import dense_rows, min_rows
from speculum.cache import crop
from speculum.errors import SpeculumError
from speculum.exact import EXACT_ATTENTION
from speculum.kernels import attention as attention_kernel
from speculum.kernels import quant
from speculum.tree import TokenTree

log = logging.getLogger("speculum")

FORMAT = "speculum-costs"
VERSION = 4  # bumped when the measurement, its key or the file changes: older curves are measured again
SIZES = (1, 2, 4, 8, 16, 32, 64)  # tree sizes (root included) measured
PREFIX = 256  # tokens of the default probe context (one is the root of the timed trees)
# A forward this many times off its prediction is not noise but a curve measured in another machine
# state: a CPU oversubscribed by a second process reads several times slow, while a cold first
# forward or a busy phase reads at most about twice.
GROSS = 3.0
GROSS_RUN = 3  # consecutive gross samples (the same way) that rescale the curve


def size_bucket(n: int) -> int:
    """The size bucket of an n-node forward: powers of two (1, 2, 3-4, 5-8, ...)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclass
class CostModel:
    """t(n): seconds of one target forward (and commit) over an n-node tree (root included), from
    measured points interpolated linearly (extrapolated from the last two beyond), times an online
    correction per size bucket."""

    points: list[tuple[int, float]]
    smoothing: float = 0.1  # weight of each new online sample
    correction: dict[int, float] = field(default_factory=dict)  # size bucket -> measured / base
    # (rows bucket, size bucket) -> measured / base(rows * size), for forwards over a batch
    batch_correction: dict[tuple[int, int], float] = field(default_factory=dict)
    # the disk cache it was read from or written to (dropped when the curve is found grossly slow)
    path: Path | None = field(default=None, repr=False, compare=False)
    _gross: list[float] = field(default_factory=list, repr=False, compare=False)  # a run of gross seconds / base
    _gross_slow: bool = field(default=False, repr=False, compare=False)  # that run's way: slower than the curve
    _gross_factor: float = field(default=1.0, repr=False, compare=False)  # the correction when it began
    _scaled: float = field(default=1.0, repr=False, compare=False)  # the rescales' product since it was read
    # where measured_cost_model got it ("" for a curve built otherwise), and "" or why it is provisional
    origin: str = field(default="", repr=False, compare=False)
    provisional: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        # Past one token a bigger forward never costs less, so a point above a larger size's is noise
        # (another process took the core for a moment: noise on a timing is always upward): lower it
        # to that one, or one slow sample at t(4) makes 4 nodes look dearer than 8 and the controller
        # prunes every draft to 2 nodes. t(1) stays as measured: one token runs other kernels
        # (matrix-vector), and in bfloat16 on an AVX-512-BF16 CPU it can really be dearer than two.
        # Models whose small forwards pay for that are padded to 4 rows
        # (speculum.row_padding.choose_row_padding), which makes 1-4 nodes cost alike, as the
        # envelope assumes; where they are not, the online correction of t(2)'s own size bucket
        # learns what the envelope lowered.
        envelope: list[tuple[int, float]] = []
        for n, t in sorted(self.points, reverse=True):
            envelope.append((n, t if not envelope or n == 1 else min(t, envelope[-1][1])))
        self.points = envelope[::-1]

    def base(self, n: int) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    def __call__(self, n: int) -> float:
        return self.base(n) * self._factor(size_bucket(n))

    def _factor(self, bucket: int) -> float:
        if bucket in self.correction:
            return self.correction[bucket]
        if not self.correction:
            return 1.0
        # an unseen size: the nearest observed bucket's factor (the machine's load moves them together)
        nearest = min(self.correction, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        return self.correction[nearest]

    def observe(self, n: int, seconds: float) -> None:
        """A forward over ``n`` nodes took ``seconds``: move that size's correction towards it."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        bucket = size_bucket(n)
        ratio = seconds / max(self.base(n), 1e-9)
        # a bucket's first sample moves the factor it had (the nearest bucket's, or the measured
        # curve's 1.0) like any other, instead of replacing it: the first forward of a process after
        # a prefill can take twice its time, and taken whole it would make every size one plain step
        # dearer for the next ~20 forwards (the controller would then see drafting win where it loses)
        old = self._factor(bucket)
        self.correction[bucket] = old + self.smoothing * (ratio - old)
        self._check_scale(ratio, old)

    def _check_scale(self, ratio: float, factor: float) -> None:
        """Rescale the whole curve when forwards keep landing ``GROSS`` times off it (``ratio``: this
        sample against the measured curve, ``factor``: the correction it was predicted with). The
        smoothed correction would take ~30 forwards to get there, and until then the controller
        judges drafting against a plain step as dear as the stale curve says (and drafts in rounds
        where plain decoding is faster)."""

        def gross(off: float, slow: bool) -> bool:
            return off >= GROSS if slow else off <= 1.0 / GROSS

        # a run is judged against the factor it began with (the correction moves meanwhile)
        if self._gross and gross(ratio / self._gross_factor, self._gross_slow):
            self._gross.append(ratio)
        else:
            self._gross.clear()
            slow = ratio > factor
            if not gross(ratio / max(factor, 1e-12), slow):
                return
            self._gross, self._gross_factor, self._gross_slow = [ratio], factor, slow
        if len(self._gross) < GROSS_RUN:
            return
        scale = statistics.median(self._gross)
        self._gross.clear()
        self.points = [(n, t * scale) for n, t in self.points]
        self.correction.clear()
        self.batch_correction = {k: f / scale for k, f in self.batch_correction.items()}
        log.info("speculum: verification costs rescaled by %.3g (the measured curve was off what forwards take)", scale)
        self._scaled *= scale
        # grossly faster than the file says: it was measured under load; measure again at the next load
        # (a curve rescaled up while another process ran and back down after is the file's own)
        if self._scaled <= 1.0 / GROSS and self.path is not None:
            self.path.unlink(missing_ok=True)
            log.info("speculum: dropped the stale cost file %s", self.path)
            self.path = None

    def batch(self, rows: int, n: int) -> float:
        """T(rows, n): one forward over ``rows`` trees padded to ``n`` nodes each. Before any batch was
        seen, what ``rows * n`` nodes of one tree cost (the weights are read once either way; each
        row's attention over its own cache is what differs); then corrected online per (rows, size)
        bucket, as :meth:`observe_batch` learns it."""
        if rows <= 1:
            return self(n)
        key = (size_bucket(rows), size_bucket(n))
        factor = self.batch_correction.get(key)
        if factor is None:
            same_rows = [k for k in self.batch_correction if k[0] == key[0]]
            near = min(same_rows, key=lambda k: abs(math.log2(k[1]) - math.log2(key[1])), default=None)
            factor = self.batch_correction[near] if near is not None else 1.0
        return self.base(rows * n) * factor

    def observe_batch(self, rows: int, n: int, seconds: float) -> None:
        """A forward over ``rows`` trees of ``n`` nodes (padded) took ``seconds``."""
        if rows <= 1:
            self.observe(n, seconds)
            return
        if seconds <= 0 or not math.isfinite(seconds):
            return
        key = (size_bucket(rows), size_bucket(n))
        ratio = seconds / max(self.base(rows * n), 1e-9)
        old = self.batch_correction.get(key)
        self.batch_correction[key] = ratio if old is None else old + self.smoothing * (ratio - old)

    def with_plain_step(self, seconds: float) -> CostModel:
        """This curve with t(1) replaced by a measured plain-decoding cost per token."""
        return CostModel([(1, seconds)] + [pt for pt in self.points if pt[0] > 1], self.smoothing)

    def describe(self) -> str:
        """One line for ``speculum generate --stats``: a few points and where the curve came from."""
        shown = ", ".join(f"t({n}) {t * 1000:.3g} ms" for n, t in self.points if n in (1, 4, 16, 64))
        how = "; ".join(part for part in (self.origin, self.provisional) if part)
        return f"{shown} ({how})" if how else shown

    @property
    def plain_step(self) -> float:
        """t(1): one token, what plain decoding pays per token."""
        return self(1)

    @classmethod
    def measure(cls, runner, prefix_ids: list[int], sizes: Sequence[int] = SIZES, reps: int = 5) -> CostModel:
        """Median time of ``reps`` forwards per size after a cache holding ``prefix_ids`` (cut to fit
        the model's context: see :func:`fitting`), the sizes interleaved (one forward of each size
        per repetition, after one warm-up round). Interleaving matters: a CPU has slow phases of
        seconds (bfloat16 on AVX-512-BF16, or another process), and timing each size in a block of
        its own puts a whole phase on one size (a t(1) read in a slow phase makes drafting look like
        a win where it is slower than plain decoding). Sizes past 1 are two chains below the root,
        so the tree mask is paid as in real drafts."""
        prefix_ids, sizes = fitting(getattr(runner, "max_positions", None), prefix_ids, sizes)
        cache = runner.new_cache()
        runner.prefill(cache, prefix_ids[:-1])
        past = len(prefix_ids) - 1
        trees = {n: two_branch_tree(prefix_ids, n) for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for rep in range(reps + 1):
            for n in sizes:
                start = time.perf_counter()
                out = runner.forward(cache, trees[n])
                out.logits[0].argmax()  # the verifier reads at least the root's row
                elapsed = time.perf_counter() - start
                crop(cache, past)
                if rep:  # the first round warms every size up
                    times[n].append(elapsed)
        return cls([(n, statistics.median(times[n])) for n in sizes])

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "points": [[n, t] for n, t in self.points]}

    @classmethod
    def from_dict(cls, doc: dict) -> CostModel:
        """The curve of ``doc`` (:meth:`to_dict`); raises :class:`CostFileError` for anything else,
        among which a curve of fewer than two sizes, which ``base`` could not interpolate."""
        try:
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise CostFileError("not a speculum cost file of this version")
            points = sorted((int(n), float(t)) for n, t in doc["points"])
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            if isinstance(error, CostFileError):
                raise
            raise CostFileError(f"not a cost curve: {error}") from error
        if any(n < 1 or t <= 0 or not math.isfinite(t) for n, t in points):
            raise CostFileError("bad points: sizes from 1, finite positive times")
        if len({n for n, _ in points}) != len(points) or len(points) < 2:
            raise CostFileError(f"a cost curve needs two sizes or more, each once; got {[n for n, _ in points]}")
        return cls(points)


class CostFileError(SpeculumError, ValueError):
    """A cost curve (a cache file's) that cannot be used: another format or version, bad numbers, or fewer
    than two sizes. A cache file holding one is measured again."""


def fitting(max_positions: int | None, prefix_ids: list[int], sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """The probe context and tree sizes cut to fit a context of ``max_positions``: the prefix keeps at
    least half of it, sizes past the other half are dropped, and the prefix is then cut so that the
    largest tree left fits after it (models with learned positions index past their table otherwise)."""
    sizes = sorted(sizes)
    if not max_positions:
        return list(prefix_ids), sizes
    kept = [n for n in sizes if n <= max(max_positions // 2, 2)] or sizes[:2]
    # the prefix's last token is the trees' root: its cache holds len(prefix) - 1 positions
    room = max(max_positions - max(kept) + 1, 2)
    return list(prefix_ids[-room:]), kept


def two_branch_tree(ids: list[int], n: int):
    """An n-node tree (root included) of two chains below the root (a chain would take the cheaper
    causal path, which real trees do not)."""
    tokens = [ids[-1]] + [ids[i % len(ids)] for i in range(n - 1)]
    second = 1 + n // 2  # the second chain starts here (nodes 1..second-1 are the first)
    parents = [-1] + [0 if i in (1, second) else i - 1 for i in range(1, n)]
    return TokenTree(tokens, parents)


# ---------------------------------------------------------------------------------- the disk cache


def costs_dir() -> Path:
    """Where measured curves and row-padding verdicts are cached: ``costs/`` under
    :func:`speculum.machine.cache_dir`."""
    return machine.cache_dir() / "costs"


def _exact_padded(model) -> tuple:
    """The linear layers exact mode pads (:class:`speculum.exact.ExactChoice`), () where none or off."""
    return getattr(getattr(model, "_speculum_exact", None), "padded", ())


def _gguf_formats(model) -> list[str]:
    """The GGUF block types a model computes on as they are (quantization="gguf"), sorted."""
    return sorted({m.format for m in model.modules() if hasattr(m, "packed") and hasattr(m, "format")})


def machine_key(runner, *, padding: bool = True) -> str:
    """What a measured curve depends on: the model's shape and dtype, its attention implementation
    (exact mode's: on speculum's kernel or in float64),
    whether its LM head runs lazily, whether it is prepacked (on speculum's row kernel or oneDNN, its
    small forwards padded or on the stock kernel, unless ``padding=False``: the key of that decision
    itself), the linear layers exact mode pads, the GGUF block types computed as they are (and the kernel's
    source), the device, threads, the CPU
    (:func:`speculum.machine.cpu_identity`) and library versions."""
    model = runner.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shape = {
        k: getattr(config, k, None)
        for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "head_dim")
    }  # fmt: skip
    packed = any(type(m).__name__ != "Linear" and "Linear" in type(m).__name__ for m in model.modules())
    attention = getattr(model.config, "_attn_implementation", None)
    device = runner.input_device
    if device.type == "cuda":
        accelerator = torch.cuda.get_device_name(device)
    else:
        accelerator = json.dumps(machine.cpu_identity(), sort_keys=True)
    parts = [
        f"version={VERSION}",
        json.dumps(shape, sort_keys=True),
        str(runner.dtype),
        f"attention={attention}" + (f"@{attention_kernel.implementation()}" if attention == EXACT_ATTENTION else ""),
        f"lazy_head={getattr(runner, 'lazy_head', None)}",
        f"packed={packed}"
        + (f",rows={min_rows(model)}" if padding and min_rows(model) > 1 else "")
        + (f",dense={dense_rows(model)}" if padding and dense_rows(model) else "")
        + (",kernel=rows" if any(getattr(m, "kernel", "") == "rows" for m in model.modules()) else "")
        + (f",exact_padded={exact_padded}" if (exact_padded := _exact_padded(model)) else "")
        + (f",gguf={quantized}@{quant.source_digest()}" if (quantized := _gguf_formats(model)) else ""),
        str(device),
        f"threads={torch.get_num_threads()}",
        accelerator,
        torch.__version__,
        transformers.__version__,
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def measured_cost_model(runner, prefix_ids: list[int] | None = None, *, refresh: bool = False) -> CostModel:
    """The cost model of ``runner``'s model on this machine: from the disk cache when this exact
    setting was measured before (and not while the CPU was busy, unless it still is), else measured
    now (a few seconds) and cached. A cache file that cannot be read is measured again, never an error."""
    if prefix_ids is None:  # a typical chat-length context: costs grow a little with the cache
        vocab = runner.model.get_input_embeddings().num_embeddings
        prefix_ids = [(i * 7919 + 10) % vocab for i in range(PREFIX)]

    def measure() -> CostModel:
        start = time.perf_counter()
        model = CostModel.measure(runner, prefix_ids)
        log.info(
            "speculum: measured verification costs in %.1f s: %s",
            time.perf_counter() - start,
            ", ".join(f"t({n})={t * 1000:.1f} ms" for n, t in model.points),
        )
        return model

    verdict = machine.measured(
        costs_dir() / f"{machine_key(runner)}.json",
        VERSION,
        measure,
        CostModel.to_dict,
        CostModel.from_dict,
        refresh=refresh,
        what="cost curve",
    )
    model = verdict.value
    model.path, model.provisional = verdict.path, verdict.describe_provisional()
    model.origin = "measured earlier, cached" if verdict.cached else f"measured in {verdict.seconds:.1f} s"
    if verdict.cached:
        log.debug("speculum: verification costs from %s", verdict.path)
    return model
