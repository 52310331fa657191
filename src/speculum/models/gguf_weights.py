"""A GGUF file's own quantized weights beside its converted checkpoint, and a model computed on them.

``quantization="gguf"`` keeps the file's blocks instead of their de-quantized floats: at conversion
the raw blocks of every quantized matrix go to ``gguf-blocks.safetensors`` in the converted folder,
keyed by the Hugging Face parameter they de-quantize to (checked value for value, rows reordered
where transformers reorders them); at load, those layers become :class:`QuantizedLinear` (and the
embedding a :class:`QuantizedEmbedding`) on speculum's quantized row kernel. Types without a kernel
(and matrices that could not be matched) stay de-quantized, and the load says which.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from speculum.kernels import KernelUnavailable, quant
from speculum.kernels.gguf_blocks import FORMATS, BlockWeight, decode, dequantize

logger = logging.getLogger("speculum")

BLOCKS_FILE = "gguf-blocks.safetensors"
_VERSION = "1"


# ------------------------------------------------------------------------------- extraction


def _reference_reader(converted: Path):
    """A function from parameter name to the converted checkpoint's float32 tensor (or None)."""
    from safetensors import safe_open

    index = converted / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        with safe_open(converted / "model.safetensors", "pt") as f:
            where = {name: "model.safetensors" for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator

    def read(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        with safe_open(converted / where[name], "pt") as f:
            return f.get_tensor(name).float()

    return read


def _hf_names(converted: Path) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, by transformers' own table for the architecture."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(converted)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return get_gguf_hf_weights_map(model, TensorProcessor())


def _row_order(values: np.ndarray, reference: np.ndarray) -> np.ndarray | None:
    """The permutation p with values[p] == reference row for row, if there is one."""
    if values.shape != reference.shape:
        return None
    if np.array_equal(values.view(np.uint32), reference.view(np.uint32)):
        return np.arange(values.shape[0])
    keys = {row.tobytes(): i for i, row in enumerate(values)}
    order = [keys.get(row.tobytes()) for row in reference]
    if any(i is None for i in order) or len(set(order)) != len(order):
        return None
    return np.asarray(order)


def extract_blocks(gguf_path: Path, converted: Path) -> dict[str, str]:
    """Write ``BLOCKS_FILE`` into ``converted`` from ``gguf_path``; returns why each quantized matrix
    left out was left out (empty when all were kept)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    names = _hf_names(converted)
    reference = _reference_reader(converted)
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, list] = {}
    skipped: dict[str, str] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16") or len(tensor.shape) != 2:
            continue
        hf_name = names.get(tensor.name)
        if kind not in FORMATS:
            skipped[tensor.name] = f"{kind} has no kernel"
            continue
        expected = reference(hf_name) if hf_name else None
        if expected is None:
            skipped[tensor.name] = "no parameter of the model matches it"
            continue
        raw = np.asarray(tensor.data)
        values = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(expected.shape)
        order = _row_order(values, expected.numpy())
        if order is None:
            skipped[tensor.name] = f"its values differ from {hf_name}'s"
            continue
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(raw[order]))
        formats[hf_name] = [kind, *expected.shape]
    tmp = tempfile.NamedTemporaryFile(dir=converted, prefix=".blocks-", suffix=".tmp", delete=False)
    tmp.close()
    try:
        save_file(tensors, tmp.name, metadata={"version": _VERSION, "formats": json.dumps(formats)})
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, converted / BLOCKS_FILE)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    if skipped:
        logger.info("speculum: GGUF matrices left de-quantized: %s", skipped)
    return skipped


def has_blocks(converted: Path) -> bool:
    return (converted / BLOCKS_FILE).is_file()


class BlockFile:
    """``BLOCKS_FILE`` of a converted folder: its matrices' names and types, each read on demand."""

    def __init__(self, converted: Path):
        from safetensors import safe_open

        self._file = safe_open(converted / BLOCKS_FILE, "pt")
        self.formats: dict[str, list] = json.loads(self._file.metadata()["formats"])

    def __contains__(self, name: str) -> bool:
        return name in self.formats

    def read(self, name: str) -> BlockWeight:
        kind, rows, cols = self.formats[name]
        return decode(self._file.get_tensor(name).numpy(), kind, (rows, cols))


# ------------------------------------------------------------------------------- modules


class QuantizedLinear(nn.Module):
    """A linear layer computed on a GGUF matrix's own blocks (see speculum.kernels.quant)."""

    kernel = "rows"  # every row the same bits whatever the row count (exact mode needs no pieces)

    def __init__(self, packed: quant.Packed, bias: torch.Tensor | None, module: Any):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._module = module
        self.siblings: SiblingGroup | None = None

    @property
    def format(self) -> str:
        return self.packed.format.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None:
            return self.siblings.output(self, x)
        return quant.linear(self._module, x, self.packed, self.bias)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the de-quantized [out, in] weight, float32 (a copy)."""
        return dequantize(unpack_rows(self.packed, index.cpu()))

    def dense(self) -> torch.Tensor:
        """The de-quantized [out, in] weight, float32 (a copy)."""
        return self.weight_rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # called in turn on one input


class SiblingGroup:
    """Quantized layers of one block that transformers calls one after another on the same input
    (the q, k and v projections; gate and up): the first call computes them all in one kernel call
    and the others take their result. A step then pays one call's fixed cost per group, and the
    small k and v matrices share the threads with q. Each result is the same bits as a call of its
    own; a call on any other input computes the group afresh."""

    def __init__(self, members: list[QuantizedLinear], module: Any):
        self.members = members
        self._module = module
        self._input: torch.Tensor | None = None  # held, so no other tensor can take its identity
        self._version: int | None = None
        self._ready: dict[int, torch.Tensor] = {}

    def output(self, member: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        at = next(i for i, m in enumerate(self.members) if m is member)
        if x is self._input and _version(x) == self._version and at in self._ready:
            out = self._ready.pop(at)
            if not self._ready:
                self._input = None
            return out
        outs = quant.linear_group(self._module, x, [m.packed for m in self.members], [m.bias for m in self.members])
        self._input, self._version = x, _version(x)
        self._ready = {i: out for i, out in enumerate(outs) if i != at}
        return outs[at]


def _version(x: torch.Tensor) -> int | None:
    """``x``'s in-place version counter (None for inference tensors, which keep none)."""
    return None if x.is_inference() else x._version


def group_siblings(model: nn.Module) -> int:
    """Join each block's quantized sibling layers (:data:`SIBLINGS`) into a :class:`SiblingGroup`;
    returns how many groups were formed."""
    formed = 0
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            members = [m for m in members if isinstance(m, QuantizedLinear)]
            if len(members) < 2 or len({m.in_features for m in members}) > 1:
                continue
            group = SiblingGroup(members, members[0]._module)
            for member in members:
                member.siblings = group
            formed += 1
    return formed


class QuantizedEmbedding(nn.Module):
    """An embedding whose rows are de-quantized from a GGUF matrix's blocks as they are looked up
    (Gemma's scaled embedding keeps its scale)."""

    def __init__(self, packed: quant.Packed, dtype: torch.dtype, embed_scale: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features
        self.dtype = dtype
        self.embed_scale = embed_scale
        self.register_buffer("codes", packed.codes, persistent=False)  # where the table lives

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the table, float32, as the de-quantized model's weight holds them."""
        return dequantize(unpack_rows(self.packed, ids.cpu()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, where = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = self.rows(unique).to(self.dtype)[where]
        out = rows.reshape(*ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out


def unpack_rows(packed: quant.Packed, rows: torch.Tensor) -> BlockWeight:
    """Rows ``rows`` of a packed matrix back in the common form (the inverse of :func:`quant.pack`).
    Each row is gathered from its own lane of its block: the other 15 lanes are never copied."""
    fmt, k = packed.format, packed.in_features
    block, lane = rows // quant.LANES, rows % quant.LANES
    blocks = packed.codes.shape[0]
    if fmt.bits == 8:
        codes = packed.codes.view(blocks, k // 4, quant.LANES, 4)[block, :, lane].reshape(-1, k)
    else:
        pairs = packed.codes.view(blocks, k // 8, quant.LANES, 4)[block, :, lane]  # [n, K/8, 4]
        codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=2)  # [n, K/8, half, 4]
        planes = fmt.bits - 4
        if planes:
            # bits 4*lane .. 4*lane+3 of each plane sit in byte lane // 2
            byte = packed.high.view(blocks, k // 8, 2, planes, 8)[block, :, :, :, lane // 2]  # [n, K/8, half, plane]
            nibble = (byte >> (4 * (lane % 2)).to(torch.uint8).view(-1, 1, 1, 1)) & 0x0F
            for p in range(planes):
                plane = nibble[:, :, :, p, None]  # [n, K/8, half, 1]: one bit for each of the 4 values
                codes = codes | (((plane >> torch.arange(4, dtype=torch.uint8)) & 1) << (4 + p))
        codes = codes.reshape(-1, k)

    def lanes(t: torch.Tensor) -> torch.Tensor | None:
        return None if t.numel() == 0 else t[block, :, lane]

    return BlockWeight(fmt, codes.contiguous(), lanes(packed.a), lanes(packed.b), lanes(packed.A), lanes(packed.B))


# ------------------------------------------------------------------------------- the swap


@dataclass
class QuantizedReport:
    """What ``quantization="gguf"`` did to a model: layers by GGUF type, what stayed de-quantized."""

    kernel: str
    layers: dict[str, int] = field(default_factory=dict)
    embedding: str | None = None
    dequantized: list[str] = field(default_factory=list)
    weight_bytes: int = 0
    sibling_groups: int = 0  # q/k/v and gate/up layers computed a group to a call

    def describe(self) -> str:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(self.layers.items()))
        text = f"gguf ({self.kernel} kernel): {kinds} layers"
        if self.embedding:
            text += f", embedding {self.embedding}"
        if self.dequantized:
            text += f"; de-quantized: {len(self.dequantized)} ({', '.join(self.dequantized[:3])}...)"
        return text


def quantize_model(model: nn.Module, converted: Path, isa: str | None = None) -> QuantizedReport:
    """Swap ``model``'s linear layers (and embedding) whose GGUF blocks are in ``converted`` for
    quantized ones. Raises :class:`KernelUnavailable` where the kernel cannot be built."""
    module = quant.load(isa)
    blocks = BlockFile(converted)
    left = set(blocks.formats)
    report = QuantizedReport(kernel=isa or quant.native_isa())
    packed_by_name: dict[str, quant.Packed] = {}

    def packed(name: str) -> quant.Packed:
        if name not in packed_by_name:
            packed_by_name[name] = quant.pack(blocks.read(name))
            left.discard(name)
            report.weight_bytes += packed_by_name[name].nbytes()
        return packed_by_name[name]

    embedding = model.get_input_embeddings()
    swaps: list[tuple[str, nn.Module]] = []
    for name, layer in model.named_modules():
        weight = getattr(layer, "weight", None)
        if weight is None or not isinstance(layer, nn.Linear | nn.Embedding):
            continue
        key = f"{name}.weight"
        if key not in blocks and key not in packed_by_name:  # a tied weight is stored under its first name
            key = next((n for n, p in model.named_parameters() if p is weight), key)
        if key not in blocks and key not in packed_by_name:
            continue
        if isinstance(layer, nn.Embedding):
            if layer is embedding:
                scale = getattr(layer, "embed_scale", None)
                swaps.append((name, QuantizedEmbedding(packed(key), weight.dtype, scale)))
                report.embedding = packed(key).format.name
            continue
        swaps.append((name, QuantizedLinear(packed(key), layer.bias, module)))
        kind = packed(key).format.name
        report.layers[kind] = report.layers.get(kind, 0) + 1
    for name, new in swaps:
        model.set_submodule(name, new)
    report.sibling_groups = group_siblings(model)
    report.dequantized = sorted(left)
    _give_back_freed_memory()
    return report


def _give_back_freed_memory() -> None:
    """Return the de-quantized weights' freed memory to the system: glibc keeps freed heap pages
    mapped, which would leave the process as big as the de-quantized model (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


__all__ = [
    "BLOCKS_FILE",
    "KernelUnavailable",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedReport",
    "SiblingGroup",
    "extract_blocks",
    "group_siblings",
    "has_blocks",
    "quantize_model",
    "BlockFile",
    "unpack_rows",
]
