"""Where plain decoding's time goes: per generated token, by part of the model, beside the machine's
own memory-read rate; and prefill's tokens per second by prompt length. Exact mode off and on.

    python benchmarks/plain_breakdown.py qwen2.5-coder-1.5b --max-new-tokens 64 --out breakdown-qwen.md
    python benchmarks/plain_breakdown.py gemma-3-270m --max-new-tokens 64

A decode step of one token reads every weight once, so its floor is the weights' bytes over the rate
the machine reads memory at on the same threads (measured first: the sum of a 1 GiB buffer, or a
one-row product with a 1 GiB bfloat16 matrix, whichever reads faster). Each
linear layer kind, the LM head included, is reported with the rate at which it streams its weights.

How: ``spec.generate(..., "autoregressive")`` as a user runs it, with timing hooks on the model's
modules (linear layers by kind, norms, attention, MLP, decoder layers, the decoder): each module's
own time is its wall time less that of the hooked modules inside it, counted only in forwards of
one token. What the hooks do not cover is reported too: the model outside its parts (residual adds,
masks, the embedding) and the engine between forwards (argmax, the loop, Python). The hooks add a
few microseconds a module: the tokens/s without them, in the same run, is beside the table.
Prefill: the runner's own prefill of L tokens of HumanEval text into an empty cache (best of 2).

``--kernel-rows 1,2,4,8,16,64,256`` adds the bfloat16 linear kernels side by side at those row counts:
speculum's row kernel against oneDNN's prepacked one, on random weights of each linear kind's shape (as
many copies as the model has layers, so they stream from memory), interleaved, best of 5.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import speculum
from speculum.bench.datasets import load_datasets
from speculum.bench.report import machine_info, now_iso

# a linear layer's kind, by the end of its name (Llama-like models: Qwen2, Gemma 3, Llama, Mistral)
LINEAR_KINDS = {
    "q_proj": "q/k/v projections", "k_proj": "q/k/v projections", "v_proj": "q/k/v projections",
    "o_proj": "attention output projection", "gate_proj": "gate/up projections", "up_proj": "gate/up projections",
    "down_proj": "down projection", "lm_head": "LM head",
}  # fmt: skip
ORDER = [
    "q/k/v projections", "attention output projection", "gate/up projections", "down projection", "LM head",
    "attention (rotary, scores, cache update)", "MLP activation", "norms", "decoder layers' residual adds",
    "rest of the model (embedding, masks, rotary tables)", "engine between forwards (argmax, loop, Python)",
]  # fmt: skip


def memory_read_rates(threads: int, gib: float = 1.0, reps: int = 5) -> tuple[float, float]:
    """Bytes a second this machine reads on ``threads`` threads: the best of ``reps`` sums of a
    float32 buffer, and of ``reps`` one-row products with a bfloat16 matrix of that size (which
    reaches the memory's rate depends on the CPU's kernels)."""
    torch.set_num_threads(threads)
    size = int(gib * (1 << 30))
    buf = torch.ones(size // 4, dtype=torch.float32)
    matrix = torch.ones(size // 2 // 4096, 4096, dtype=torch.bfloat16)
    row = torch.ones(1, 4096, dtype=torch.bfloat16)

    def best(run) -> float:
        run()  # pages touched, threads up
        fastest = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run()
            fastest = min(fastest, time.perf_counter() - start)
        return size / fastest

    return best(buf.sum), best(lambda: torch.nn.functional.linear(row, matrix))


def kernel_rates(shapes: dict[str, tuple[int, int, int]], rows_list: list[int]) -> list[str]:
    """Markdown rows: per linear kind and row count, GB/s of speculum's row kernel and of oneDNN's packed
    one (``shapes``: kind -> (in, out, copies)), timed interleaved, best of 5."""
    from speculum import kernels

    module = kernels.load(kernels.native_isa() or "portable")
    lines = [
        "| linear kind | rows | row kernel, GB/s | oneDNN, GB/s | oneDNN time / row kernel's |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, (inputs, outputs, copies) in shapes.items():
        weights = [torch.randn(outputs, inputs).mul(0.02).to(torch.bfloat16) for _ in range(copies)]
        ours = [kernels.pack_rows(w) for w in weights]
        theirs = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        del weights
        for rows in rows_list:
            x = torch.randn(rows, inputs).to(torch.bfloat16)
            runs = {
                "rows": lambda x=x, ws=ours, n=outputs: [kernels.rows_linear(module, x, w, None, n) for w in ws],
                "onednn": lambda x=x, ws=theirs: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in ws
                ],
            }
            best = {name: float("inf") for name in runs}
            for _ in range(6):  # the first round warms up, then the best of 5
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - start)
            size = copies * inputs * outputs * 2
            lines.append(
                f"| {kind} | {rows} | {size / best['rows'] / 1e9:.1f} | {size / best['onednn'] / 1e9:.1f} "
                f"| {best['onednn'] / best['rows']:.2f} |"
            )
    return lines


def layer_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """Each linear kind's (in, out) of its first layer, and how many layers of that kind the model has."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in LINEAR_KINDS and hasattr(module, "in_features"):
            inputs, outputs, count = shapes.get(last, (module.in_features, module.out_features, 0))
            shapes[last] = (inputs, outputs, count + 1)
    return shapes


def weight_bytes(linear: torch.nn.Module) -> int:
    """The bytes a one-token forward of ``linear`` reads: its weight matrix (packed or not) in its dtype."""
    blocks = getattr(linear, "packed", None)  # a layer on a GGUF file's own blocks
    if blocks is not None:
        return blocks.nbytes()
    weight = getattr(linear, "packed_weight", None)
    if weight is None:
        weight = linear.weight
    return linear.in_features * linear.out_features * weight.element_size()


def kind_of(name: str, module: torch.nn.Module) -> str | None:
    """Which part of the model ``module`` (named ``name``) is, or None if not timed apart."""
    last = name.rsplit(".", 1)[-1]
    if last in LINEAR_KINDS:
        return LINEAR_KINDS[last]
    if last.endswith("norm") or last.endswith("layernorm"):
        return "norms"
    if last == "self_attn":
        return "attention (rotary, scores, cache update)"
    if last == "mlp":
        return "MLP activation"
    if type(module).__name__.endswith("DecoderLayer"):
        return "decoder layers' residual adds"
    return None


class PartTimer:
    """Timing hooks: each hooked module's own seconds (less the hooked modules inside it), by part,
    in forwards of one token of the decoder (``decoder``), and the weight bytes of each part."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.forwards = 0
        self.active = False
        self._stack: list[list[float]] = []  # [start, seconds of hooked modules inside]
        self._handles = []
        decoder = model.model
        for name, module in model.named_modules():
            kind = "rest of the model (embedding, masks, rotary tables)" if module is decoder else kind_of(name, module)
            if kind is None:
                continue
            if kind in LINEAR_KINDS.values():
                self.bytes[kind] += weight_bytes(module)
            self._hook(module, kind, module is decoder)

    def _hook(self, module: torch.nn.Module, kind: str, is_decoder: bool) -> None:
        def before(mod, args, kwargs):
            if is_decoder:
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.active = ids is not None and ids.shape[-1] == 1
                self.forwards += self.active
            if self.active:
                self._stack.append([time.perf_counter(), 0.0])

        def after(mod, args, kwargs, output):
            if not self.active or not self._stack:
                return
            start, inner = self._stack.pop()
            spent = time.perf_counter() - start
            self.seconds[kind] += spent - inner
            if self._stack:
                self._stack[-1][1] += spent

        self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(module.register_forward_hook(after, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def prompts(spec, count: int) -> list[list[int]]:
    """The first ``count`` unseen chat questions, chat-templated (never used to tune anything)."""
    sets = load_datasets(str(Path(__file__).parent / "data" / "unseen-chat-questions.jsonl"), count)
    chat = bool(getattr(spec.tokenizer, "chat_template", None))
    return [spec.encode_prompt(p.render(chat)) for ps in sets.values() for p in ps][:count]


def decode(spec, ids: list[list[int]], new: int) -> tuple[float, float, int]:
    """(seconds decoding after prefill, seconds of prefill, tokens after the first) over the prompts."""
    decoding = prefill = 0.0
    tokens = 0
    for prompt in ids:
        result = spec.generate(prompt, "autoregressive", max_new_tokens=new)
        stats = result.stats
        prefill += stats.time_prefill
        decoding += stats.wall_time - stats.time_prefill
        tokens += stats.new_tokens - 1  # the first comes from the prefill's forward
    return decoding, prefill, tokens


def breakdown(spec, ids: list[list[int]], new: int) -> dict:
    """Tokens/s without hooks, then one run with them: seconds per token by part."""
    decode(spec, ids[:1], 4)  # warm-up
    plain_seconds, _, plain_tokens = decode(spec, ids, new)
    timer = PartTimer(spec.model)
    try:
        seconds, _, tokens = decode(spec, ids, new)
    finally:
        timer.remove()
    per_token = {kind: s / timer.forwards for kind, s in timer.seconds.items()}
    model_seconds = sum(timer.seconds.values())
    per_token["engine between forwards (argmax, loop, Python)"] = max(seconds - model_seconds, 0.0) / tokens
    return {
        "tok_s": plain_tokens / plain_seconds,
        "tok_s_hooked": tokens / seconds,
        "per_token": per_token,
        "bytes": dict(timer.bytes),
    }


def prefill_rates(spec, lengths: list[int]) -> dict[int, float]:
    """Prefill tokens/s at each prompt length (best of 2, after one warm-up)."""
    from verify_cost import prompt_ids

    text = prompt_ids(spec.tokenizer, spec.model.config.vocab_size, max(lengths))
    spec.runner.prefill(spec.runner.new_cache(), text[:32])
    rates = {}
    for length in lengths:
        best = float("inf")
        for _ in range(2):
            cache = spec.runner.new_cache()
            start = time.perf_counter()
            spec.runner.prefill(cache, text[:length])
            best = min(best, time.perf_counter() - start)
        rates[length] = length / best
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="none, gguf (the file's own blocks) or auto")
    ap.add_argument("--modes", default="off,on", help="exact mode off and/or on")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefill", default="100,400,1500", help="prompt lengths for prefill's tokens/s")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel-rows", default="", help="row counts for the bfloat16 kernels side by side, e.g. 1,4,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(args.threads)
    read_rates = memory_read_rates(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    lengths = [int(x) for x in args.prefill.split(",") if x.strip()]
    found, shapes = {}, {}
    for mode in modes:
        spec = speculum.load(args.model, dtype=args.dtype, exact=mode == "on", quantization=args.quantization)
        shapes = shapes or layer_shapes(spec.model)
        ids = prompts(spec, args.prompts)
        found[mode] = breakdown(spec, ids, args.max_new_tokens)
        found[mode]["prefill"] = prefill_rates(spec, lengths)
        print(f"exact {mode}: {found[mode]['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
        del spec
    kernel_rows = [int(x) for x in args.kernel_rows.split(",") if x.strip()]
    kernel_lines = kernel_rates(shapes, kernel_rows) if kernel_rows else []
    return report(args, argv, read_rates, modes, lengths, found, kernel_lines)


def report(
    args, argv, read_rates: tuple[float, float], modes: list[str], lengths: list[int], found: dict, kernels: list[str]
) -> int:
    mach = machine_info()
    first = found[modes[0]]
    weights = sum(first["bytes"].values())
    read_rate = max(read_rates)
    lines = [
        f"# Plain decoding, step by step ({args.model}, {args.dtype}, quantization {args.quantization})",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/plain_breakdown.py', *(argv or sys.argv[1:])])}`",
        f"- date: {now_iso()}",
        f"- machine: {mach.get('cpu')} (flags {mach.get('cpu_flags')}), {args.threads} threads; torch "
        f"{mach.get('torch')}, transformers {mach.get('transformers')}",
        f"- memory read on {args.threads} threads: {read_rates[0] / 1e9:.1f} GB/s (sum of 1 GiB of float32), "
        f"{read_rates[1] / 1e9:.1f} GB/s (one row times a 1 GiB bfloat16 matrix); the linear layers' weights "
        f"{weights / 1e9:.2f} GB, so a one-token step reads them in no less than {weights / read_rate * 1e3:.1f} ms",
        f"- {args.prompts} unseen chat questions, {args.max_new_tokens} new tokens each, greedy; per token after "
        "the first; tokens/s without the timing hooks, and with them",
        "",
        "| part | " + " | ".join(f"ms/token, exact {m} | share | GB/s" for m in modes) + " |",
        "|---|" + "---:|---:|---:|" * len(modes),
    ]
    for kind in ORDER:
        cells = []
        for mode in modes:
            per_token, total = found[mode]["per_token"], sum(found[mode]["per_token"].values())
            seconds = per_token.get(kind, 0.0)
            size = found[mode]["bytes"].get(kind)
            rate = f"{size / seconds / 1e9:.1f}" if size and seconds > 0 else ""
            cells.append(f"{seconds * 1e3:.2f} | {seconds / total:.1%} | {rate}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    cells = []
    for mode in modes:
        total = sum(found[mode]["per_token"].values())
        linear = sum(found[mode]["per_token"].get(k, 0.0) for k in set(LINEAR_KINDS.values()))
        cells.append(f"**{total * 1e3:.1f}** | | {weights / linear / 1e9:.1f} (linear layers)")
    lines.append("| step | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| | " + " | ".join(f"exact {m}" for m in modes) + " |",
        "|---|" + "---:|" * len(modes),
        "| tokens/s (no hooks) | " + " | ".join(f"{found[m]['tok_s']:.2f}" for m in modes) + " |",
        "| tokens/s (hooked) | " + " | ".join(f"{found[m]['tok_s_hooked']:.2f}" for m in modes) + " |",
    ]
    for length in lengths:
        rates = " | ".join(f"{found[m]['prefill'][length]:.0f}" for m in modes)
        lines.append(f"| prefill tokens/s, {length} tokens | {rates} |")
    if kernels:
        lines += ["", "bfloat16 linear kernels side by side (random weights of each kind's shape, from memory):", ""]
        lines += kernels
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
