"""Where the bits part: one token position computed in several layouts, module by module.

In bfloat16 a verification forward (the token plus its draft), a token tree or a batch row can
round differently from plain decoding's one-token step, because the kernels a linear layer or
attention picks, and their reduction orders, depend on how many rows or query positions sit
beside the one compared. :func:`find_divergence` runs the same position as plain decoding (the
reference) and in each other layout through speculum's own :class:`~speculum.runner.ModelRunner`
(the forwards the engine runs: chains on the model's causal mask, trees and batches on explicit
masks, batch caches joined the way ``engine.Batch`` joins them), records every module's output
at that position with forward hooks, and reports, in execution order, the first module whose
output is not bitwise the reference's.

Picking the compared position out of a module's output follows transformers' layouts: a 3-D
output is ``[rows, tokens, ...]``, a 4-D one ``[rows, heads, tokens, head_dim]`` (q/k norms), a
2-D one the flattened rows the runner hands its LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from speculum import cache as cache_ops
from speculum.accel import PackedLinear, output_size
from speculum.errors import InvalidInputError
from speculum.runner import ModelRunner
from speculum.tree import Draft, TokenTree

REFERENCE = "plain"
LAYOUTS = ("chain", "tree", "batch", "batch-chain")


@dataclass
class Call:
    """One module call during the captured forward, at the compared position."""

    name: str
    kind: str  # the module's class name
    output: torch.Tensor
    input: torch.Tensor | None  # its first floating input at the position, where there is one
    shape: str  # what the call saw: rows of a linear, query length and mask of an attention


@dataclass
class Difference:
    """A module whose output at the compared position differs from the reference's."""

    name: str
    kind: str
    max_abs: float
    input_equal: bool | None  # True: the module itself parted (its input at the position was the same)
    reference_shape: str
    shape: str


@dataclass
class LayoutResult:
    """One layout against the reference: every differing module in execution order, and the logits."""

    layout: str
    description: str
    differences: list[Difference] = field(default_factory=list)
    logits_max_abs: float = 0.0
    argmax_equal: bool = True
    argmax: int = -1

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    @property
    def origins(self) -> list[Difference]:
        """The differing modules whose input at the position was the reference's: where a new
        difference starts, not where one flows through (a module holding such a one is left out)."""
        found: list[Difference] = []
        for d in self.differences:
            if d.input_equal and not any(o.name.startswith(d.name + ".") for o in found):
                found.append(d)
        return found


@dataclass
class DivergenceReport:
    reference_argmax: int
    node: int
    layouts: list[LayoutResult]


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):  # ModelOutput and friends
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _linear_kernel(module: nn.Module, rows: int) -> str:
    """Which kernel a linear layer's call ran on."""
    if isinstance(module, PackedLinear):
        if module.rows is not None:
            return "speculum's row kernel"
        if 0 < rows <= module.dense_rows and module.dense_weight is not None:
            return "stock kernel"
        if 0 < rows < module.min_rows:
            return f"packed, padded to {module.min_rows}"
        return "packed"
    return type(module).__name__


def _mask_kind(mask) -> str:
    if mask is None:
        return "no mask (causal)"
    if isinstance(mask, dict):
        mask = next(iter(mask.values()), None)
        return "masks per layer kind " + ("x".join(map(str, mask.shape)) if isinstance(mask, torch.Tensor) else "")
    if isinstance(mask, torch.Tensor):
        return "mask " + "x".join(map(str, mask.shape))
    return type(mask).__name__


def _call_shape(module: nn.Module, args, kwargs, first_input: torch.Tensor | None) -> str:
    if first_input is None:
        return ""
    rows = first_input.numel() // max(first_input.shape[-1], 1)
    if isinstance(module, nn.Linear | PackedLinear) or type(module).__name__ == "Conv1D":
        return f"{rows} rows ({_linear_kernel(module, rows)})"
    if "Attention" in type(module).__name__:
        query = first_input.shape[-2] if first_input.dim() >= 2 else 1
        batch = first_input.shape[0] if first_input.dim() >= 3 else 1
        return f"{batch} x {query} queries, {_mask_kind(kwargs.get('attention_mask'))}"
    return f"{rows} rows"


class Recorder:
    """Forward hooks on every submodule of a model; records calls only while :meth:`capture` is on."""

    def __init__(self, model: nn.Module):
        self.calls: list[Call] | None = None
        self.taken: list[Call] = []
        self.pick = None
        self.tokens = 1
        self.running: list[str] = []  # the modules whose forward is under way, outermost first
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_pre_hook(self._enter(name)))
                self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        # attention's core is a function, not a module: wrapped so that it is compared like one
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._sdpa

    def _enter(self, name: str):
        def pre_hook(module, args):
            self.running.append(name)

        return pre_hook

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):
        out = self.sdpa(query, key, value, attn_mask, *args, **kwargs)
        if self.calls is None or out.dim() != 4:
            return out
        heads, unfolded = f"{query.shape[1]} heads", out
        if out.shape[2] != self.tokens:  # one query's heads folded onto the key/value heads (pack_gqa)
            heads = f"{query.shape[1]} key/value heads x {query.shape[2]} folded queries"
            unfolded, query = (t.reshape(t.shape[0], -1, self.tokens, t.shape[-1]) for t in (out, query))
        picked = self.pick(unfolded)
        if picked is not None:
            mask = "is_causal" if kwargs.get("is_causal") else _mask_kind(attn_mask).replace(" (causal)", "")
            gqa = ", enable_gqa" if kwargs.get("enable_gqa") else ""
            shape = f"{query.shape[0]} x {self.tokens} queries, {heads}, {key.shape[-2]} keys, {mask}{gqa}"
            name = f"{self.running[-1]}.sdpa" if self.running else "sdpa"
            self.calls.append(Call(name, "scaled_dot_product_attention", picked.clone(), self.pick(query), shape))
        return out

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            if self.running and self.running[-1] == name:
                self.running.pop()
            if self.calls is None:
                return
            out = _first_tensor(output)
            if out is None or not out.is_floating_point():
                return
            picked = self.pick(out)
            if picked is None:
                return
            inp = _first_tensor(args) if args else None
            if inp is None:
                inp = next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            inp = inp if inp is not None and inp.is_floating_point() else None
            picked_input = self.pick(inp) if inp is not None else None
            shape = _call_shape(module, args, kwargs, inp)
            self.calls.append(Call(name, type(module).__name__, picked.detach().clone(), picked_input, shape))

        return hook

    def capture(self, rows: int, tokens: int, row: int, node: int, flat: int):
        """Record the calls of the next forward at ``[row, node]`` of a ``[rows, tokens]`` forward
        (``flat``: the position's index among the rows the runner hands its LM head)."""

        def pick(t: torch.Tensor) -> torch.Tensor | None:
            if t.dim() == 3 and t.shape[1] == tokens and t.shape[0] in (rows, 1):
                return t[min(row, t.shape[0] - 1), node]
            if t.dim() == 4 and t.shape[2] == tokens and t.shape[0] in (rows, 1):
                return t[min(row, t.shape[0] - 1), :, node]
            if t.dim() == 2 and t.shape[0] > flat:
                return t[flat]
            if t.dim() == 2 and t.shape[0] == 1:  # a lazily computed LM-head row
                return t[0]
            return None

        self.pick = pick
        self.tokens = tokens
        self.calls = []
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.taken, self.calls = self.calls, None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        torch.nn.functional.scaled_dot_product_attention = self.sdpa


def _logits(out, node: int) -> torch.Tensor:
    return out.logits[node].detach().float().clone()


def companion_prompts(prompt: list[int], count: int) -> list[list[int]]:
    """Other rows for a batch: the prompt rotated, alternately shorter and longer than it (so the
    compared row has both leftover columns and padding nodes beside it)."""
    rows = []
    for j in range(count):
        shift = j // 2 + 1
        rotated = prompt[shift % len(prompt) :] + prompt[: shift % len(prompt)]
        rows.append(rotated[: max(2, len(prompt) - shift)] if j % 2 == 0 else rotated + rotated[: shift + 1])
    return rows


def find_divergence(
    model_or_runner: nn.Module | ModelRunner,
    prompt: list[int],
    *,
    draft_tokens: int = 4,
    batch: int = 4,
    row: int = 0,
    node: int = 0,
    others: list[list[int]] | None = None,
    draft: list[int] | None = None,
    layouts: tuple[str, ...] = LAYOUTS,
) -> DivergenceReport:
    """Compare the position of ``node`` (0: the prompt's last token, the root of a verification;
    j: the j-th draft token) across layouts against plain decoding.

    ``draft``: the ``draft_tokens`` tokens after the prompt (default: plain greedy decoding's, so the
    verification is one that accepts). ``others``: the other rows' prompts of the batch layouts
    (default :func:`companion_prompts`); the compared row is ``row`` of ``batch``.
    """
    runner = model_or_runner if isinstance(model_or_runner, ModelRunner) else ModelRunner(model_or_runner)
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise InvalidInputError("the prompt has no tokens")
    if draft_tokens < 1:
        raise InvalidInputError(f"draft_tokens must be at least 1, got {draft_tokens}")
    if not 0 <= node <= draft_tokens:
        raise InvalidInputError(f"node must be between 0 and draft_tokens ({draft_tokens}), got {node}")
    if batch < 1 or not 0 <= row < batch:
        raise InvalidInputError(f"row must be between 0 and batch - 1 ({batch - 1}), got {row}")
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise InvalidInputError(f"unknown layouts {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    vocab = output_size(runner.model)
    if draft is not None and (len(draft) != draft_tokens or not all(0 <= t < vocab for t in draft)):
        raise InvalidInputError(f"draft must hold {draft_tokens} token ids below {vocab}")
    if not all(0 <= t < vocab for t in prompt):
        raise InvalidInputError(f"token ids must be below the vocabulary size {vocab}")
    others = companion_prompts(prompt, batch - 1) if others is None else [list(p) for p in others]
    if len(others) != batch - 1 or not all(others):
        raise InvalidInputError(f"a batch of {batch} needs {batch - 1} other non-empty prompts")

    recorder = Recorder(runner.model)
    try:
        reference, ref_logits, draft = _plain(runner, recorder, prompt, draft, draft_tokens, node)
        results = []
        for layout in layouts:
            if layout.startswith("batch") and batch == 1:
                continue
            run = _LAYOUT_RUNS[layout]
            calls, logits, description = run(runner, recorder, prompt, draft, node, row, others)
            results.append(_compare(layout, description, reference, ref_logits, calls, logits))
    finally:
        recorder.close()
    return DivergenceReport(int(ref_logits.argmax()), node, results)


def _plain(runner, recorder, prompt, draft, draft_tokens, node):
    """Plain decoding, one token a forward; the step that feeds the compared token is captured."""
    cache = runner.new_cache()
    runner.prefill(cache, prompt[:-1])
    feeds = [prompt[-1], *draft] if draft is not None else [prompt[-1]]
    for step in range(node + 1 if draft is not None else max(draft_tokens, node + 1)):
        if step == node:
            with recorder.capture(1, 1, 0, 0, 0):
                out = runner.forward(cache, [feeds[step]])
                logits = _logits(out, 0)
            calls = recorder.taken
        else:
            out = runner.forward(cache, [feeds[step]])
        if draft is None:
            feeds.append(int(out.logits[0].argmax()))
    return calls, logits, feeds[1 : draft_tokens + 1]


def _chain(runner, recorder, prompt, draft, node, row, others):
    cache = runner.new_cache()
    runner.prefill(cache, prompt[:-1])
    tokens = [prompt[-1], *draft]
    with recorder.capture(1, len(tokens), 0, node, node):
        logits = _logits(runner.forward(cache, tokens), node)
    return recorder.taken, logits, f"1 row, a chain of {len(tokens)} tokens (the model's causal mask)"


def _tree(runner, recorder, prompt, draft, node, row, others):
    """The chain with a wrong sibling beside each of its nodes, siblings first: the compared node
    sits at another index than its depth, under an explicit tree mask."""
    vocab = output_size(runner.model)
    tokens, parents, chain_nodes = [], [], []
    for token in draft:
        parent = chain_nodes[-1] if chain_nodes else -1
        tokens += [(token + 1) % vocab, token]
        parents += [parent, parent]
        chain_nodes.append(len(tokens) - 1)
    tree = TokenTree.from_draft(prompt[-1], Draft(tokens, parents))
    at = 0 if node == 0 else tree.node_of[chain_nodes[node - 1]]
    cache = runner.new_cache()
    runner.prefill(cache, prompt[:-1])
    with recorder.capture(1, len(tree), 0, at, at):
        logits = _logits(runner.forward(cache, tree), at)
    return recorder.taken, logits, f"1 row, a tree of {len(tree)} nodes (tree mask), node {at}"


def _joined_batch(runner, prompts):
    """Each row prefilled alone and joined, as ``engine.Batch`` does; the rows' cached lengths."""
    batch_cache = None
    for r, row_prompt in enumerate(prompts):
        row_cache = runner.new_cache()
        runner.prefill(row_cache, row_prompt[:-1])
        if batch_cache is None:
            batch_cache = row_cache
        else:
            cache_ops.join(batch_cache, r, row_cache)
    return batch_cache, [len(p) - 1 for p in prompts]


def _batch(runner, recorder, prompt, draft, node, row, others):
    """Row ``row`` of a batch decoding one token per row a forward; the others feed their own text."""
    prompts = others[:row] + [prompt] + others[row:]
    cache, lengths = _joined_batch(runner, prompts)
    feeds = [p[-1:] + p[:node] for p in prompts]
    feeds[row] = [prompt[-1], *draft[:node]]
    for step in range(node + 1):
        columns = cache_ops.cache_length(cache)
        trees = [TokenTree([feed[step]], [-1]) for feed in feeds]
        if step == node:
            with recorder.capture(len(prompts), 1, row, 0, row):
                logits = _logits(runner.forward_rows(cache, trees, lengths)[row], 0)
        else:
            runner.forward_rows(cache, trees, lengths)
            runner.commit_rows(cache, columns, lengths, [[0]] * len(prompts))
            lengths = [n + 1 for n in lengths]
    shortest, longest = min(map(len, prompts)), max(map(len, prompts))
    description = f"row {row} of {len(prompts)}, one token each (batch mask; prompts of {shortest}-{longest} tokens)"
    return recorder.taken, logits, description


def _batch_chain(runner, recorder, prompt, draft, node, row, others):
    """Row ``row`` of a batch verifying a chain per row; the other rows' chains are shorter or as
    long, so padding nodes sit beside theirs."""
    prompts = others[:row] + [prompt] + others[row:]
    cache, lengths = _joined_batch(runner, prompts)
    size = len(draft) + 1
    trees = []
    for r, row_prompt in enumerate(prompts):
        tokens = [prompt[-1], *draft] if r == row else (row_prompt[-1:] + row_prompt)[: 1 + r % size]
        trees.append(TokenTree(tokens, list(range(-1, len(tokens) - 1))))
    flat = sum(len(t) for t in trees[:row]) + node
    with recorder.capture(len(prompts), size, row, node, flat):
        logits = _logits(runner.forward_rows(cache, trees, lengths)[row], node)
    description = f"row {row} of {len(prompts)}, a chain of {size} tokens (others 1-{size}; batch mask)"
    return recorder.taken, logits, description


_LAYOUT_RUNS = {"chain": _chain, "tree": _tree, "batch": _batch, "batch-chain": _batch_chain}


def _compare(layout, description, reference: list[Call], ref_logits, calls: list[Call], logits) -> LayoutResult:
    """Match calls by module name and call count, in the reference's execution order."""

    def keyed(items: list[Call]) -> dict[tuple[str, int], Call]:
        seen: dict[str, int] = {}
        out = {}
        for call in items:
            seen[call.name] = seen.get(call.name, -1) + 1
            out[(call.name, seen[call.name])] = call
        return out

    theirs = keyed(calls)
    result = LayoutResult(layout, description)
    for key, ref in keyed(reference).items():
        other = theirs.get(key)
        if other is None or other.output.shape != ref.output.shape or torch.equal(other.output, ref.output):
            continue
        same_input = None
        if ref.input is not None and other.input is not None and ref.input.shape == other.input.shape:
            same_input = torch.equal(ref.input, other.input)
        diff = (other.output.double() - ref.output.double()).abs().max().item()
        result.differences.append(Difference(ref.name, ref.kind, diff, same_input, ref.shape, other.shape))
    result.logits_max_abs = (logits.double() - ref_logits.double()).abs().max().item()
    result.argmax = int(logits.argmax())
    result.argmax_equal = result.argmax == int(ref_logits.argmax())
    return result
