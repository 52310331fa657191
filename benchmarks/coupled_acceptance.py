"""What coupling a draft model's samples to the target's by shared noise costs in acceptance.

Speculative sampling accepts a draft token drawn from q with probability sum_x min(p, q) = 1 - TV.
Seeded requests instead sample every position by the Gumbel-max trick with noise that depends only
on the seed and the position (``speculum.sampling.PositionNoise``): the target's token is
argmax p/E, the draft model's argmax q/E with the same E, and a draft token is accepted when the
two agree. That makes the text independent of what was drafted (Daliri, Musco and Suresh 2024,
"Coupling without communication and drafter-invariant speculative decoding"), at an agreement
rate between (1 - TV)/(1 + TV) and 1 - TV.

This replays the texts of a bench run (its ``autoregressive`` records) through the target and the
draft, and prints both rates per set at each position of those texts, exactly (no timing).

    python benchmarks/coupled_acceptance.py RUN --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from speculum.models import load_model
from speculum.sampling import SAMPLE_BLOCK as BLOCK

DRAWS = 400  # noise draws per position for the agreement rate
MASS = 1 - 1e-5  # tokens kept per position: the likeliest covering this much of p and of q


def rates(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> tuple[float, float, float]:
    """(1 - TV, Gumbel-max agreement, two-level agreement as ``PositionNoise`` draws) of two
    distributions over one vocabulary."""
    overlap = float(torch.minimum(p, q).sum())
    keep = torch.zeros_like(p, dtype=torch.bool)
    for dist in (p, q):
        values, order = dist.sort(descending=True)
        keep[order[: int((values.cumsum(0) < MASS).sum()) + 1]] = True
    ps, qs = p[keep], q[keep]  # the rest wins an argmax with probability < 1 - MASS
    noise = torch.empty(DRAWS, ps.numel()).exponential_(generator=generator)
    agree = ((ps / noise).argmax(-1) == (qs / noise).argmax(-1)).float().mean()
    # two levels: a block of BLOCK tokens by its mass, then a token inside it, one noise vector each
    pb, qb = (torch.nn.functional.pad(d, (0, -d.numel() % BLOCK)).view(-1, BLOCK) for d in (p, q))
    block_noise = torch.empty(DRAWS, pb.shape[0]).exponential_(generator=generator)
    inner_noise = torch.empty(DRAWS, BLOCK).exponential_(generator=generator)
    bp, bq = (pb.sum(1) / block_noise).argmax(-1), (qb.sum(1) / block_noise).argmax(-1)
    tp, tq = (pb[bp] / inner_noise).argmax(-1), (qb[bq] / inner_noise).argmax(-1)
    two_level = ((bp == bq) & (tp == tq)).float().mean()
    return overlap, float(agree), float(two_level)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench output directory (records.jsonl) run at T > 0")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    records = [json.loads(line) for line in (args.run / "records.jsonl").read_text().splitlines()]
    texts = [r for r in records if r.get("method") == "autoregressive" and r.get("prompt_ids")]
    target = load_model(args.model, dtype=args.dtype)[0]
    draft = load_model(args.draft, dtype=args.dtype)[0]
    generator = torch.Generator().manual_seed(0)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for rec in texts:
        ids = torch.tensor([rec["prompt_ids"] + rec["token_ids"]])
        start = len(rec["prompt_ids"]) - 1  # the row predicting the first generated token
        with torch.no_grad():
            rows = [m(ids).logits[0, start:-1].float() / args.temperature for m in (target, draft)]
        vocab = min(r.shape[-1] for r in rows)
        p_all, q_all = (torch.softmax(r[:, :vocab], -1) for r in rows)
        for p, q in zip(p_all, q_all, strict=True):
            for i, value in enumerate((*rates(p, q, generator), 1)):
                sums[rec["dataset"]][i] += value
        print(f"{rec['dataset']}/{rec['question_id']}: {len(p_all)} positions", flush=True)
    print("\n| set | positions | 1 - TV (speculative sampling) | Gumbel-max agreement | two-level (seeded) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    sums["all"] = [sum(s[i] for s in list(sums.values())) for i in range(4)]
    for name, (o, a, h, n) in sums.items():
        print(f"| {name} | {int(n)} | {o / n:.3f} | {a / n:.3f} | {h / n:.3f} | {h / o:.3f} |")


if __name__ == "__main__":
    main()
