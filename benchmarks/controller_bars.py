"""From one bench run's summary.json: every method against plain decoding on each set (controller on
and off), ``auto`` against the best single method, the controller's share of the wall time.

    python benchmarks/controller_bars.py bench-out/gemma-fp32/summary.json [--out table.md]

Speedups are ratios of tokens/s to speculum's ``autoregressive`` row of the same run (transformers'
rows to ``hf_generate`` when the run has it, else to ``autoregressive``). "Best single" is the
fastest speculum method on that set other than ``auto`` (either controller setting), i.e. the best
a user could have picked by hand with hindsight; the mean over sets is the plain mean of per-set
speedups.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculum.bench.report import repeats_of

BASE = "autoregressive"


def speedups(summary: dict) -> tuple[list[str], dict[str, dict[str, float]]]:
    groups = summary["groups"]
    sets = [d for d in groups if d != "overall"]
    table: dict[str, dict[str, float]] = {}
    for method in summary["methods"]:
        if method == BASE:
            continue
        ref_name = "hf_generate" if method.startswith("hf_") and method != "hf_generate" else BASE
        for d in sets:
            row, ref = groups[d].get(method), groups[d].get(ref_name) or groups[d].get(BASE)
            if row and ref and ref["tokens_per_second"]:
                table.setdefault(method, {})[d] = row["tokens_per_second"] / ref["tokens_per_second"]
    return sets, table


def report(summary: dict) -> str:
    sets, table = speedups(summary)
    overall = summary["groups"].get("overall", {})
    mean = {m: sum(v[d] for d in sets) / len(sets) for m, v in table.items() if all(d in v for d in sets)}
    # a speculum method, not auto, not a row that runs plain decoding again (autoregressive#2: the noise floor)
    again = set(repeats_of(BASE, list(table)))
    single = [m for m in table if m != "auto" and not m.startswith("hf_") and m not in again]
    best = {d: max(single, key=lambda m: table[m].get(d, 0.0)) for d in sets} if single else {}
    lines = ["| method | " + " | ".join(sets) + " | mean over sets | lowest | plain rounds % | controller % wall |"]
    lines.append("|---|" + "---:|" * (len(sets) + 4))
    for m, v in table.items():
        cells = " | ".join(f"{v[d]:.2f}×" if d in v else "–" for d in sets)
        row = overall.get(m, {})
        plain = row.get("rounds_plain_pct")
        control = row.get("control_pct")
        low = min(v.values()) if v else None
        lines.append(
            f"| `{m}` | {cells} | {mean[m]:.2f}× | {low:.2f}× | "
            f"{'–' if plain is None else f'{plain:.0f}'} | {'–' if control is None else f'{control:.2f}'} |"
        )
    if "auto" in table and best:
        lines.append("")
        auto = table["auto"]
        ratios = ", ".join(
            f"{d} {auto[d] / table[best[d]][d]:.2f} (best: `{best[d]}` {table[best[d]][d]:.2f}×)" for d in sets
        )
        best_mean = max(single, key=lambda m: mean.get(m, 0.0))
        lines.append(f"- `auto` / best single method per set: {ratios}")
        lines.append(
            f"- mean over sets: `auto` {mean['auto']:.2f}× against the best single method `{best_mean}` "
            f"{mean[best_mean]:.2f}×"
        )
    controlled = [m for m in table if "controller=true" in m or m == "auto"]
    if controlled:
        worst = min(controlled, key=lambda m: min(table[m].values()))
        lines.append(f"- lowest controlled row: `{worst}` {min(table[worst].values()):.2f}×")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="a bench run's summary.json")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args()
    summary = json.loads(Path(args.summary).read_text())
    text = report(summary)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
