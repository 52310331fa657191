"""Issue #9's tables and figure from one `speculum bench` run (its records.jsonl):

- Table 1 (the CTC-drafter paper's Table 1 shape): mean acceptance length β and speedup over plain
  decoding per prompt set, for each method of the run;
- Table 2 (its ablation): the head variants side by side (linear heads + CE vs one attention layer +
  CTC, each with and without the CTC transform), overall β and speedup;
- Figure 3 (its time split): per method, the share of wall time spent drafting (the heads'
  forward), building the tree (top-k, alignments, the CTC transform, the trie), verifying, and the
  rest (prefill included), as a PNG and a markdown table.

    python benchmarks/head_drafters_report.py bench-out/gemma-heads --out benchmarks/results/head-drafters.md \
        --plot benchmarks/plots/head_drafters_time.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines() if line.strip()]


def short(method: str) -> str:
    """A method label without checkpoint paths (heads=DIR -> heads=NAME)."""
    parts = []
    for part in method.split(","):
        if "heads=" in part:
            part = "heads=" + Path(part.split("heads=", 1)[1]).name
        parts.append(part)
    return ",".join(parts)


def ratio(records: list[dict], baseline: str, method: str) -> float:
    """Speedup as total tokens / total time, method vs baseline over the same prompts."""

    def rate(name):
        rows = [r for r in records if r["method"] == name]
        return sum(r["new_tokens"] for r in rows) / sum(r["wall_time"] for r in rows)

    return rate(method) / rate(baseline)


def beta(rows: list[dict]) -> float | None:
    lengths = [x for r in rows for x in (r.get("accept_lengths") or [])]
    return sum(lengths) / len(lengths) if lengths else None


def cell(b: float | None, speedup: float) -> str:
    return f"{b:.2f} / {speedup:.2f}×" if b else f"– / {speedup:.2f}×"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a speculum bench output directory")
    parser.add_argument("--baseline", default="autoregressive")
    parser.add_argument("--ablation", default="", help="comma-free list, ';'-separated, of method labels for Table 2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    records = load(args.run)
    summary = json.loads((args.run / "summary.json").read_text()) if (args.run / "summary.json").exists() else {}
    methods = list(dict.fromkeys(r["method"] for r in records))
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    by = defaultdict(list)
    for r in records:
        by[(r["dataset"], r["method"])].append(r)

    lines = ["# Head drafters: β, speedup, ablation, time split", ""]
    for key in ("command", "date"):
        if summary.get(key):
            lines.append(f"- {key}: `{summary[key]}`")
    lines += ["", "## Table 1: mean acceptance length β / speedup over plain decoding", ""]
    lines.append("| method | " + " | ".join(datasets) + " | overall | identical |")
    lines.append("|---|" + "---:|" * (len(datasets) + 2))
    for m in methods:
        cells = []
        for d in datasets:
            rows = by[(d, m)]
            b = beta(rows)
            sub = [r for r in records if r["dataset"] == d]
            cells.append(
                f"{b:.2f} / {ratio(sub, args.baseline, m):.2f}×" if b else f"– / {ratio(sub, args.baseline, m):.2f}×"
            )
        rows = [r for r in records if r["method"] == m]
        b = beta(rows)
        same = sum(bool(r.get("equal_to_baseline")) for r in rows)
        overall = (
            f"{b:.2f} / {ratio(records, args.baseline, m):.2f}×"
            if b
            else f"– / {ratio(records, args.baseline, m):.2f}×"
        )
        lines.append(f"| `{short(m)}` | " + " | ".join(cells) + f" | {overall} | {same}/{len(rows)} |")

    ablation = [a for a in args.ablation.split(";") if a]
    if ablation:
        lines += ["", "## Table 2: ablation (overall)", "", "| variant | β | speedup |", "|---|---:|---:|"]
        for m in ablation:
            rows = [r for r in records if r["method"] == m]
            if rows:
                lines.append(f"| `{short(m)}` | {beta(rows):.2f} | {ratio(records, args.baseline, m):.2f}× |")

    lines += ["", "## Figure 3: where the time goes (% of wall time, all prompts)", ""]
    lines.append("| method | draft (heads) | tree (top-k, CTC transform, trie) | verify | other (prefill incl.) |")
    lines.append("|---|---:|---:|---:|---:|")
    split = {}
    for m in methods:
        rows = [r for r in records if r["method"] == m and r.get("time_verify") is not None]
        if not rows:
            continue
        wall = sum(r["wall_time"] for r in rows)
        tree = sum((r.get("drafter") or {}).get("time_tree", 0.0) for r in rows)
        draft = sum(r.get("time_draft", 0.0) for r in rows) - tree
        verify = sum(r["time_verify"] for r in rows)
        other = wall - draft - tree - verify
        split[short(m)] = [100 * x / wall for x in (draft, tree, verify, other)]
        lines.append(f"| `{short(m)}` | " + " | ".join(f"{x:.1f}" for x in split[short(m)]) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    if args.plot and split:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(split)
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(names)))
        left = [0.0] * len(names)
        for i, (part, colour) in enumerate(
            zip(
                ("draft", "tree / CTC transform", "verify", "other"),
                ("#4c72b0", "#dd8452", "#55a868", "#8c8c8c"),
                strict=True,
            )
        ):
            values = [split[n][i] for n in names]
            ax.barh(names, values, left=left, color=colour, label=part)
            left = [a + b for a, b in zip(left, values, strict=True)]
        ax.set_xlabel("% of wall time")
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
