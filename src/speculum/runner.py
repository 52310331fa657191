"""ModelRunner: runs one model (the target, or a draft model that drafts with trees) over a token tree.

Everything model-specific about a forward lives here, so the loop, the verifier and the drafters
never touch attention masks or devices:

- chains go through the model's own causal masking (the same code path as plain decoding); trees
  get an explicit additive mask (the cached prefix plus each node's ancestors) and per-node
  position ids;
- sliding windows are applied per layer the way the modeling code does: ``config.layer_types``
  where the model has it (Gemma 3, Qwen2, ...: one mask per layer type), otherwise
  ``config.sliding_window`` on every layer (Mistral, Mixtral, Phi-3, Starcoder2, ...);
- tree masks need SDPA or eager attention: a model loaded with another implementation (flash
  attention, flex, ...) is switched to SDPA once, with a warning, or refused;
- inputs go to the device of the input embeddings and logits come back on the device of the LM
  head, also for models split over several devices by accelerate (``device_map``);
- the last hidden state (the LM head's input) is returned when asked for, from the same forward;
  for architectures whose logits are exactly ``head(hidden)`` the head runs separately, on the
  rows needed only (``LazyLogits``), otherwise ``output_hidden_states`` supplies it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from itertools import chain

import torch

from speculum import cache as cache_ops
from speculum import exact
from speculum.errors import InvalidInputError
from speculum.exact import EXACT_ATTENTION
from speculum.tree import TokenTree

logger = logging.getLogger(__name__)

TREE_ATTENTION = ("sdpa", "eager", EXACT_ATTENTION)  # implementations that take an explicit 4D float mask
# Architectures whose logits are exactly lm_head(model(x)) (Gemma adds soft-capping, handled below).
PLAIN_HEAD = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "phi3",
    "starcoder2",
    "gemma",
    "gemma2",
    "gemma3_text",
}


def with_cache(module: torch.nn.Module, cache) -> dict:
    """The keyword that hands ``module`` its KV cache: ``cache`` since transformers 5.24, which
    deprecates ``past_key_values`` (with a warning on every first call); older versions only know
    ``past_key_values``."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # read once per model class: inspecting a signature on every forward would tax each token
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@dataclass
class StepOutput:
    """What one forward over a tree gives back."""

    logits: torch.Tensor | LazyLogits  # [n, vocab]: row i predicts the token after node i
    hidden: torch.Tensor | None = None  # [n, hidden]: the last hidden state (LM head input), when asked for


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's hook device if it has one, else its weights' device."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    for tensor in chain(module.parameters(), module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def has_plain_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its LM head applied to ``model.model``'s output (so the head
    can run separately, on chosen rows)."""
    plain = model.config.model_type in PLAIN_HEAD and hasattr(model, "model")
    return plain and model.get_output_embeddings() is not None


def attention_windows(config) -> dict[str, int | None]:
    """Each kind of attention layer the model has -> its sliding window (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:  # the modeling code applies config.sliding_window (if any) to every layer
        return {"full_attention": window}
    kinds = set(layer_types)
    unsupported = kinds - {"full_attention", "sliding_attention"}
    if unsupported:
        raise InvalidInputError(f"layer types {sorted(unsupported)} are not supported for tree verification yet")
    return {kind: window if kind == "sliding_attention" else None for kind in kinds}


def ensure_tree_attention(model: torch.nn.Module) -> None:
    """Tree masks need SDPA or eager attention: switch the model to SDPA if it uses something else."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl in TREE_ATTENTION:
        return
    try:
        model.set_attn_implementation("sdpa")
    except Exception as error:  # noqa: BLE001 - any failure means we cannot verify trees on it
        raise InvalidInputError(
            f"the model uses attention implementation {impl!r}, which cannot take tree attention masks, and "
            f"switching it to 'sdpa' failed ({error}); load it with attn_implementation='sdpa'"
        ) from None
    if model.config._attn_implementation not in TREE_ATTENTION:
        raise InvalidInputError(
            f"the model uses attention implementation {impl!r}, which cannot take tree attention masks; "
            "load it with attn_implementation='sdpa'"
        )
    logger.warning("speculum: switched attention from %r to 'sdpa' (tree verification needs explicit masks)", impl)


# a half-precision LM head on a CPU is computed lazily (row by row along the verifier's path) where 8
# rows of a head-sized linear layer cost more than this many times one row
LAZY_HEAD_ROWS_RATIO = 3.0


@functools.cache
def half_rows_cost_ratio(dtype: torch.dtype, threads: int) -> float:
    """What a ``dtype`` linear layer over 8 rows costs against one row on this CPU with ``threads``
    threads: a 32k x 1024 weight (64 MB in bf16: beyond the caches, as an LM head is), best of
    three after a warm-up, measured once per process (~0.1 s)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32768, 1024, generator=generator).to(dtype)

    def best(rows: int) -> float:
        x = torch.randn(rows, 1024, generator=generator).to(dtype)
        times = []
        with torch.inference_mode():
            for _ in range(4):
                began = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                times.append(time.perf_counter() - began)
        return min(times[1:])

    return best(8) / max(best(1), 1e-9)


class ModelRunner:
    """Runs ``model`` over token trees after its cached prefix (target and draft models alike)."""

    def __init__(self, model: torch.nn.Module, lazy_head: bool | None = None):
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        ensure_tree_attention(model)
        self.windows = attention_windows(config)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.input_device = execution_device(model.get_input_embeddings())
        head = model.get_output_embeddings()
        self.output_device = execution_device(head) if head is not None else self.input_device
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.split_head = has_plain_head(model)
        self.lazy_head = lazy_head if lazy_head is not None else self._lazy_head_pays()
        if self.lazy_head and not self.split_head:
            raise InvalidInputError(f"lazy_head needs a plain LM head; {model.config.model_type} has another")

    def _lazy_head_pays(self) -> bool:
        """Compute LM-head rows only along the path the verifier walks, instead of for the whole tree?

        Worth it where the head's cost grows with the number of rows: half precision on a CPU
        without native half-precision kernels (bf16 emulated, compute-bound: 8 rows cost ~8 times
        one). A CPU with them (AVX-512 BF16, AMX) keeps 8 rows about as cheap as one, and there
        the rows computed one by one along the path would make each greedy n-gram round cost more
        than plain decoding's forward: measured once per process.
        """
        half = self.dtype in (torch.bfloat16, torch.float16)
        if not (self.split_head and half and self.output_device.type == "cpu"):
            return False
        return half_rows_cost_ratio(self.dtype, torch.get_num_threads()) > LAZY_HEAD_ROWS_RATIO

    def new_cache(self):
        return cache_ops.new_cache()

    def crop(self, cache, length: int) -> None:
        """Keep the first ``length`` positions of the cache."""
        cache_ops.crop(cache, length)

    def commit(self, cache, past_length: int, path: list[int]) -> None:
        """Keep only the accepted path's keys/values after a tree forward."""
        cache_ops.keep_path(cache, past_length, path)

    def commit_rows(self, cache, columns: int, lengths: list[int], paths: list[list[int]]) -> None:
        """After :meth:`forward_rows`: keep each row's accepted path (see ``cache.keep_paths``)."""
        cache_ops.keep_paths(cache, columns, lengths, paths)

    @torch.inference_mode()
    def prefill(self, cache, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        """Put ``token_ids`` in the cache; their last hidden states ``[len, hidden]`` if asked for.

        An exact model prefills in the pieces every layout uses (``speculum.exact.prefill_pieces``)."""
        if not token_ids:
            return None
        done, states = cache_ops.cache_length(cache), []
        for size in exact.prefill_pieces(self.model, done, len(token_ids)):
            piece, token_ids = token_ids[:size], token_ids[size:]
            states.append(self._prefill_piece(cache, piece, hidden))
        return torch.cat(states) if hidden else None

    def _prefill_piece(self, cache, token_ids: list[int], hidden: bool) -> torch.Tensor | None:
        ids = torch.tensor([token_ids], device=self.input_device)
        with exact.whole_rows():  # every layout prefills a prompt alike: exact mode need not split it
            if self.split_head:  # no logits needed: skip the LM head altogether
                out = self.model.model(input_ids=ids, use_cache=True, **with_cache(self.model.model, cache))
                return out.last_hidden_state[0] if hidden else None
            out = self.model(
                input_ids=ids,
                use_cache=True,
                logits_to_keep=1,
                output_hidden_states=hidden,
                **with_cache(self.model, cache),
            )
        return out.hidden_states[-1][0] if hidden else None

    @torch.inference_mode()
    def forward(
        self, cache, tree: TokenTree | list[int], *, hidden: bool = False, last_only: bool = False
    ) -> StepOutput:
        """Run ``tree`` (or a chain of token ids) after the cache; its keys/values are appended.

        ``last_only``: logits of the last node only (``[1, vocab]``, e.g. a draft model's next token).
        """
        if not isinstance(tree, TokenTree):
            tree = TokenTree(list(tree), list(range(-1, len(tree) - 1)))
        past = cache_ops.cache_length(cache)
        inputs = dict(
            input_ids=torch.tensor([tree.tokens], device=self.input_device),
            use_cache=True,
            **with_cache(self.model, cache),
        )
        if not tree.is_chain:
            positions = tree.position_ids(past).to(self.input_device)
            inputs.update(attention_mask=self._tree_mask(tree, past, positions), position_ids=positions[None])
        if self.split_head and (hidden or self.lazy_head or last_only):
            states = self.model.model(**inputs).last_hidden_state[0]
            if last_only:
                logits = self._head(states[-1:])
            elif self.lazy_head and len(tree) > 1:
                logits = LazyLogits(states, self._head)
            else:
                logits = self._head(states)
            return StepOutput(logits, states if hidden else None)
        if last_only:
            inputs["logits_to_keep"] = 1
        out = self.model(**inputs, output_hidden_states=hidden)
        states = out.hidden_states[-1][0] if hidden else None
        return StepOutput(out.logits[0].to(self.output_device), states)

    @torch.inference_mode()
    def forward_rows(
        self, cache, trees: list[TokenTree], lengths: list[int], *, hidden: bool = False
    ) -> list[StepOutput]:
        """One forward over every row's tree (a batch: see ``cache.keep_paths`` for the layout).

        Row r's tree goes after its ``lengths[r]`` cached columns; trees smaller than the largest
        are padded with nodes that see only themselves."""
        columns = cache_ops.cache_length(cache)
        rows, n = len(trees), max(len(tree) for tree in trees)
        device = self.input_device
        ids = torch.zeros(rows, n, dtype=torch.long)
        positions = torch.zeros(rows, n, dtype=torch.long)
        allowed = torch.zeros(rows, n, columns + n, dtype=torch.bool)
        allowed[:, :, columns:] = torch.eye(n, dtype=torch.bool)  # padding nodes see themselves only
        for r, (tree, length) in enumerate(zip(trees, lengths, strict=True)):
            size = len(tree)
            ids[r, :size] = torch.tensor(tree.tokens)
            ids[r, size:] = tree.tokens[0]
            positions[r, :size] = tree.position_ids(length)
            positions[r, size:] = length
            # the row's own cache (its leftover columns stay masked), for its tree's nodes only: a
            # padding node that saw it too would cost exact attention a call per layer past 512 keys
            allowed[r, :size, :length] = True
            allowed[r, :size, columns : columns + size] = tree.ancestor_mask
        positions = positions.to(device)
        inputs = dict(
            input_ids=ids.to(device),
            position_ids=positions,
            attention_mask=self.attention_mask(allowed.to(device), positions),
            use_cache=True,
            **with_cache(self.model, cache),
        )
        if self.split_head and (hidden or self.lazy_head):
            states = self.model.model(**inputs).last_hidden_state
            # the rows whose logits are wanted whole go through the LM head in one matrix product: a
            # product per row reads the whole head once per row
            eager = [r for r, tree in enumerate(trees) if not (self.lazy_head and len(tree) > 1)]
            heads: dict[int, torch.Tensor] = {}
            if eager:
                flat = self._head(torch.cat([states[r, : len(trees[r])] for r in eager]))
                for r, part in zip(eager, flat.split([len(trees[r]) for r in eager]), strict=True):
                    heads[r] = part
            outputs = []
            for r, tree in enumerate(trees):
                rows_states = states[r, : len(tree)]
                logits = heads[r] if r in heads else LazyLogits(rows_states, self._head)
                outputs.append(StepOutput(logits, rows_states if hidden else None))
            return outputs
        out = self.model(**inputs, output_hidden_states=hidden)
        logits = out.logits.to(self.output_device)
        return [
            StepOutput(logits[r, : len(tree)], out.hidden_states[-1][r, : len(tree)] if hidden else None)
            for r, tree in enumerate(trees)
        ]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.to(self.output_device)

    def _tree_mask(self, tree: TokenTree, past: int, positions: torch.Tensor):
        """Additive mask ``[1, 1, n, past + n]`` (one per layer kind when they differ in window)."""
        n = len(tree)
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.input_device)
        allowed[:, past:] = tree.ancestor_mask.to(self.input_device)
        return self.attention_mask(allowed, positions)

    def attention_mask(self, allowed: torch.Tensor, positions: torch.Tensor):
        """The additive mask for new tokens at ``positions`` that may see the keys ``allowed`` says
        (``[n, past + n]``, cache first; or ``[rows, n, past + n]`` with ``positions`` ``[rows, n]``
        for a batch, whose cached columns are at their own positions), with each layer kind's
        sliding window applied."""
        n = positions.shape[-1]
        past = allowed.shape[-1] - n
        masks = {}
        for kind, window in self.windows.items():
            if window is None or past + n <= window:  # no key is a window away (and no device sync)
                masks[kind] = allowed
            else:
                cached = torch.arange(past, device=self.input_device).expand(*positions.shape[:-1], past)
                key_positions = torch.cat([cached, positions], dim=-1)
                masks[kind] = allowed & (positions[..., :, None] - key_positions[..., None, :] < window)
        additive = {kind: self._additive(mask) for kind, mask in masks.items()}
        return next(iter(additive.values())) if len(additive) == 1 else additive

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """``[1, 1, n, keys]`` for one row, ``[rows, 1, n, keys]`` for a batch."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None] if mask.dim() == 2 else mask[:, None]


class LazyLogits:
    """Logits of a tree whose LM-head rows are computed on first use (the verifier reads only the
    nodes on the path it walks). Indexing by a node returns that node's logits ``[vocab]``."""

    def __init__(self, hidden: torch.Tensor, head):
        self.hidden = hidden
        self.head = head
        self.rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @torch.inference_mode()
    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = self.head(self.hidden[node : node + 1])[0]
        return self.rows[node]

    @torch.inference_mode()
    def take(self, nodes: list[int]) -> torch.Tensor:
        """The rows of ``nodes`` ``[len(nodes), vocab]``, the missing ones computed in one batch."""
        missing = sorted({i for i in nodes if i not in self.rows})
        if missing:
            for i, row in zip(missing, self.head(self.hidden[missing]), strict=True):
                self.rows[i] = row
        return torch.stack([self.rows[i] for i in nodes])

    def materialize(self) -> torch.Tensor:
        """Every row ``[n, vocab]``."""
        return self.take(list(range(len(self))))
