"""What prepacking (``speculum.accel``) saves on a whole model: stock against prepacked layers, in pairs.

    python benchmarks/prepack_ab.py qwen2.5-coder-1.5b [--dtype bfloat16] [--rounds 15] [--sizes 1,4,8]

The model is loaded once (stock layers) and a prepacked twin of every linear layer is built beside
it; each round times one forward of each tree size through the engine's runner (after a cache of
``--prefix`` tokens, one untimed forward first) with the stock layers and with the prepacked ones,
the order alternating, so a phase where other jobs load the CPU slows both alike. Printed: the
median and minimum of each, and the median of the paired ratios prepacked / stock with their range.
It also checks that both give the same logits (bfloat16: the same bits; float32: the last bits may
differ, as with any other kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import speculum
from speculum import accel
from speculum.bench.report import machine_info, now_iso
from speculum.cache import crop
from speculum.costs import two_branch_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="gemma-3-270m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,4,8", help="tree sizes (root included)")
    parser.add_argument("--prefix", type=int, default=300, help="cached tokens before the timed forwards")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(n) for n in args.sizes.split(",")]

    spec = speculum.load(args.model, dtype=args.dtype, prepack=False)
    runner, model = spec.runner, spec.runner.model
    stock = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    packed = [(name, accel.PackedLinear(m)) for name, m in stock]
    if not accel.supported(model):
        raise SystemExit(f"prepacking does not apply to {args.model} in {args.dtype} on this machine")

    def use(layers) -> None:
        for name, layer in layers:
            model.set_submodule(name, layer)

    vocab = model.get_input_embeddings().num_embeddings
    ids = [(i * 7919 + 10) % min(vocab, 100_000) for i in range(args.prefix + 1)]
    times: dict[tuple[str, int], list[float]] = {(mode, n): [] for mode in ("stock", "packed") for n in sizes}
    with torch.inference_mode():
        probe = torch.tensor([ids[:32]])
        use(stock)
        reference = model(probe).logits
        use(packed)
        same = torch.equal(model(probe).logits, reference)
        cache = runner.new_cache()
        runner.prefill(cache, ids[:-1])
        past = len(ids) - 1
        for round_ in range(args.rounds):
            order = (("stock", stock), ("packed", packed)) if round_ % 2 else (("packed", packed), ("stock", stock))
            for mode, layers in order:
                use(layers)
                for n in sizes:
                    tree = two_branch_tree(ids, n)
                    runner.forward(cache, tree)  # untimed: the first forward after a swap warms caches
                    crop(cache, past)
                    began = time.perf_counter()
                    out = runner.forward(cache, tree)
                    out.logits[0].argmax()
                    times[(mode, n)].append(time.perf_counter() - began)
                    crop(cache, past)
    use(stock)

    mach = machine_info()
    print(f"# prepacked against stock layers: {args.model}, {args.dtype}\n")
    print(f"- date: {now_iso()}; machine: {mach.get('cpu')}, {torch.get_num_threads()} threads; "
          f"torch {mach.get('torch')}, transformers {mach.get('transformers')}")  # fmt: skip
    print(f"- {args.rounds} interleaved rounds, cache of {args.prefix} tokens; same logits: {same}\n")
    print("| tree size | stock median (min), ms | prepacked median (min), ms | prepacked / stock, paired [range] |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        s, p = times[("stock", n)], times[("packed", n)]
        ratios = sorted(b / a for a, b in zip(s, p, strict=True))
        print(f"| {n} | {1e3 * statistics.median(s):.0f} ({1e3 * min(s):.0f}) | "
              f"{1e3 * statistics.median(p):.0f} ({1e3 * min(p):.0f}) | "
              f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] |")  # fmt: skip


if __name__ == "__main__":
    main()
