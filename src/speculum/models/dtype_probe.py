"""The dtype probe: how fast float32 and bfloat16 run one model on this CPU, timed and cached.

:func:`speculum.models.dtypes.choose_dtype` decides from these timings; this module takes them. Both
candidates are timed on the model's real shapes, built from its config with random weights before
the model itself loads (the model is then loaded once, in the chosen dtype):

- a stack of k of its decoder layers (k: enough layers that the weights stream from memory as in
  the whole model, at most ~256 MB; a single layer bigger than that is measured as a slice of its
  MLP and heads and scaled up) and its LM head (a slice of at most 64M weights for big vocabularies,
  scaled by rows), in float32 and in bfloat16, each prepacked where ``load`` would prepack it, and
  bfloat16 in exact mode where ``load`` would turn it on (so its cost is part of the choice);
- after 256 cached positions: a one-token decode step and verification forwards of 4 and 8 tokens,
  through the engine's own ``ModelRunner`` (so bfloat16's lazy LM head is priced as the engine runs
  it); the two candidates in interleaved rounds, the fastest of a few repetitions kept;
- a step of the whole model is predicted as the runner's own overhead once, plus
  ``num_hidden_layers / k`` times the stack's layers, plus the head; the figure compared is the
  predicted cost per generated token over a mix of plain and speculative steps (see ``_blend``).

This takes about a second for models of 0.3-1.5B parameters (besides the imports that loading
needs anyway), with fewer repetitions once timing takes over 2 s on a crowded CPU. The timings are
cached in ``<cache_dir>/dtype/`` (:func:`speculum.machine.cache_dir`), keyed by the CPU
(:func:`speculum.machine.cpu_identity`: model name, flags, count), the torch and transformers
versions, the thread count, prepacking and the model's shapes; a cache file that cannot be read is
ignored and the timings measured again. Timings taken while other work kept the CPU busy are
provisional (:func:`speculum.machine.measured`): used, and measured again by a later load that finds
the CPU at rest.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import transformers

from speculum import accel, kernels, machine
from speculum import cache as cache_ops
from speculum import exact as exact_mode
from speculum.runner import ModelRunner

try:
    from transformers.initialization import no_init_weights
except ImportError:  # pragma: no cover - older transformers: weights are initialised, only slower
    no_init_weights = contextlib.nullcontext

# bump when the measurement or the file changes: older timings are then measured again
_CACHE_VERSION = 6
_PAST = 256  # cached positions before the timed steps
_VERIFY = {4: 2, 8: 3}  # verification width -> tokens it is assumed to commit (see _blend)
_REPS = 3  # timed repetitions per shape (after one warm-up); the fastest is kept (other jobs only add time)
_BUDGET_S = 2.0  # fewer repetitions (at least one) once timing has taken this long: a CPU crowded by other jobs
_SMALL_VOCAB = 128  # the stack's own embedding and head: the real LM head is timed on its own
_STACK_MIN_BYTES = 64 << 20  # float32 bytes of layers timed together: more than a CPU cache holds
_STACK_MAX_BYTES = 256 << 20
_HEAD_MAX_WEIGHTS = 64 << 20  # LM-head weights timed; a bigger head is timed on a slice of its rows
_SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "layer_types", "n_inner",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "tie_word_embeddings",
)  # fmt: skip

CacheKey = tuple[str, dict[str, Any]]  # the digest naming the cache file, and what it was made from


def cache_key(config: Any, prepack: bool, exact: bool = False) -> CacheKey:
    """What the timings of the model of ``config`` depend on: the CPU, the libraries, the threads,
    prepacking and the bfloat16 kernel (:mod:`speculum.kernels`), exact mode for bfloat16 and the
    model's shapes (raises for a config without them)."""
    text = _text_config(config)
    inputs = {
        "version": _CACHE_VERSION,
        "cpu": machine.cpu_identity(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "threads": torch.get_num_threads(),
        "prepack": bool(prepack),
        "bf16_kernel": "rows" if kernels.rows_kernel_wanted() else "onednn",
        "exact": bool(exact),
        "model": {name: getattr(text, name, None) for name in _SHAPE_FIELDS},
    }
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest(), inputs


def timings(config: Any, prepack: bool, key: CacheKey, *, refresh: bool = False) -> machine.Measured[dict[str, float]]:
    """Candidate label ("prepacked float32" or "float32", and "bfloat16") -> predicted ms per generated
    token for the model of ``config``: read from the cache file of ``key`` (:func:`cache_key`), or timed
    now and cached there (``refresh``: timed again whatever the cache holds); bfloat16 in exact mode
    (:mod:`speculum.exact`) where ``key`` says so, as ``load`` would run it. The verdict's ``seconds``
    count the timing alone, not importing the model's code, which loading it imports anyway."""
    digest, inputs = key
    spent = 0.0

    def measure() -> dict[str, float]:
        nonlocal spent
        _import_model_code(config)
        t0 = time.perf_counter()
        times = _measure(config, prepack, inputs["exact"])
        spent = time.perf_counter() - t0
        return times

    verdict = machine.measured(
        _cache_path(digest),
        _CACHE_VERSION,
        measure,
        lambda times: {"key": digest, "inputs": inputs, "ms_per_token": times},
        lambda doc: _decode_cached(doc, digest),
        refresh=refresh,
        what="dtype choice",
    )
    return replace(verdict, seconds=spent)


def float32_bytes(config: Any) -> int:
    """Bytes the model of ``config`` takes in float32: its decoder layers, its embeddings and its LM
    head (one matrix where the two are tied)."""
    text = _text_config(config)
    head = int(text.vocab_size) * int(text.hidden_size) * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    return 4 * (int(text.num_hidden_layers) * _layer_params(text) + head)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
    """Import the model's code before the timing starts, so that the time spent measuring counts
    measuring only (lazily: the auto-model mapping costs most of a second to import)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(_text_config(config))]
    except Exception:  # noqa: BLE001 - only a warm-up: measuring imports what it needs anyway
        pass


def _measure(config: Any, prepack: bool, exact: bool = False) -> dict[str, float]:
    """Candidate label -> predicted ms per generated token, for float32 (prepacked if ``prepack``) and bfloat16."""
    with torch.random.fork_rng(devices=[]):  # random weights and inputs: the user's RNG stream is left as it was
        torch.manual_seed(0)
        return _measure_both(_text_config(config), prepack, exact)


def _measure_both(text: Any, prepack: bool, exact: bool) -> dict[str, float]:
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
    half_head = accel.PackedLinear(half_head) if half_packed else half_head
    if exact:  # bfloat16 priced with what exact mode costs: its attention and its split linear layers
        exact_mode.make_exact(half_stack, "timed")
        exact_mode.make_linears_exact(half_head)
    candidates = {
        "prepacked float32" if packed else "float32": _Candidate(stack, accel.PackedLinear(head) if packed else head),
        "bfloat16": _Candidate(half_stack, half_head),
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
    from transformers import AutoModelForCausalLM  # lazily: a second to import, which `import speculum` skips

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
    from transformers import AutoModelForCausalLM  # lazily: a second to import, which `import speculum` skips

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
