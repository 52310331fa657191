"""Choosing a dtype and checking a device: ``dtype="auto"`` picks what is fast on this machine.

On a CPU, ``"auto"`` is decided by measuring, not by CPU flags alone (:func:`choose_dtype`). Native
bfloat16 halves the bytes each decode step streams, but which dtype is faster depends on the model's
shapes and the CPU: before bfloat16 was prepacked for oneDNN as float32 is (``speculum.accel``), Gemma
3 270M (small layers, a 262k-row LM head) decoded ~20% faster in prepacked float32 on the
AVX-512-BF16 CPU measured here and Qwen2.5-Coder 1.5B was a close call; with both prepacked,
bfloat16 ran Gemma's plain decoding 1.5x faster there (issue #18, fourteenth pass). So both
candidates are timed on the model's real shapes, built from its config with random weights before
the model itself loads (the model is then loaded once, in the chosen dtype):

- a stack of k of its decoder layers (k: enough layers that the weights stream from memory as in
  the whole model, at most ~256 MB; a single layer bigger than that is measured as a slice of its
  MLP and heads and scaled up) and its LM head (a slice of at most 64M weights for big vocabularies,
  scaled by rows), in float32 and in bfloat16, each prepacked where ``load`` would prepack it;
- after 256 cached positions: a one-token decode step and verification forwards of 4 and 8 tokens,
  through the engine's own ``ModelRunner`` (so bfloat16's lazy LM head is priced as the engine runs
  it); the two candidates in interleaved rounds, the fastest of a few repetitions kept;
- a step of the whole model is predicted as the runner's own overhead once, plus
  ``num_hidden_layers / k`` times the stack's layers, plus the head; the figure compared is the
  predicted cost per generated token over a mix of plain and speculative steps (see ``_blend``).

This takes about a second for models of 0.3-1.5B parameters (besides the imports that loading
needs anyway), with fewer repetitions once timing passes 2 s on a crowded CPU. The timings are
cached in ``<cache_dir>/dtype/``, keyed by the CPU (:func:`speculum.machine.cpu_identity`: model
name, flags, count), the torch and transformers versions, the thread count, prepacking and the
model's shapes; a cache file that cannot be read is ignored and the choice measured again. Timings
taken while other work kept the CPU busy are provisional (:func:`speculum.machine.measured`): used,
and measured again by a later load that finds the CPU at rest. A float32 model that would take more than
80% of the free memory is loaded in bfloat16 instead (checked on every load). bfloat16 must be
predicted at least 15% faster to be chosen (``_FLOAT32_MARGIN``: its short measurement is optimistic). Set
``SPECULUM_DTYPE_MEASURE=0`` to skip measuring (the flag rule of :func:`resolve_dtype`: bfloat16
wherever the CPU has native bfloat16), e.g. in CI, or ``=refresh`` to measure again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from speculum import machine
from speculum.errors import InvalidInputError
from speculum.machine import available_memory as _available_memory
from speculum.machine import cpu_identity as _cpu_identity

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


# ------------------------------------------------------------------------------------------------ measured "auto"

# bump when the measurement or the file changes: older decisions are then measured again
_CACHE_VERSION = 4
_PAST = 256  # cached positions before the timed steps
_VERIFY = {4: 2, 8: 3}  # verification width -> tokens it is assumed to commit (see _blend)
_REPS = 3  # timed repetitions per shape (after one warm-up); the fastest is kept (other jobs only add time)
_BUDGET_S = 2.0  # fewer repetitions (at least one) once timing has taken this long: a CPU crowded by other jobs
_SMALL_VOCAB = 128  # the stack's own embedding and head: the real LM head is timed on its own
_STACK_MIN_BYTES = 64 << 20  # float32 bytes of layers timed together: more than a CPU cache holds
_STACK_MAX_BYTES = 256 << 20
_HEAD_MAX_WEIGHTS = 64 << 20  # LM-head weights timed; a bigger head is timed on a slice of its rows
# bfloat16 must be predicted this much faster to be chosen. float32 rounds less, and bfloat16's
# measurement is optimistic on a shared CPU: its kernels (compute-bound where float32's stream memory)
# switch between a fast and a slow phase every few seconds (Gemma 3 270M on an AVX-512-BF16 EPYC: one
# token 47-49 ms, then 57-61 ms; float32 steady at 49-51), and a second of timing at start-up tends to
# catch the fast one. There it predicted bfloat16 11% faster, while an interleaved 20-minute run had it
# 0.89x float32 for plain decoding and 0.80x for `auto` (benchmarks/dtype_choice.py, BENCHMARKS.md).
# Where bfloat16 halves the bytes of a memory-bound model (a 7B) or AMX computes it, it should win by more
# than this (not measured here: no such CPU or model on these machines).
_FLOAT32_MARGIN = 0.15
_MEMORY_SHARE = 0.8  # float32 only if the model takes at most this share of the free memory
_SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "sliding_window",
    "layer_types",
    "n_inner",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "tie_word_embeddings",
)


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
) -> DtypeChoice:
    """:func:`resolve_dtype` with the reason, where ``"auto"`` on a CPU is measured for the model of ``config``.

    Explicit dtypes are returned as they are; CUDA gets bfloat16 where supported, else float16. On a
    CPU without native bfloat16 it is float32 (bfloat16 would be emulated). Otherwise float32
    (prepacked if ``prepack``) and bfloat16 are timed on the model's shapes (see the module's docstring)
    and the faster one chosen, once per machine, software and model shape (cached). Without a
    ``config`` (a transformers config, or a function returning one when needed), with ``measure=False``
    or ``SPECULUM_DTYPE_MEASURE=0``: bfloat16, by the CPU flag. ``SPECULUM_DTYPE_MEASURE=refresh``
    measures again and replaces the cached decision (e.g. one measured while other jobs loaded the CPU).
    A measurement that fails falls back on the flag rule too: loading never fails for it.
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
        key, inputs = _cache_key(config, prepack)
    except Exception as error:  # noqa: BLE001 - an odd config: no caching, no measuring (the load reports it)
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (not measured: {type(error).__name__})")

    def measure() -> dict[str, float]:
        _import_model_code(config)  # what loading the model imports anyway: not counted as measuring
        t0 = time.perf_counter()
        times = _measure(config, prepack)
        spent[0] = time.perf_counter() - t0
        return times

    spent = [0.0]
    try:
        verdict = machine.measured(
            _cache_path(key),
            _CACHE_VERSION,
            measure,
            lambda times: {"key": key, "inputs": inputs, "ms_per_token": times},
            lambda doc: _decode_cached(doc, key),
            refresh=setting == "refresh",
            what="dtype choice",
        )
    except Exception as error:  # noqa: BLE001 - measuring is an optimisation: never a reason to fail a load
        logger.warning("speculum: could not time dtypes for this model (%s: %s)", type(error).__name__, error)
        return DtypeChoice(torch.bfloat16, f"{flag_rule} (measuring failed: {type(error).__name__})")
    choice = _decide(verdict.value, verdict.cached, spent[0])
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
        text = _text_config(config)
        head = int(text.vocab_size) * int(text.hidden_size) * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        need = 4 * (int(text.num_hidden_layers) * _layer_params(text) + head)
    except Exception:  # noqa: BLE001 - no estimate, no override
        return choice
    if need <= _MEMORY_SHARE * free:
        return choice
    why = f"; float32 would take {need / 2**30:.1f} of {free / 2**30:.1f} GiB of free memory: bfloat16"
    return replace(choice, dtype=torch.bfloat16, reason=choice.reason + why)


def _decide(times: dict[str, float], cached: bool, seconds: float) -> DtypeChoice:
    """The faster candidate of ``times`` (label -> ms per token), float32 unless bfloat16 wins clearly."""
    f32_label = next(label for label in times if label != "bfloat16")
    f32, bf16 = times[f32_label], times["bfloat16"]
    dtype = torch.bfloat16 if bf16 < f32 * (1 - _FLOAT32_MARGIN) else torch.float32
    reason = f"auto: {f32_label} {_ms(f32)} ms/token vs bfloat16 {_ms(bf16)} ms/token on this CPU"
    if dtype is torch.float32 and bf16 < f32:
        reason += f" (within {_FLOAT32_MARGIN:.0%}: float32 kept)"
    return DtypeChoice(dtype, reason, ms_per_token=dict(times), cached=cached, seconds=seconds)


def _ms(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _cache_key(config: Any, prepack: bool) -> tuple[str, dict[str, Any]]:
    import transformers

    text = _text_config(config)
    inputs = {
        "version": _CACHE_VERSION,
        "cpu": _cpu_identity(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "threads": torch.get_num_threads(),
        "prepack": bool(prepack),
        "model": {name: getattr(text, name, None) for name in _SHAPE_FIELDS},
    }
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest(), inputs


def _cache_path(key: str):
    return machine.cache_dir() / "dtype" / f"{key[:32]}.json"


def _decode_cached(doc: dict[str, Any], key: str) -> dict[str, float]:
    """The timings of a cache file written for ``key`` (raises ValueError for another key or odd ones)."""
    times = doc["ms_per_token"]
    if doc.get("key") != key or not isinstance(times, dict):
        raise ValueError("another key")
    if "bfloat16" not in times or len(times) != 2:
        raise ValueError("unexpected candidates")
    if not all(machine.finite_positive(v) for v in times.values()):
        raise ValueError("bad timings")
    return {str(label): float(ms) for label, ms in times.items()}


def _blend(step_ms: dict[int, float]) -> float:
    """Predicted ms per generated token from the step times ``{width: ms}``.

    What a dtype costs depends on what is decoded: plain decoding (and every round where speculation
    does not pay and the engine steps plainly) pays the one-token step per token; speculation pays a
    verification of several tokens for the ones it commits. The two do not rank dtypes alike:
    prepacked float32 keeps 1..8 rows nearly flat while bfloat16's cost may grow with the rows. So
    the figure weighs half the tokens as plain steps and half as speculative rounds, split between a
    4-token verification committing 2 tokens and an 8-token one committing 3 (typical acceptance of
    the n-gram and draft-model methods here; ``_VERIFY``).
    """
    speculative = [step_ms[width] / committed for width, committed in _VERIFY.items()]
    return 0.5 * step_ms[1] + 0.5 * sum(speculative) / len(speculative)


def _import_model_code(config: Any) -> None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from speculum import accel, runner  # noqa: F401

        MODEL_FOR_CAUSAL_LM_MAPPING[type(_text_config(config))]
    except Exception:  # noqa: BLE001 - only a warm-up: measuring imports what it needs anyway
        pass


def _measure(config: Any, prepack: bool) -> dict[str, float]:
    """Candidate label -> predicted ms per generated token, for float32 (prepacked if ``prepack``) and bfloat16."""
    with torch.random.fork_rng(devices=[]):  # random weights and inputs: the user's RNG stream is left as it was
        torch.manual_seed(0)
        return _measure_both(_text_config(config), prepack)


def _measure_both(text: Any, prepack: bool) -> dict[str, float]:
    from speculum import accel

    with torch.no_grad():
        stack, layer_scale = _build_stack(text)
        hidden, vocab = int(text.hidden_size), int(text.vocab_size)
        rows = max(1, min(vocab, _HEAD_MAX_WEIGHTS // hidden))
        head = torch.nn.Linear(hidden, rows, bias=False, device="meta")
        head.weight = torch.nn.Parameter(_fill_random_(torch.empty(rows, hidden)), requires_grad=False)
        half_stack, half_head = copy.deepcopy(stack).to(torch.bfloat16), copy.deepcopy(head).to(torch.bfloat16)
    shape = _Shape(int(text.num_hidden_layers) / layer_scale, vocab / rows, hidden)
    packed = bool(prepack) and accel.prepack(stack) > 0
    # bfloat16 as ``load`` runs it: prepacked too where the CPU computes it natively
    half_packed = bool(prepack) and accel.prepack(half_stack) > 0
    candidates = {
        "prepacked float32" if packed else "float32": _Candidate(stack, accel.PackedLinear(head) if packed else head),
        "bfloat16": _Candidate(half_stack, accel.PackedLinear(half_head) if half_packed else half_head),
    }
    del head
    try:
        # interleaved rounds (one warm-up): a phase where other jobs load the CPU slows both alike
        order = list(candidates.values())
        start = time.perf_counter()
        for round_ in range(_REPS + 1):
            for candidate in order if round_ % 2 else reversed(order):
                candidate.time_round(record=round_ > 0)
            if round_ and time.perf_counter() - start > _BUDGET_S:
                break
        return {label: round(_blend(c.step_ms(shape)), 4) for label, c in candidates.items()}
    finally:
        for candidate in candidates.values():
            candidate.close()


@dataclass
class _Shape:
    layers: float  # how many times the stack's layers the whole model holds
    head_rows: float  # how many times the timed head slice the whole LM head is
    hidden: int


def _fill_random_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` with small random values, fast: one random block tiled over it in place (the
    values do not change the timings; only denormals or NaNs from uninitialised memory could)."""
    if tensor.numel() == 0 or not tensor.is_contiguous():
        return tensor.normal_(0.0, 0.02)
    flat = tensor.view(-1)
    block = torch.randn(min(flat.numel(), 1 << 16), dtype=tensor.dtype) * 0.02
    whole = flat.numel() // block.numel() * block.numel()
    flat[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    flat[whole:].copy_(block[: flat.numel() - whole])
    return tensor


def _stack_config(text: Any, layers: int, **changes: Any) -> Any:
    cfg = copy.deepcopy(text)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:layers])
    cfg.vocab_size = _SMALL_VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if value is not None and not (isinstance(value, int) and value < _SMALL_VOCAB):
            setattr(cfg, name, None)
    for name, value in changes.items():
        setattr(cfg, name, value)
    return cfg


def _layer_params(cfg: Any) -> int:
    """Parameters of one decoder layer of ``cfg`` (built on the meta device: no memory, no time)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_stack_config(cfg, 1))
    layers = _decoder_layers(model, 1)
    return sum(p.numel() for p in (layers or model).parameters())


def _sliced(text: Any, fraction: float) -> dict[str, Any]:
    """Config changes that keep about ``fraction`` of a layer's weights: a slice of its MLP and of its
    attention heads (head_dim and the grouping of query heads per key/value head kept)."""
    changes: dict[str, Any] = {}
    for name in ("intermediate_size", "moe_intermediate_size"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            changes[name] = max(8, int(value * fraction))
    if getattr(text, "model_type", "") == "gpt2":
        changes["n_inner"] = max(8, int((text.n_inner or 4 * text.hidden_size) * fraction))
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv == 0:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        new_kv = max(1, round(kv * fraction))
        changes.update(num_key_value_heads=new_kv, num_attention_heads=new_kv * (heads // kv), head_dim=head_dim)
    return changes


def _build_stack(text: Any) -> tuple[torch.nn.Module, float]:
    """A model of k of ``text``'s decoder layers with a tiny vocabulary and random weights, and how
    many layers of the real model its layers stand for (k, or less for a slice of one big layer)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers: weights are initialised, only slower
        import contextlib

        no_init_weights = contextlib.nullcontext
    total_layers = int(text.num_hidden_layers)
    full = _layer_params(text)
    layer_bytes = 4 * full
    changes: dict[str, Any] = {}
    if layer_bytes > _STACK_MAX_BYTES:
        k = 1
        changes = _sliced(text, _STACK_MAX_BYTES / layer_bytes)
    else:
        k = max(1, min(total_layers, -(-_STACK_MIN_BYTES // layer_bytes), _STACK_MAX_BYTES // layer_bytes))
    cfg = _stack_config(text, k, **changes)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for tensor in model.parameters():
            _fill_random_(tensor)
    model.eval()
    model.requires_grad_(False)
    layers = _decoder_layers(model, k)
    timed = sum(p.numel() for p in (layers or model).parameters())
    # k layers stand for k layers; a slice of one layer for the fraction of its weights it holds
    return model, timed / full if changes else float(k)


def _decoder_layers(model: torch.nn.Module, k: int) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers: the outermost ModuleList of k modules."""
    found = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == k:
            if found is None or name.count(".") < found[0].count("."):
                found = (name, module)
    return found[1] if found else None


class _Candidate:
    """One dtype's stack of layers and LM head, ready to time steps after ``_PAST`` cached positions
    through the engine's own ``ModelRunner``."""

    def __init__(self, stack: torch.nn.Module, head: torch.nn.Module):
        from speculum.runner import ModelRunner

        self.runner = ModelRunner(stack)
        self.head = head
        self.dtype = next(stack.parameters()).dtype
        self.total = {width: math.inf for width in (1, *_VERIFY)}  # best seconds of a whole stack forward
        self.layers = dict(self.total)  # ... of its decoder layers alone
        # the LM head over every verified row; with a lazy head (half precision on a CPU) one row at a
        # time, for each token the verifier reads, i.e. each committed token (timed as one row)
        self.head_rows = (1,) if self.runner.lazy_head else tuple(self.total)
        self.head_best = {rows: math.inf for rows in self.head_rows}
        self.marks: dict[str, float] = {}
        self.hooks = []
        layers = _decoder_layers(stack, int(stack.config.num_hidden_layers))
        if layers is not None:
            mark = self.marks.__setitem__
            self.hooks.append(layers[0].register_forward_pre_hook(lambda *a: mark("start", time.perf_counter())))
            self.hooks.append(layers[-1].register_forward_hook(lambda *a: mark("end", time.perf_counter())))
        hidden = head.in_features
        self.inputs = {rows: torch.randn(rows, hidden).to(self.dtype) for rows in self.head_rows}
        self.past = min(_PAST, (self.runner.max_positions or _PAST + max(_VERIFY)) - max(_VERIFY))
        with torch.inference_mode():
            self.cache = self.runner.new_cache()
            self.runner.prefill(self.cache, [3 + i % (_SMALL_VOCAB - 3) for i in range(min(16, self.past))])
            for layer in self.cache.layers:  # the cached keys and values tiled to `past` positions
                reps = -(-self.past // layer.keys.shape[-2])
                layer.keys = layer.keys.repeat(1, 1, reps, 1)[..., : self.past, :].contiguous()
                layer.values = layer.values.repeat(1, 1, reps, 1)[..., : self.past, :].contiguous()

    @torch.inference_mode()
    def time_round(self, record: bool = True) -> None:
        """Time one forward of each width and one head call of each row count, keeping the fastest."""
        from speculum import cache as cache_ops

        for width in self.total:
            ids = [3 + i % (_SMALL_VOCAB - 3) for i in range(width)]
            t0 = time.perf_counter()
            self.runner.forward(self.cache, ids)
            total = time.perf_counter() - t0
            cache_ops.crop(self.cache, self.past)
            if record:
                self.total[width] = min(self.total[width], total)
                span = self.marks["end"] - self.marks["start"] if self.hooks else total
                self.layers[width] = min(self.layers[width], span)
        for rows, x in self.inputs.items():
            t0 = time.perf_counter()
            self.head(x)
            if record:
                self.head_best[rows] = min(self.head_best[rows], time.perf_counter() - t0)

    def step_ms(self, shape: _Shape) -> dict[int, float]:
        """Predicted ms of a whole-model step over 1 and ``_VERIFY`` tokens: the runner's own work
        (embedding, masks, final norm) once, the layers scaled to the model's, and its LM head."""
        step = {}
        for width, total in self.total.items():
            layers = self.layers[width]
            if self.runner.lazy_head:
                head = self.head_best[1] * _VERIFY.get(width, 1)
            else:
                head = self.head_best[width]
            step[width] = 1000 * (total - layers + layers * shape.layers + head * shape.head_rows)
        return step

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
