"""Cache ops: the one module that edits the target's KV cache between steps.

Works on transformers' own ``DynamicCache``. The cache is created *without* a model config so
that every layer, including Gemma 3's sliding-window layers, keeps its full history: rolling
back a rejected draft needs the rows a sliding window would already have dropped. The sliding
window itself is then enforced by the attention mask (see ``engine.TargetRunner``).

Its layers are :class:`GrowingLayer`: keys and values are views of buffers with room to grow, so
a step writes its new positions in place where transformers' ``DynamicLayer`` copies the whole
cache (``torch.cat``) every step.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ROOM = 256  # positions a layer's buffers grow by at least


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the first positions of larger buffers.

    Anything that assigns ``keys``/``values`` (the batch ops below, transformers' own) is adopted
    on the next update: the buffers are rebuilt around the new tensors (one copy)."""

    def __init__(self):
        super().__init__()
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._room = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._views_of_room() or length + new > self._room[0].shape[-2]:
            self._grow(length, length + new, key_states, value_states)
        keys, values = self._room
        keys[..., length : length + new, :] = key_states
        values[..., length : length + new, :] = value_states
        self.keys, self.values = keys[..., : length + new, :], values[..., : length + new, :]
        return self.keys, self.values

    def _views_of_room(self) -> bool:
        """Whether keys and values are still the first positions of this layer's buffers (a crop
        keeps them so; an assignment does not)."""
        if self._room is None:
            return False
        return all(
            held.dim() == 4
            and held.data_ptr() == room.data_ptr()
            and held.shape[:2] == room.shape[:2]
            and held.stride() == room.stride()
            for held, room in zip((self.keys, self.values), self._room, strict=True)
        )

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = -(-(needed + max(ROOM, needed // 4)) // ROOM) * ROOM
        room = []
        for held, states in ((self.keys, key_states), (self.values, value_states)):
            shape = (*states.shape[:-2], capacity, states.shape[-1])
            buffer = states.new_empty(shape)
            if length:
                buffer[..., :length, :] = held
            room.append(buffer)
        self._room = (room[0], room[1])


def new_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def _like(cache: DynamicCache) -> DynamicCache:
    """An empty cache that stores its layers as ``cache`` does."""
    like = DynamicCache()
    like.layer_class_to_replicate = cache.layer_class_to_replicate
    return like


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions."""
    excess = cache_length(cache) - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if excess:
        cache.crop(-excess)  # transformers 5.x: a negative count removes that many positions


@torch.inference_mode()
def keep_path(cache: DynamicCache, past_length: int, nodes: list[int]) -> None:
    """After a tree forward, keep the rows of ``nodes`` (tree indices, ascending) after the prefix.

    The tree's rows start at ``past_length``. A chain's accepted nodes are a prefix of the tree,
    so cropping is enough; otherwise the accepted rows are gathered into place first. Their keys
    were computed with the positions they keep (``past_length + depth``), so no re-rotation is
    needed.
    """
    if nodes == list(range(len(nodes))):
        crop(cache, past_length + len(nodes))
        return
    index = torch.tensor(nodes, dtype=torch.long) + past_length
    for layer in cache.layers:
        for name in ("keys", "values"):
            rows = getattr(layer, name)
            gathered = rows.index_select(-2, index.to(rows.device))
            rows[..., past_length : past_length + len(nodes), :] = gathered
    crop(cache, past_length + len(nodes))


# ------------------------------------------------------------------------------ rows of a batch
#
# A batch keeps its rows in one DynamicCache ``[B, heads, C, head_dim]`` per layer, aligned on the
# left: row r's committed tokens but its last sit in columns [0, L_r) at their true positions
# (column = position), and columns [L_r, C) of a shorter row are leftovers its masks never let it
# see (docs/batching.md). L_r is the engine's to know; C is the longest row's length.


def _keys_values(cache: DynamicCache, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer i's keys and values, or None where the layer holds nothing yet."""
    if i >= len(cache.layers):
        return None
    layer = cache.layers[i]
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None or keys.dim() != 4:
        return None
    return keys, layer.values


def _set_layer(cache: DynamicCache, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    while len(cache.layers) <= i:
        cache.layers.append((cache.layer_class_to_replicate or DynamicLayer)())
    layer = cache.layers[i]
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def _widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns appended up to ``width`` (leftovers no mask lets a row see)."""
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    shape = (*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=-2)


@torch.inference_mode()
def join(cache: DynamicCache, rows: int, row: DynamicCache) -> None:
    """Append the one-row cache ``row`` after the ``rows`` rows of ``cache``, the shorter side
    widened with leftover columns."""
    for i in range(max(len(cache.layers), len(row.layers))):
        batch, new = _keys_values(cache, i), _keys_values(row, i)
        if batch is None and new is None:
            continue
        like = batch if batch is not None else new
        batch = batch if batch is not None else tuple(t.new_zeros((rows, *t.shape[1:2], 0, t.shape[3])) for t in like)
        new = new if new is not None else tuple(t.new_zeros((1, *t.shape[1:2], 0, t.shape[3])) for t in like)
        width = max(batch[0].shape[-2], new[0].shape[-2])
        keys, values = (torch.cat([_widen(a, width), _widen(b, width)]) for a, b in zip(batch, new, strict=True))
        _set_layer(cache, i, keys, values)


@torch.inference_mode()
def keep_rows(cache: DynamicCache, rows: list[int], length: int) -> None:
    """Keep only ``rows`` (batch indices, in that order), cropped to ``length`` columns (the longest
    of them)."""
    for i in range(len(cache.layers)):
        kv = _keys_values(cache, i)
        if kv is None:
            continue
        index = torch.tensor(rows, dtype=torch.long, device=kv[0].device)
        keys, values = (t.index_select(0, index)[..., :length, :] for t in kv)
        _set_layer(cache, i, keys, values)


@torch.inference_mode()
def keep_paths(cache: DynamicCache, columns: int, lengths: list[int], paths: list[list[int]]) -> None:
    """After a batched tree forward (every row's tree at columns [``columns``, ...)), keep each row's
    accepted ``paths[r]`` (tree indices, ascending) at columns [L_r, L_r + len(path)), then crop
    to the longest row. One indexed copy per layer moves every row's path at once."""
    rows, sources, targets = [], [], []
    for r, (length, path) in enumerate(zip(lengths, paths, strict=True)):
        if path == list(range(len(path))) and length == columns:
            continue  # a chain's prefix in a row as long as the longest: already in place
        rows += [r] * len(path)
        sources += [columns + node for node in path]
        targets += range(length, length + len(path))
    index: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # made once per device, not per layer
    for layer in cache.layers if rows else ():
        for tensor in (layer.keys, layer.values):
            if tensor.device not in index:
                index[tensor.device] = tuple(torch.tensor(x, device=tensor.device) for x in (rows, sources, targets))
            r, source, target = index[tensor.device]
            tensor[r, :, target] = tensor[r, :, source]
    crop(cache, max(length + len(path) for length, path in zip(lengths, paths, strict=True)))


@torch.inference_mode()
def split_rows(cache: DynamicCache, lengths: list[int]) -> list[DynamicCache]:
    """One single-row cache per row of ``cache``, row r cropped to its ``lengths[r]`` columns."""
    rows = []
    for r, length in enumerate(lengths):
        row = _like(cache)
        for i in range(len(cache.layers)):
            kv = _keys_values(cache, i)
            if kv is not None and length > 0:
                _set_layer(row, i, *(t[r : r + 1, :, :length].clone() for t in kv))
        rows.append(row)
    return rows
