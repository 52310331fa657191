"""Show that low-precision mismatches in a bench run are argmax near-ties, not bugs.

For every output that differs from the baseline, recompute the baseline's prefix up to the first
differing token with one plain forward, and print the gap between the two competing tokens'
logits (in the run's dtype and in float32). A gap of the order of the dtype's rounding step
(bfloat16 keeps 8 bits of mantissa: ~0.06 at a logit of 16) is a near-tie that batched and
one-token kernels may round either way.

    python benchmarks/near_ties.py bench-out/gemma-bf16 --model gemma-3-270m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from speculum.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench output directory (records.jsonl)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    records = [json.loads(line) for line in (args.run / "records.jsonl").read_text().splitlines()]
    baselines = {(r["dataset"], r["question_id"]): r for r in records if r.get("prompt_ids")}
    cases = [r for r in records if r.get("equal_to_baseline") is False]
    models = {d: load_model(args.model, dtype=d)[0] for d in (args.dtype, "float32")}
    print(f"| prompt | method | token | baseline's token | other's token | gap in {args.dtype} | gap in float32 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rec in cases:
        base = baselines[(rec["dataset"], rec["question_id"])]
        i = rec["first_mismatch"]
        prefix = base["prompt_ids"] + base["token_ids"][:i]
        a, b = base["token_ids"][i], rec["token_ids"][i]
        gaps = []
        for model in models.values():
            with torch.no_grad():
                logits = model(torch.tensor([prefix]), logits_to_keep=1).logits[0, -1].float()
            gaps.append(f"{(logits[a] - logits[b]).item():+.4f}")
        print(f"| {rec['dataset']}/{rec['question_id']} | {rec['method']} | {i} | {a} | {b} | {gaps[0]} | {gaps[1]} |")


if __name__ == "__main__":
    main()
