"""What a verification forward over n draft nodes costs as a chain and as a tree, through speculum's runner.

A chain goes through the model's own causal masking (plain decoding's path); a tree of the same size
(two chains below the root, as ``speculum.costs`` measures t(n)) takes an explicit additive mask and
per-node positions. The cost model has one curve for both, measured on trees; this says how far apart
they are on this machine:

    python benchmarks/chain_vs_tree.py gemma-3-270m
    python benchmarks/chain_vs_tree.py qwen2.5-coder-1.5b --dtype bfloat16 --sizes 1,2,4,8 --reps 10

Median milliseconds over ``--reps`` forwards after a ``--prefix``-token cache, every shape interleaved
in each repetition (a slow phase of the CPU then lands on all of them), with a machine/date header.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

import speculum
from speculum.bench.report import machine_info, now_iso
from speculum.cache import crop
from speculum.costs import two_branch_tree
from speculum.tree import TokenTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16", help="draft sizes n, root included")
    parser.add_argument("--prefix", type=int, default=300, help="tokens in the cache before the draft")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = speculum.load(args.model, dtype=args.dtype)
    runner = spec.runner
    ids = [1000 + i for i in range(args.prefix + 1)]
    cache = runner.new_cache()
    runner.prefill(cache, ids[:-1])
    past = len(ids) - 1
    shapes: dict[tuple[str, int], TokenTree] = {}
    for n in (int(s) for s in args.sizes.split(",")):
        shapes[("chain", n)] = TokenTree([ids[-1]] + ids[: n - 1], list(range(-1, n - 1)))
        if n > 2:  # (a tree of two nodes is a chain)
            shapes[("tree", n)] = two_branch_tree(ids, n)
    times: dict[tuple[str, int], list[float]] = {shape: [] for shape in shapes}
    for rep in range(args.reps + 1):
        for shape, tree in shapes.items():
            start = time.perf_counter()
            runner.forward(cache, tree).logits[0].argmax()  # the verifier reads at least the root's row
            elapsed = time.perf_counter() - start
            crop(cache, past)
            if rep:  # the first pass warms every shape up
                times[shape].append(elapsed)
    ms = {shape: 1000 * statistics.median(t) for shape, t in times.items()}
    info = machine_info()
    where = f"{info['cpu']}, {info['threads']} threads, torch {info.get('torch')}, dtype {runner.dtype}"
    print(f"`{shlex.join(['python', *sys.argv])}` ({now_iso()}; {where})\n")
    print("| n | chain ms | tree ms | tree / chain | chain / t(1) |")
    print("|---:|---:|---:|---:|---:|")
    one = ms[("chain", 1)]
    for (kind, n), value in ms.items():
        if kind != "chain":
            continue
        tree = ms.get(("tree", n))
        cells = f"{tree:.1f} | {tree / value:.2f}" if tree is not None else "– | –"
        print(f"| {n} | {value:.1f} | {cells} | {value / one:.2f} |")


if __name__ == "__main__":
    main()
