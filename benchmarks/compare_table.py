"""Compact comparison from a bench run's summary.json, each side against its own plain decoding.

speculum rows are divided by speculum's ``autoregressive`` (same kernels), transformers' rows by
``hf_generate``; "vs HF plain" divides everything by ``hf_generate`` (what a stock transformers
user gets). Efficiency = speedup / mean acceptance length (ANPD paper's measure).

    python benchmarks/compare_table.py bench-out/qwen-fp32/summary.json
"""

from __future__ import annotations

import argparse
import json


def main(path: str) -> None:
    summary = json.load(open(path))
    groups = summary["groups"]
    methods = summary["methods"]
    datasets = [d for d in groups if d != "overall"] + ["overall"]
    print("| method | " + " | ".join(datasets) + " | vs HF plain (overall) | mean acc. length | efficiency |")
    print("|---|" + "---:|" * (len(datasets) + 3))
    for method in methods:
        base = "hf_generate" if method.startswith("hf_") else "autoregressive"
        cells = []
        for d in datasets:
            row, ref = groups[d].get(method), groups[d].get(base)
            cells.append(f"{row['tokens_per_second'] / ref['tokens_per_second']:.2f}×" if row and ref else "–")
        overall = groups["overall"]
        row, hf = overall.get(method), overall.get("hf_generate")
        vs_hf = f"{row['tokens_per_second'] / hf['tokens_per_second']:.2f}×" if row and hf else "–"
        acc = row.get("mean_acceptance_length") if row else None
        own = row["tokens_per_second"] / overall[base]["tokens_per_second"] if row and base in overall else None
        eff = f"{own / acc:.2f}" if acc and own and not method.startswith("hf_") else "–"
        print(f"| `{method}` | " + " | ".join(cells) + f" | {vs_hf} | {acc:.2f} | {eff} |" if acc else
              f"| `{method}` | " + " | ".join(cells) + f" | {vs_hf} | – | {eff} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", help="a bench run's summary.json")
    main(parser.parse_args().summary)
