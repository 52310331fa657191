"""SpecDec++'s Figure 4 by exact replay: discard rate vs verification rate of every length policy.

Each point is one policy setting over the same prompts: fixed K, transformers' heuristic, the
confidence stop, SpecDec++ over thresholds h, and the oracle (stop exactly before the first
rejection). Greedy acceptance is exact: the target's outputs come from a ``speculum bench`` run's
``autoregressive`` records and the draft model runs for real against them (``speculum.bench.replay``),
so no target forward is needed and many more prompts fit than in timed runs.

    python benchmarks/specdecpp_front.py bench-out/qwen-issue7-128 --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --head heads/qwen-0.5b --out benchmarks/results/specdecpp-front.md \\
        --plot benchmarks/plots/specdecpp_front.png

Discard rate = drafted tokens the target rejected, per generated token; verification rate = target
forwards per generated token (both lower is better; the paper's Figure 4 axes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import torch

import speculum
from speculum.bench.replay import replay
from speculum.bench.report import machine_info, now_iso
from speculum.methods import SpeculativeConfig

FIXED = [2, 4, 6, 8, 10, 12, 14]
THRESHOLDS = [0.1, 0.3, 0.5, 0.7, 0.9]
CONFIDENCE = [0.2, 0.4, 0.6]


def settings(head: str | None, max_tokens: int) -> list[tuple[str, str, dict]]:
    """(family, label, draft_model parameters) for every point of the figure."""
    points = [("fixed K", f"K={k}", {"length_policy": "fixed", "num_speculative_tokens": k}) for k in FIXED]
    points.append(("heuristic", "heuristic", {"length_policy": "heuristic", "num_speculative_tokens": 5}))
    points += [
        ("confidence", f"conf {c}", {"length_policy": "confidence", "num_speculative_tokens": max_tokens,
                                     "confidence_threshold": c})
        for c in CONFIDENCE
    ]  # fmt: skip
    if head:
        points += [
            ("SpecDec++", f"h={h}", {"length_policy": "specdecpp", "acceptance_head": head, "stop_threshold": h,
                                     "num_speculative_tokens": max_tokens})
            for h in THRESHOLDS
        ]  # fmt: skip
    points.append(("oracle", "oracle", {"length_policy": "oracle", "num_speculative_tokens": max_tokens}))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="speculum bench --out directories with autoregressive records")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--head", help="an acceptance-head checkpoint (SpecDec++ points)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=20, help="the bound for adaptive policies (paper: 20)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompts = []
    for run in args.runs:
        for line in (run / "records.jsonl").open():
            r = json.loads(line)
            if r["method"] == "autoregressive":
                prompts.append((r["dataset"], r["prompt_ids"], r["token_ids"]))
    spec = speculum.load(args.model, args.draft, dtype=args.dtype)
    results: dict[str, dict] = {}
    for family, label, params in settings(args.head, args.max_draft):
        config = SpeculativeConfig.coerce("draft_model", **params)
        drafter = config.drafter_class()(config.options(), dataclasses.replace(spec.resources(), shared={}))
        totals = defaultdict(int)
        for _, ids, reference in prompts:
            if family == "oracle":
                drafter.policy.set_reference(list(ids) + list(reference))
            stats = replay(ids, reference, drafter, spec.eos_token_ids)
            for key in ("new_tokens", "drafted_tokens", "accepted_tokens", "target_forwards", "draft_forwards"):
                totals[key] += getattr(stats, key)
        n = totals["new_tokens"]
        results[label] = {
            "family": family,
            "discard_rate": (totals["drafted_tokens"] - totals["accepted_tokens"]) / n,
            "verification_rate": totals["target_forwards"] / n,
            "draft_forwards_per_token": totals["draft_forwards"] / n,
        }
        print(f"{label}: {results[label]}", file=sys.stderr, flush=True)

    info = machine_info()
    lines = [
        "# Discard rate vs verification rate (SpecDec++ Figure 4 shape, exact greedy replay)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {now_iso()}; machine: {info['cpu']}",
        f"- target `{args.model}`, draft `{args.draft}`; {len(prompts)} prompts from {', '.join(map(str, args.runs))}",
        "",
        "| policy | setting | discard rate | verification rate | draft forwards / token |",
        "|---|---|---:|---:|---:|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {r['family']} | {label} | {r['discard_rate']:.3f} | {r['verification_rate']:.3f} | "
            f"{r['draft_forwards_per_token']:.3f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.8))
        families = dict.fromkeys(r["family"] for r in results.values())
        for family in families:
            pts = [(r["discard_rate"], r["verification_rate"], k) for k, r in results.items() if r["family"] == family]
            style = "*" if family == "oracle" else "o-" if family in ("fixed K", "SpecDec++", "confidence") else "s"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=family, markersize=9 if style == "*" else 5)
            for x, y, k in pts:
                ax.annotate(k, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("discard rate (rejected draft tokens per generated token)")
        ax.set_ylabel("verification rate (target forwards per generated token)")
        ax.set_title(f"{args.model} / {args.draft}, greedy, {len(prompts)} prompts", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
