"""Ouroboros studies by exact replay: the paper's ablation (Table 4 shape), a K sweep (Figure 6 shape)
and warm vs cold phrase pools (Table 17 shape), per prompt set, as markdown tables and a PNG.

Acceptance is exact: the target's greedy outputs come from a ``speculum bench`` run's
``autoregressive`` records, and each configuration runs through the engine with the target
replaced by them (``speculum.bench.replay``) while the draft model runs for real; the target
itself runs only where verification phrases read its predictions at rejected draft tokens (one
forward at such a step, not timed: a real run gets those rows from its verification forward).
Speed is predicted as in ``speculum tune``: measured drafting time + a measured verification-cost
curve t(K) per step + the engine's bookkeeping. Where the bench run timed the same configuration, its
measured speedup is printed beside the prediction.

    python benchmarks/ouroboros_studies.py bench-out/qwen-issue7b \\
        --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --config benchmarks/results/ouroboros-qwen-tuned.json --warm-records bench-out/tune3 \\
        --out benchmarks/results/ouroboros-studies.md --plot benchmarks/plots/ouroboros_studies.png
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

import speculum
from speculum.bench.report import machine_info, now_iso
from speculum.costs import CostModel
from speculum.methods import SpeculativeConfig
from speculum.tune import ReplayScorer, TunePrompt, plain_seconds_per_token

COMPONENTS = ["phrase_drafting", "lengthen", "verification_phrases", "reuse_history", "context_phrases"]
K_VALUES = [0, 1, 2, 3, 5, 8]


def read_prompts(run_dir: Path) -> tuple[dict[str, list[TunePrompt]], list[dict]]:
    """Per dataset, the prompts with their autoregressive reference and timings; and every record."""
    records = [json.loads(line) for line in (run_dir / "records.jsonl").open()]
    by_set: dict[str, list[TunePrompt]] = defaultdict(list)
    for r in records:
        if r["method"] == "autoregressive":
            by_set[r["dataset"]].append(TunePrompt(r["prompt_ids"], r["token_ids"], r["time_prefill"], r["wall_time"]))
    return dict(by_set), records


def measured_speedups(records: list[dict]) -> dict[tuple[str, str], float]:
    """(method label, dataset) -> tokens/s ratio to autoregressive over the same prompts."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        t = totals[(r["method"], r["dataset"])]
        t[0] += r["new_tokens"]
        t[1] += r["wall_time"]
    tps = {k: v[0] / v[1] for k, v in totals.items() if v[1] > 0}
    return {k: v / tps[("autoregressive", k[1])] for k, v in tps.items() if ("autoregressive", k[1]) in tps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a speculum bench --out directory with autoregressive records")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", required=True, help="the ouroboros config file the studies vary (speculum tune --out)")
    ap.add_argument("--warm-records", type=Path, help="a bench run on other prompts: its outputs pre-warm the pool")
    ap.add_argument("--max-new-tokens", type=int, help="replay only the first N tokens of each reference")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompts, records = read_prompts(args.run)
    measured = measured_speedups(records)
    base = SpeculativeConfig.from_file(args.config)
    tuned = base.all_params()
    spec = speculum.load(args.model, args.draft, dtype=args.dtype)
    everything = [p for ps in prompts.values() for p in ps]
    typical = sorted(everything, key=lambda p: len(p.ids))[len(everything) // 2]
    cost = CostModel.measure(spec.runner, typical.ids + typical.reference[: len(typical.reference) // 2], reps=5)
    cost = cost.with_plain_step(plain_seconds_per_token(everything))
    if args.max_new_tokens:  # a greedy output's prefix is the greedy output of a shorter request
        n = args.max_new_tokens
        for ps in prompts.values():
            for p in ps:
                share = min(n, len(p.reference)) / len(p.reference)
                p.plain_time = p.prefill_time + (p.plain_time - p.prefill_time) * share
                p.reference = p.reference[:n]
    warm = read_prompts(args.warm_records)[0] if args.warm_records else {}
    warm_prompts = [p for ps in warm.values() for p in ps]
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731

    sets = list(prompts)
    gamma = tuned.get("num_speculative_tokens", 6)
    off = dict.fromkeys(COMPONENTS, False)
    ladder = [("speculative decoding (`draft_model`, fixed γ)", "draft_model", {"length_policy": "fixed"})]
    on: dict = {}
    for name in COMPONENTS:
        on[name] = True
        label = f"+ {name.replace('_', ' ')}" + (" (extension)" if name == "context_phrases" else "")
        ladder.append((label, "ouroboros", {**tuned, **off, **on}))
    ladder.append(("paper defaults (γ=6, W=15, N=5, K=3, G=15), all four", "ouroboros", {"length_policy": "fixed"}))
    ladder[0] = (ladder[0][0], "draft_model", {"length_policy": "fixed", "num_speculative_tokens": gamma})

    table: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)  # row -> set -> (speedup, acc. length)
    ksweep: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
    pools: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for s in sets:
        log(f"== {s}")
        scorers = {m: ReplayScorer(spec, m, prompts[s], cost, log=log) for m in ("draft_model", "ouroboros")}
        plain = scorers["ouroboros"].plain_tokens_per_second

        def score(method, params, warm_up=(), _scorers=scorers, _plain=plain):
            ev = _scorers[method].score(params, warm_up=warm_up)
            return ev.tokens_per_second / _plain, ev.mean_acceptance_length

        for label, method, params in ladder:
            table[label][s] = score(method, params)
        for k in K_VALUES:
            ksweep[k][s] = score("ouroboros", {**tuned, "num_phrase_candidates": k})
        pools["cold (each request starts empty)"][s] = score("ouroboros", {**tuned, "reuse_history": False})
        pools["warm (one pool over the set's prompts in order)"][s] = score("ouroboros", {**tuned})
        if warm_prompts:
            pools["pre-warmed (pool first filled on the tuning prompts)"][s] = score(
                "ouroboros", {**tuned}, warm_up=warm_prompts
            )

    info = machine_info()
    lines = [
        "# Ouroboros studies (exact replay, predicted speed)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {now_iso()}",
        f"- machine: {info['cpu']}, {args.threads} threads; torch {info.get('torch')}, "
        f"transformers {info.get('transformers')}",
        f"- target `{args.model}`, draft `{args.draft}`, dtype {str(spec.model.dtype).replace('torch.', '')}; "
        f"references: `{args.run}` ({sum(len(v) for v in prompts.values())} prompts"
        + (f", first {args.max_new_tokens} tokens of each)" if args.max_new_tokens else ")"),
        f"- tuned configuration (`{args.config}`): {', '.join(f'{k}={v}' for k, v in tuned.items())}",
        "- t(K) used: " + ", ".join(f"K={k} {t * 1000:.0f} ms" for k, t in cost.points),
        "- cells: predicted speedup over plain decoding / mean acceptance length (tokens per target forward)",
        "",
    ]

    def block(title: str, rows: dict, first: str) -> None:
        lines.extend([f"## {title}", "", f"| {first} | " + " | ".join(sets) + " | mean speedup |"])
        lines.append("|---|" + "---:|" * (len(sets) + 1))
        for label, cells in rows.items():
            mean = statistics.mean(cells[s][0] for s in sets)
            row = " | ".join(f"{cells[s][0]:.2f}× / {cells[s][1]:.2f}" for s in sets)
            lines.append(f"| {label} | {row} | {mean:.2f}× |")
        lines.append("")

    block("Ablation (Table 4 shape): components added one by one", table, "configuration")
    block("K sweep (Figure 6 shape): phrases lengthening each draft", {f"K={k}": v for k, v in ksweep.items()}, "K")
    block("Warm vs cold phrase pool (Table 17 shape)", pools, "pool")
    seen = {label for label, _ in measured}
    timed = [label for label in seen if label.endswith(".json") or label.startswith(("ouroboros", "draft_model"))]
    if timed:
        lines.extend(["## Predicted vs measured (the bench run's own timings, same prompts)", ""])
        lines.append("| bench row | " + " | ".join(f"{s} measured" for s in sets) + " |")
        lines.append("|---|" + "---:|" * len(sets))
        for label in sorted(timed):
            lines.append(f"| `{label}` | " + " | ".join(f"{measured.get((label, s), 0):.2f}×" for s in sets) + " |")
        lines.append("")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
        width = 0.8 / len(table)
        for i, (label, cells) in enumerate(table.items()):
            xs = [j + i * width for j in range(len(sets))]
            ax1.bar(xs, [cells[s][0] for s in sets], width, label=label.replace("`", ""))
        ax1.axhline(1.0, color="black", linewidth=0.8)
        ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
        ax1.set_ylabel("predicted speedup over plain decoding")
        ax1.set_title("Ablation: components added one by one")
        ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
        for s in sets:
            ax2.plot(K_VALUES, [ksweep[k][s][0] for k in K_VALUES], marker="o", label=s)
        ax2.axhline(1.0, color="black", linewidth=0.8)
        ax2.set_ylim(bottom=0)
        ax2.set_xlabel("K (phrases lengthening each draft)")
        ax2.set_ylabel("predicted speedup")
        ax2.set_title("K sweep")
        ax2.legend(fontsize=8)
        fig.suptitle(f"Ouroboros, {args.model} / {args.draft}, {info['cpu']} ({now_iso()[:10]})", fontsize=9)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
