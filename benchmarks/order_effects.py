"""Does a bench row pay for the row that ran just before it? From one ``speculum bench`` run's records.

    python benchmarks/order_effects.py bench-out/i18/qwen-t1-wmt-40-latin [--order rotation] [--out F]

Each record's time per target forward (verification, commit and bookkeeping; prefill left out) is
divided by the baseline's on the same prompt, and the ratios are averaged by the row that ran
right before it on that prompt (``speculum.bench.interleaved_order``, which this run used; runs made
before the balanced order: ``--order rotation``). A method whose forwards cost more after one
predecessor than after the others pays for that row's leftovers (issue #18: after transformers'
assisted generation, which runs the stock model, a second copy of the weights). The first row of
a prompt has no predecessor on that prompt and is left out.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from speculum.bench import interleaved_order

BASE = "autoregressive"


def rotation(methods: list[str], index: int) -> list[str]:
    """The bench's order before the balanced Latin square: the list rotated left by the prompt's place."""
    r = index % len(methods)
    return methods[r:] + methods[:r]


def per_forward_by_predecessor(records: list[dict], order) -> dict[str, dict[str, list[float]]]:
    """method -> predecessor -> ratios of its seconds per forward to the baseline's on the same prompt."""
    prompts: dict[tuple, dict[str, dict]] = {}
    for r in records:
        prompts.setdefault((r["dataset"], str(r["question_id"])), {})[r["method"]] = r
    methods = list(next(iter(prompts.values())))  # records keep the methods' given order
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for index, by_method in enumerate(prompts.values()):
        base = by_method.get(BASE)
        if base is None or not base.get("target_forwards"):
            continue
        base_step = base["time_verify"] / base["target_forwards"]
        ran = order(methods, index)
        for before, method in zip(ran, ran[1:], strict=False):
            r = by_method.get(method)
            if method == BASE or r is None or not r.get("target_forwards") or r.get("time_verify") is None:
                continue
            ratios[method][before].append(r["time_verify"] / r["target_forwards"] / base_step)
    return ratios


def table(ratios: dict[str, dict[str, list[float]]]) -> str:
    predecessors = sorted({p for by in ratios.values() for p in by})
    head = (
        "| method | "
        + " | ".join(f"after `{p}`" for p in predecessors)
        + " | after a transformers row | after a speculum row |"
    )
    lines = [head, "|---|" + "---:|" * (len(predecessors) + 2)]
    for method, by in ratios.items():
        cells = [f"{mean(by[p]):.3f} ({len(by[p])})" if by.get(p) else "–" for p in predecessors]
        hf = [x for p, xs in by.items() if p.startswith("hf_") for x in xs]
        ours = [x for p, xs in by.items() if not p.startswith("hf_") for x in xs]
        cells += [f"{mean(xs):.3f} ({len(xs)})" if xs else "–" for xs in (hf, ours)]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    note = (
        "\nSeconds per target forward (verification, commit, bookkeeping; prefill left out) over the "
        f"baseline's (`{BASE}`) on the same prompt, averaged by the row that ran right before it "
        "on that prompt (prompts in brackets)."
    )
    return "\n".join(lines) + "\n" + note + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a speculum bench --out directory")
    parser.add_argument("--order", choices=("latin", "rotation"), default="latin", help="the order the run used")
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parser.parse_args()
    with open(args.run / "records.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    text = table(per_forward_by_predecessor(records, rotation if args.order == "rotation" else interleaved_order))
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
