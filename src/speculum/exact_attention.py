"""Exact mode's attention: each query's output depends only on that query and the keys and values it
sees, in their order, whatever else the forward carries (other queries, tree nodes, batch rows).

A query that sees ``n`` keys takes one of two computations, chosen by ``n`` alone (a position sees
as many keys in plain decoding as in a verification or a batch, so every layout chooses alike):

- ``n <= SHORT_KEYS``, on CPUs with AVX-512 (float32, bfloat16 and float16 models): speculum's
  attention kernel (:mod:`speculum.kernels.attention`), one call for every such query of the forward,
  each query in one fixed order of float32 operations over exactly its keys: the same bits in every
  layout by construction.
- ``n <= SHORT_KEYS`` elsewhere (float64 models, AVX2 CPUs, no compiler,
  ``SPECULUM_EXACT_ATTENTION=float64``): SDPA in float64, batched over every such query of the
  forward, each key/value head's query heads folded into its queries. SDPA's order of summation
  depends on the batch, the mask and where the keys sit in the cache, but in float64 that changes
  the last of 53 bits, and rounding to bfloat16 (8 bits) or float16 (11) drops it: an output
  differs only where the exact value lies within ~1e-13 of a rounding boundary.
- ``n > SHORT_KEYS``: the model dtype's own SDPA kernel on that query alone over exactly its keys
  (a view of the cache, or its keys gathered in order for a tree): the very call plain decoding
  makes at that position, so the same bits by construction. One call per query, but no float64
  copy of a long cache (4x the bytes of bfloat16 to read every step).

A prefill (:func:`whole_rows`) takes the model's own kernel: every layout prefills a prompt alike, in
the same pieces (``speculum.runner.ModelRunner.prefill``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from speculum.kernels import attention as attention_kernel

SHORT_KEYS = 512  # queries that see at most this many keys take the kernel (or float64), in one call

_WHOLE_ROWS = contextvars.ContextVar("speculum_exact_whole_rows", default=False)


@contextmanager
def whole_rows() -> Iterator[None]:
    """Inside, the forward is a prefill, which every method, layout and batch computes the same way
    (the prompt alone, in the same pieces): linear layers take their rows whole (pieces of 16 rows
    would read every weight once per piece) and attention runs the model's own kernel."""
    token = _WHOLE_ROWS.set(True)
    try:
        yield
    finally:
        _WHOLE_ROWS.reset(token)


def in_prefill() -> bool:
    return _WHOLE_ROWS.get()


def exact_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention interface: (batch, heads, queries, dim) in, (batch, queries, heads, dim) out."""
    if _WHOLE_ROWS.get():
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    if not _plain_call(attention_mask, args, kwargs):
        return _float64_sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    batch, heads, queries, _ = query.shape
    plan = _plan(attention_mask, batch, queries, key.shape[2], getattr(module, "is_causal", True), query.device)
    scaling = kwargs.get("scaling")
    kernel = attention_kernel.for_dtype(query.dtype)
    if kernel is not None and plan.short:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = attention_kernel.attend(kernel, query, key, value, plan.runs(), scale)  # long pairs: zeros
        if plan.long:
            _one_query_calls(out, plan, query, key, value, scaling)
        return out, None
    columns = plan.columns
    if plan.everyone_short:
        wide = (t.double() for t in (query, key[:, :, columns], value[:, :, columns]))
        return _folded_sdpa(*wide, plan.seen, scaling).to(query.dtype), None
    out = query.new_zeros(batch, queries, heads, value.shape[-1])
    if plan.short:
        rows = (t.index_select(0, plan.rows) for t in (query, key[:, :, columns], value[:, :, columns]))
        wide = _folded_sdpa(*(t.double() for t in rows), plan.seen, scaling).to(out.dtype)
        for b, j in plan.short:
            out[b, j] = wide[plan.row_of[b], j]
    if plan.long:
        _one_query_calls(out, plan, query, key, value, scaling)
    return out, None


def _plain_call(mask, args, kwargs) -> bool:
    """No dropout, soft-capping or position bias, and one mask for every head (or none)."""
    plain = not args and not kwargs.get("dropout") and kwargs.get("softcap") is None
    shared_mask = mask is None or (mask.dim() == 4 and mask.shape[1] == 1)
    return plain and shared_mask and kwargs.get("position_bias") is None


def _float64_sdpa(module, query, key, value, mask, *args, **kwargs):
    """transformers' SDPA in float64, rounded back: for calls the split by query does not cover."""
    if mask is not None and mask.is_floating_point():
        mask = mask.to(torch.float64)
    wide = (t.to(torch.float64) for t in (query, key, value))
    out, weights = sdpa_attention_forward(module, *wide, mask, *args, **kwargs)
    return out.to(query.dtype), weights


@dataclass
class _Plan:
    """Which keys each (row, query) of a forward sees and how its attention is computed."""

    selections: list[list[slice | torch.Tensor]]  # per row and query: a slice of columns, or their indices
    short: list[tuple[int, int]]  # (row, query) pairs computed in float64
    long: list[tuple[int, int]]  # ... one call each in the model's dtype
    rows: torch.Tensor  # the rows with a float64 query
    row_of: dict[int, int]  # row -> its place in ``rows``
    columns: slice  # the cache columns the float64 queries see, from the first to the last
    seen: torch.Tensor | None  # the float64 call's mask over its rows and columns (None: all seen)
    everyone_short: bool  # every query of every row in float64: one call over the whole forward
    _runs: tuple | None = None

    def runs(self) -> tuple[torch.Tensor, ...]:
        """The keys of each short (row, query) pair as the attention kernel reads them (a long pair
        sees none there): per row the cache columns any of its queries sees (increasing) and where
        each row's start; per pair how many keys it sees, where its list starts, and the list (places
        in its row's columns, in order)."""
        if self._runs is None:
            row_columns, row_offsets, counts, offsets, local, taken = [], [0], [], [], [], 0
            short = set(self.short)
            nothing = torch.zeros(0, dtype=torch.long)
            for b, row in enumerate(self.selections):
                seen = [_columns(selection) if (b, j) in short else nothing for j, selection in enumerate(row)]
                union = torch.unique(torch.cat(seen)) if seen else torch.zeros(0, dtype=torch.long)
                row_columns.append(union)
                row_offsets.append(row_offsets[-1] + len(union))
                for columns in seen:
                    counts.append(len(columns))
                    offsets.append(taken)
                    local.append(torch.searchsorted(union, columns))
                    taken += len(columns)
            self._runs = (
                torch.cat(row_columns),
                torch.tensor(row_offsets, dtype=torch.long),
                torch.tensor(counts, dtype=torch.long),
                torch.tensor(offsets, dtype=torch.long),
                torch.cat(local) if local else torch.zeros(0, dtype=torch.long),
            )
        return self._runs


def _columns(selection) -> torch.Tensor:
    if isinstance(selection, slice):
        return torch.arange(selection.start, selection.stop, dtype=torch.long)
    return selection.cpu().long()


_plans: dict = {}  # the layers of one forward share its mask, so its plan


def _plan(mask, batch: int, queries: int, keys: int, causal: bool, device: torch.device) -> _Plan:
    key = ("no mask", batch, queries, keys, causal, device) if mask is None else id(mask)
    held = _plans.get(key)
    if held is not None and held[0] is mask:
        return held[1]
    with torch.inference_mode(False):  # kept across forwards, inference mode or not
        plan = _make_plan(mask, batch, queries, keys, causal, device)
    if len(_plans) > 8:
        _plans.clear()
    _plans[key] = (mask, plan)
    return plan


def _make_plan(mask, batch: int, queries: int, keys: int, causal: bool, device: torch.device) -> _Plan:
    if mask is None:
        counts = [[keys - queries + j + 1 if causal else keys for j in range(queries)]] * batch
        selections = [[slice(0, c) for c in counts[0]]] * batch
    else:
        counts, selections = _visible_keys(mask, batch, queries, keys)
    pairs = [(b, j) for b in range(batch) for j in range(queries)]
    short = [(b, j) for b, j in pairs if 0 < counts[b][j] <= SHORT_KEYS]
    long = [(b, j) for b, j in pairs if counts[b][j] > SHORT_KEYS]
    row_of = {b: i for i, b in enumerate(sorted({b for b, _ in short}))}
    everyone_short = len(short) == len(pairs)
    seen, columns = None, slice(0, 0)
    if short:
        first = min(_start(selections[b][j]) for b, j in short)
        columns = slice(first, max(_end(selections[b][j]) for b, j in short))
        seen = torch.zeros(len(row_of), 1, queries, columns.stop - first, dtype=torch.bool)
        for b, j in short:
            selection = selections[b][j]
            if isinstance(selection, slice):
                seen[row_of[b], 0, j, selection.start - first : selection.stop - first] = True
            else:
                seen[row_of[b], 0, j, (selection - first).cpu()] = True
        seen[..., 0] |= ~seen.any(-1)  # a query left out sees one key rather than none (no NaN)
        if bool(seen.all()):
            seen = None
    return _Plan(
        selections=selections,
        short=short,
        long=long,
        rows=torch.tensor(list(row_of), dtype=torch.long, device=device),
        row_of=row_of,
        columns=columns,
        seen=seen.to(device) if seen is not None else None,
        everyone_short=everyone_short,
    )


def _visible_keys(mask: torch.Tensor, batch: int, queries: int, keys: int) -> tuple[list, list]:
    """Per row and query: how many keys it sees, and which (a slice of the cache's columns where they
    are contiguous, else their column indices in order)."""
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    visible = visible[:, 0].expand(batch, queries, keys)
    counts = visible.sum(-1)
    first = visible.int().argmax(-1)
    # contiguous where the keys seen up to the run's would-be last column are all of them
    last = (first + counts - 1).clamp(min=0)
    in_run = visible.int().cumsum(-1).gather(-1, last[..., None])[..., 0]
    selections = []
    for b, (row_counts, row_first, row_run) in enumerate(
        zip(counts.tolist(), first.tolist(), in_run.tolist(), strict=True)
    ):
        selections.append(
            [
                slice(start, start + count) if run == count else visible[b, j].nonzero()[:, 0]
                for j, (count, start, run) in enumerate(zip(row_counts, row_first, row_run, strict=True))
            ]
        )
    return counts.tolist(), selections


def _start(selection) -> int:
    return selection.start if isinstance(selection, slice) else int(selection[0])


def _end(selection) -> int:
    return selection.stop if isinstance(selection, slice) else int(selection[-1]) + 1


def _folded_sdpa(query, key, value, mask, scaling) -> torch.Tensor:
    """SDPA with each key/value head's query heads folded into its queries, as transformers does for
    one query, rather than the keys and values repeated per query head (a copy of the cache per
    layer): (batch, heads, queries, dim) in, (batch, queries, heads, dim) out."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * queries, dim)
    if mask is not None and groups > 1:
        mask = mask.expand(mask.shape[0], 1, queries, keys)[:, :, None]
        mask = mask.expand(mask.shape[0], 1, groups, queries, keys).reshape(mask.shape[0], 1, groups * queries, keys)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, queries, value.shape[-1]).transpose(1, 2)


def _one_query_calls(out, plan: _Plan, query, key, value, scaling) -> None:
    """Each long (row, query) pair's attention in the model's dtype, one SDPA call per query over
    exactly its keys, in order: the call plain decoding makes for that position."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.transpose(1, 2).reshape(batch, queries, kv_heads, heads // kv_heads, dim)
    for b, j in plan.long:
        selection = plan.selections[b][j]
        if isinstance(selection, slice):
            k, v = key[b : b + 1, :, selection], value[b : b + 1, :, selection]
        else:
            k, v = key[b : b + 1].index_select(2, selection), value[b : b + 1].index_select(2, selection)
        result = torch.nn.functional.scaled_dot_product_attention(folded[b, j][None], k, v, scale=scaling)
        out[b, j] = result.reshape(heads, -1)
