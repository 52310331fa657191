"""ANPD ablations (the paper's Figures 3-5, 10-12 shape) from greedy references, without the model.

Greedy verification accepts exactly the draft tokens that equal the target's greedy output, so
once a bench run has recorded the plain greedy output of each prompt (``prompt_ids`` and
``token_ids`` of the baseline rows in ``records.jsonl``), the acceptance of any n-gram setting is
replayed exactly through the engine loop (``speculum.bench.replay``) in milliseconds. A step's
cost is then estimated from a measured verification curve t(K) (``--cost``, from
benchmarks/verify_cost.py), giving an estimated speedup = (tokens x t(1)) / sum of t(tree size).

    python benchmarks/anpd_ablations.py bench-out/gemma-fp32/records.jsonl --name gemma-3-270m \\
        --cost 1:96,2:99,4:104,8:118,16:135 --out benchmarks/plots
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from speculum.bench.replay import replay  # noqa: E402
from speculum.drafters.anpd import AnpdDrafter, Options  # noqa: E402


def load_references(path: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{dataset: [(prompt_ids, greedy_ids), ...]} from the baseline rows of a bench run."""
    refs: dict[str, list] = defaultdict(list)
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("prompt_ids") and rec.get("token_ids"):
            refs[rec["dataset"]].append((rec["prompt_ids"], rec["token_ids"]))
    if not refs:
        sys.exit(f"{path}: no baseline records with prompt_ids (run `speculum bench` with autoregressive)")
    return dict(refs)


def cost_curve(text: str | None):
    """t(K) from 'K:ms,...' (K = tree size incl. the root), interpolated linearly; None = unknown."""
    if not text:
        return None
    points = sorted((int(k), float(v)) for k, v in (p.split(":") for p in text.split(",")))
    ks, ts = zip(*points, strict=True)
    return lambda n: float(np.interp(n, ks, ts))


def evaluate(refs, cost, **params) -> dict:
    """Replay one setting over every prompt; per dataset and overall figures."""
    out = {}
    totals = defaultdict(float)
    for dataset, items in refs.items():
        tokens = steps = drafted = accepted = est_time = 0.0
        for prompt, reference in items:
            stats = replay(prompt, reference, AnpdDrafter(Options(**params)))
            tokens += stats.new_tokens
            steps += stats.target_forwards
            drafted += stats.drafted_tokens
            accepted += stats.accepted_tokens
            if cost:  # each step verified the root plus that step's draft
                est_time += sum(cost(1 + size) for size in stats.draft_sizes)
        row = {
            "mean_acceptance_length": tokens / steps,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "drafted_per_step": drafted / steps,
        }
        if cost:
            row["est_speedup"] = tokens * cost(1) / est_time
        out[dataset] = row
        for key, value in (("tokens", tokens), ("steps", steps), ("drafted", drafted), ("accepted", accepted)):
            totals[key] += value
        totals["time"] += est_time
    overall = {
        "mean_acceptance_length": totals["tokens"] / totals["steps"],
        "draft_acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "drafted_per_step": totals["drafted"] / totals["steps"],
    }
    if cost:
        overall["est_speedup"] = totals["tokens"] * cost(1) / totals["time"]
    out["overall"] = overall
    return out


def plot_lines(path, title, xs, series, ylabel):
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(path, title, datasets, series, ylabel):
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.8 / len(series)
    x = np.arange(len(datasets))
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + i * width, values, width, label=label)
    ax.set_xticks(x + width * (len(series) - 1) / 2, datasets)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="+", help="records.jsonl of bench runs (baseline rows are used)")
    ap.add_argument("--name", default="model", help="model name for titles and file names")
    ap.add_argument("--cost", default=None, help="t(K) in ms as 'K:ms,...' (tree size incl. root)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/plots"))
    args = ap.parse_args(argv)
    refs: dict[str, list] = {}
    for path in args.records:
        for dataset, items in load_references(path).items():
            refs.setdefault(dataset, []).extend(items)
    cost = cost_curve(args.cost)
    args.out.mkdir(parents=True, exist_ok=True)
    metric = "mean_acceptance_length"
    faithful = dict(adaptive=False)  # the paper's setting: fixed K, no evidence thresholds
    lines = [f"## ANPD ablations on {args.name} (replayed from greedy references)", ""]
    n_prompts = sum(len(v) for v in refs.values())
    lines.append(f"{n_prompts} prompts: " + ", ".join(f"{k} {len(v)}" for k, v in refs.items()))
    lines.append("")

    # N in 2..7, MLN on/off (Figures 3-5 shape)
    ns = list(range(2, 8))
    series = {}
    for mln in (True, False):
        series[f"MLN {'on' if mln else 'off'}"] = [
            evaluate(refs, cost, max_ngram_size=n, multi_level=mln, **faithful)["overall"][metric] for n in ns
        ]
    plot_lines(args.out / f"anpd_{args.name}_N_mln.png", "max n-gram size N (K = 7)", ns, series, metric)
    lines += ["| N | " + " | ".join(map(str, ns)) + " |", "|---|" + "---:|" * len(ns)]
    lines += [f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for k, vals in series.items()]
    lines.append("")

    # K in 3..10 (Figures 10-11 shape): acceptance and estimated speedup
    ks = list(range(3, 11))
    rows = {k: evaluate(refs, cost, num_speculative_tokens=k, **faithful)["overall"] for k in ks}
    rows_adaptive = {k: evaluate(refs, cost, num_speculative_tokens=k)["overall"] for k in ks}
    series = {"paper (fixed K)": [rows[k][metric] for k in ks], "adaptive": [rows_adaptive[k][metric] for k in ks]}
    plot_lines(args.out / f"anpd_{args.name}_K.png", "draft length K (N = 5)", ks, series, metric)
    lines += ["| K | " + " | ".join(map(str, ks)) + " |", "|---|" + "---:|" * len(ks)]
    lines += [f"| {k} acc. length | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for k, vals in series.items()]
    if cost:
        est = {
            "paper (fixed K)": [rows[k]["est_speedup"] for k in ks],
            "adaptive": [rows_adaptive[k]["est_speedup"] for k in ks],
        }
        plot_lines(args.out / f"anpd_{args.name}_K_speedup.png", "draft length K (N = 5)", ks, est, "est. speedup")
        lines += [f"| {k} est. speedup | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for k, vals in est.items()]
    lines.append("")

    # runtime update on/off (Figure 12 shape) and chain vs tree, per dataset
    datasets = [*refs, "overall"]
    for title, variants, fname in [
        (
            "runtime update",
            {"update on": dict(runtime_update=True), "update off": dict(runtime_update=False)},
            "update",
        ),
        ("chain vs tree", {"chain": dict(tree=False), "tree": dict(tree=True)}, "tree"),
    ]:
        series = {}
        for label, params in variants.items():
            result = evaluate(refs, cost, **params)
            series[label] = [result[d][metric] for d in datasets]
            if cost and fname == "tree":
                series_speed = [result[d]["est_speedup"] for d in datasets]
                lines.append(
                    f"{label} est. speedup: "
                    + ", ".join(f"{d} {v:.2f}" for d, v in zip(datasets, series_speed, strict=True))
                )
        plot_bars(args.out / f"anpd_{args.name}_{fname}.png", f"ANPD {title} ({args.name})", datasets, series, metric)
        lines += [f"| {title} | " + " | ".join(datasets) + " |", "|---|" + "---:|" * len(datasets)]
        lines += [f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for k, vals in series.items()]
        lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
