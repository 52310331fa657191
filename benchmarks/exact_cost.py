"""What exact mode costs, and what it buys: plain decoding and a speculative method, each with
``exact`` off and on, interleaved per prompt (off/on alternate which goes first), on the report sets.

Reported per method: tokens per second without and with exact mode and their ratio, and how many
outputs are identical to plain decoding's in the same mode (greedy), which in bfloat16 is where
exact mode matters.

    python benchmarks/exact_cost.py --model gemma-3-270m --dtype bfloat16 --methods autoregressive,auto \\
        --datasets humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 128 --out results.md

``--rows N`` decodes the prompts N at a time in one batch: the first row by each method, the others by
plain decoding (one drafting row beside plain rows, whose padding nodes fill out its tree), and reports
the batch's tokens per second and how many rows are identical to the all-plain batch's. With
``--context`` that is exact mode's cost for a batch at a long context::

    python benchmarks/exact_cost.py --model gemma-3-270m --dtype bfloat16 --methods autoregressive,auto \\
        --rows 4 --context 1500 --limit 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import speculum
from speculum import engine
from speculum.bench.datasets import load_datasets
from speculum.bench.report import cpu_flags, machine_info, now_iso
from speculum.methods import SpeculativeConfig


def decode(spec, prompts: list[list[int]], method: str, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's new tokens: one prompt alone by ``method``, or several in one batch, the first
    row by ``method`` and the others by plain decoding."""
    if len(prompts) == 1:
        return [spec.generate(prompts[0], method, max_new_tokens=max_new_tokens).token_ids]
    configs = [SpeculativeConfig.coerce(method)] + [SpeculativeConfig.coerce("autoregressive")] * (len(prompts) - 1)
    drafters, taken = [], {}
    for config in configs:  # every row its own drafter, also where two rows share a method
        n = taken[config.key()] = taken.get(config.key(), 0) + 1
        drafters.append(spec.drafters_for(config, n)[n - 1])
    requests = [
        spec.request(ids, config, drafter, max_new_tokens=max_new_tokens, own_controller=True)
        for ids, config, drafter in zip(prompts, configs, drafters, strict=True)
    ]
    outputs: list[list[int]] = [[] for _ in requests]
    for row, new in engine.run_batch(spec.runner, requests):
        outputs[row].extend(new)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="autoregressive,auto", help="the first is the plain reference")
    parser.add_argument("--datasets", default="humaneval,gsm8k,mt_bench,wmt16")
    parser.add_argument("--limit", type=int, default=5, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        help="lengthen each prompt to about this many tokens with the run's other prompts before it (a long context)",
    )
    parser.add_argument("--modes", default="off,on", help="exact settings to run: off,on (cost) or on (identity only)")
    parser.add_argument(
        "--rows",
        type=int,
        default=1,
        help="prompts decoded together in one batch: the first by each method, the others by plain decoding",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    modes = [{"off": False, "on": True}[m.strip()] for m in args.modes.split(",") if m.strip()]
    specs = {mode: speculum.load(args.model, dtype=args.dtype, exact=mode) for mode in modes}
    first = specs[modes[0]]
    chat = bool(getattr(first.tokenizer, "chat_template", None))
    prompts = [
        first.encode_prompt(p.render(chat and p.chat_default))
        for prompts in load_datasets(args.datasets, args.limit).values()
        for p in prompts
    ]
    if args.context:
        base = [token for prompt in prompts for token in prompt]
        pool = base * (args.context // len(base) + 2)
        starts = [(i * 97) % len(base) for i in range(len(prompts))]  # each prompt a different lead
        prompts = [pool[s : s + max(0, args.context - len(p))] + p for s, p in zip(starts, prompts, strict=True)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not 1 <= args.rows <= len(prompts):
        parser.error(f"--rows must be between 1 and the number of prompts ({len(prompts)})")
    batches = [prompts[i : i + args.rows] for i in range(0, len(prompts) - args.rows + 1, args.rows)]
    for spec in specs.values():  # warm-up: caches, measured costs, first-call overheads
        for method in methods:
            decode(spec, batches[0], method, 8)
    what = "prompt" if args.rows == 1 else "batch"
    rates: dict[tuple[str, bool], list[float]] = {(m, e): [] for m in methods for e in modes}
    identical = {(m, e): 0 for m in methods for e in modes}
    for i, batch in enumerate(batches):
        outputs = {}
        order = modes if i % 2 == 0 else modes[::-1]
        for method in methods:
            for mode in order:
                began = time.perf_counter()
                rows = decode(specs[mode], batch, method, args.max_new_tokens)
                seconds = time.perf_counter() - began
                outputs[method, mode] = rows
                rates[method, mode].append(sum(len(row) for row in rows) / seconds)
        for method in methods:
            for mode in modes:
                pairs = zip(outputs[method, mode], outputs[methods[0], mode], strict=True)
                identical[method, mode] += sum(ours == plain for ours, plain in pairs)
        line = "  ".join(f"{m} {'on' if e else 'off'} {rates[m, e][-1]:.1f}" for m in methods for e in modes)
        print(f"{what} {i + 1}/{len(batches)}: {line} tok/s", flush=True)

    info = machine_info()
    lines = [
        f"# Exact mode: cost and identical outputs ({args.model}, {args.dtype})",
        "",
        f"{now_iso()}; {info.get('cpu')} ({info.get('cpu_capability')}); flags: {cpu_flags()};"
        f" {info.get('threads')} threads; torch {info.get('torch')}",
        "",
        f"{len(prompts)} prompts ({args.datasets}, {args.limit} each"
        + (f", each lengthened to {args.context} tokens with the others before it" if args.context else "")
        + f"), {args.max_new_tokens} new tokens, greedy;"
        + (
            f" decoded in {len(batches)} batches of {args.rows} rows (the first row by the method, the others"
            " by plain decoding; tok/s: the batch's);"
            if args.rows > 1
            else ""
        )
        + f" off and on interleaved per {what}. Identical: outputs equal to plain decoding's in the same mode.",
        "",
    ]
    names = {False: "off", True: "on"}
    head = [f"tok/s {names[e]}" for e in modes] + (["on / off"] if len(modes) == 2 else [])
    head += [f"identical {names[e]}" for e in modes]
    lines += ["| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for method in methods:
        cells = [f"{statistics.mean(rates[method, e]):.2f}" for e in modes]
        if len(modes) == 2:
            pairs = zip(rates[method, False], rates[method, True], strict=True)
            cells.append(f"{statistics.mean(on / off for off, on in pairs):.3f}")
        cells += [f"{identical[method, e]}/{len(batches) * args.rows}" for e in modes]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "    " + " ".join(["python", *sys.argv]), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
