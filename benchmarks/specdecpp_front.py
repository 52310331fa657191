"""SpecDec++'s Figure 4: discard rate vs verification rate of every length policy, acceptance-only.

Each point is one policy setting over the same prompts: fixed K, transformers' heuristic, the
confidence stop, SpecDec++ over thresholds h (one curve per head given), and the oracle (stop
exactly before the first rejection). The draft's chain from every round start is computed once per
prompt in a few batched forwards (:mod:`speculum.bench.chains`); every policy is then played over
those chains in pure Python with the real policy objects, so many prompts and settings fit.

- Greedy (``--temperature 0``): acceptance is exact (candidates equal to the target's greedy output).
- ``--temperature T > 0``: chains are sampled, the target scores them in one forest forward and each
  candidate passes with probability min(1, p/q); ``--reps`` draws of the acceptance events per prompt.

Outputs come from ``speculum bench`` records (``--records DIR``, method autoregressive, matching
temperature) and/or are generated here for ``--datasets`` prompts ``--first``..``--first+--limit``
(losslessly, with draft_model; cached in ``--cache``). With ``--cost`` the target's t(K), a draft
forward and a head call are timed once and each point also gets a predicted speedup over plain
decoding (cost model, no end-to-end timing): that is how the timed runs' settings are chosen, on
prompts other than the ones they report on.

    python benchmarks/specdecpp_front.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --head paper=heads/paper --head early=heads/early --records bench-out/qwen-issue7-128 --cost \\
        --out benchmarks/results/specdecpp-front.md --plot benchmarks/plots/specdecpp_front.png

Discard rate = drafted tokens the target rejected, per generated token; verification rate = target
forwards per generated token (both lower is better; the paper's Figure 4 axes).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import speculum
from speculum.bench.chains import Totals, draft_chains, simulate
from speculum.bench.datasets import load_dataset, split_names
from speculum.bench.report import machine_info, now_iso
from speculum.costs import CostModel
from speculum.heads.acceptance import AcceptanceHead
from speculum.policies import make_policy
from speculum.runner import ModelRunner
from speculum.sampling import SamplingParams

FIXED = [2, 4, 6, 8, 10, 12, 14]
THRESHOLDS = [0.1, 0.3, 0.5, 0.7, 0.9]
CONFIDENCE = [0.2, 0.4, 0.6, 0.8]


def points(heads: dict[str, AcceptanceHead], max_draft: int) -> list[tuple[str, str, callable]]:
    """(family, label, policy factory) for every point of the figure."""
    out = [("fixed K", f"K={k}", lambda k=k: make_policy("fixed", k)) for k in FIXED]
    out.append(("heuristic", "heuristic", lambda: make_policy("heuristic", 5)))
    out += [
        ("confidence", f"conf {c}", lambda c=c: make_policy("confidence", max_draft, confidence_threshold=c))
        for c in CONFIDENCE
    ]
    for name, head in heads.items():
        family = "SpecDec++" if len(heads) == 1 else f"SpecDec++ {name}"
        out += [
            (
                family,
                f"{name} h={h}",
                lambda h=h, head=head: make_policy("specdecpp", max_draft, head=head, stop_threshold=h),
            )
            for h in THRESHOLDS
        ]
    out.append(("oracle", "oracle", lambda: make_policy("oracle", max_draft)))
    return out


def outputs_from_records(runs: list[Path], temperature: float) -> list[dict]:
    found = []
    for run in runs:
        summary = run / "summary.json"  # the run's temperature (records do not repeat it)
        meta = json.loads(summary.read_text()).get("meta", {}) if summary.exists() else {}
        run_temperature = float(meta.get("temperature") or 0.0)
        for line in (run / "records.jsonl").open():
            r = json.loads(line)
            if r["method"] == "autoregressive" and float(r.get("temperature", run_temperature)) == temperature:
                found.append(
                    {
                        "dataset": r["dataset"],
                        "id": r["question_id"],
                        "prompt_ids": r["prompt_ids"],
                        "output_ids": r["token_ids"],
                    }
                )
    return found


def generated_outputs(spec, args) -> list[dict]:
    """The target's outputs for --datasets prompts, made losslessly with draft_model and cached."""
    cache = args.cache / f"outputs-T{args.temperature:g}-{args.max_new_tokens}.jsonl"
    known = {}
    if cache.exists():
        for line in cache.open():
            r = json.loads(line)
            known[(r["dataset"], str(r["id"]))] = r
    found = []
    for dataset in split_names(args.datasets):
        for i, prompt in enumerate(load_dataset(dataset, args.first + args.limit)[args.first :]):
            key = (dataset, str(prompt.question_id))
            if key not in known:
                t0 = time.perf_counter()
                result = spec.generate(
                    prompt.render(prompt.chat_default),
                    "draft_model",
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    seed=args.seed + i,
                )
                known[key] = {
                    "dataset": dataset,
                    "id": str(prompt.question_id),
                    "prompt_ids": spec.encode_prompt(prompt.render(prompt.chat_default)),
                    "output_ids": result.token_ids,
                }
                with cache.open("a") as f:
                    f.write(json.dumps(known[key]) + "\n")
                print(f"output {dataset} {prompt.question_id}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            found.append(known[key])
    return found


def measure_costs(spec, heads, prefix: list[int]) -> dict:
    """t(K) of the target, one draft forward and one head call, on this machine."""
    curve = CostModel.measure(spec.runner, prefix, sizes=(1, 2, 4, 8, 12, 16, 21), reps=5)
    # t(1) from plain decoding itself (a lone K=1 probe after a prefill reads high on some CPUs)
    plain = spec.generate(prefix, "autoregressive", max_new_tokens=24)
    per_token = (plain.stats.wall_time - plain.stats.time_prefill) / plain.stats.new_tokens
    target = curve.with_plain_step(per_token)
    draft = ModelRunner(spec.draft_model)
    cache = draft.new_cache()
    draft.prefill(cache, prefix[:-1])
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        out = draft.forward(cache, [prefix[-1]], last_only=True)
        out.logits[-1].argmax()
        times.append(time.perf_counter() - t0)
        draft.crop(cache, len(prefix) - 1)
    head_time = 0.0
    if heads:  # one head call per draft token, plus the softmax that gives its confidence input
        head = max(heads.values(), key=lambda h: h.confidence_input)
        x = torch.randn(head.hidden_size)
        logits = torch.randn(spec.vocab_size, dtype=spec.draft_model.dtype)

        def call():
            q = float(torch.softmax(logits.float(), dim=-1)[7]) if head.confidence_input else None
            head.accept_probability(x, q)

        for _ in range(20):
            call()
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        head_time = (time.perf_counter() - t0) / 200
    return {"target": target, "draft": statistics.median(times[2:]), "head": head_time}


def predicted_speedup(t: Totals, costs: dict) -> float:
    spec_time = sum(costs["target"](k + 1) for k in t.draft_sizes)
    spec_time += t.draft_forwards * costs["draft"] + t.head_calls * costs["head"]
    return t.new_tokens * costs["target"](1) / spec_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--head", action="append", default=[], help="NAME=DIR or DIR of an acceptance head (repeatable)")
    ap.add_argument("--records", type=Path, nargs="*", default=[], help="speculum bench --out directories")
    ap.add_argument("--datasets", help="prompt sets whose outputs are generated here")
    ap.add_argument("--first", type=int, default=0, help="first prompt index of each set")
    ap.add_argument("--limit", type=int, default=5, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", type=Path, default=Path("bench-out/front"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=10, help="acceptance draws per prompt when sampling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=20, help="the bound for adaptive policies (paper: 20)")
    ap.add_argument("--cost", action="store_true", help="also predict each point's speedup from measured costs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.cache.mkdir(parents=True, exist_ok=True)

    spec = speculum.load(args.model, args.draft, dtype=args.dtype)
    heads = {}
    for item in args.head:
        name, _, path = item.rpartition("=")
        heads[name or Path(path).name] = AcceptanceHead.load(path, draft_model=spec.draft_model)
    outputs = outputs_from_records(args.records, args.temperature)
    if args.datasets:
        outputs += generated_outputs(spec, args)
    if not outputs:
        sys.exit("no outputs: give --records with autoregressive runs at this temperature, or --datasets")
    sampling = None if args.temperature == 0 else SamplingParams(temperature=args.temperature)
    costs = measure_costs(spec, heads, outputs[0]["prompt_ids"]) if args.cost else None
    settings = points(heads, args.max_draft)
    per_set: dict[str, dict[str, Totals]] = defaultdict(lambda: defaultdict(Totals))
    generator = torch.Generator(device=spec.draft_model.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    for n, item in enumerate(outputs):
        chains = draft_chains(
            spec.draft_model,
            item["prompt_ids"],
            item["output_ids"],
            args.max_draft,
            target_model=spec.model if sampling else None,
            sampling=sampling,
            generator=generator,
        )
        for _family, label, make in settings:
            for rep in range(args.reps if sampling else 1):
                t = simulate(chains, make(), eos_token_ids=spec.eos_token_ids, rng=random.Random(rep))
                per_set[item["dataset"]][label].add(t)
                per_set["all"][label].add(t)
        print(
            f"[{n + 1}/{len(outputs)}] {item['dataset']} {item['id']} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    families = {label: family for family, label, _ in settings}
    info = machine_info()
    counts = defaultdict(int)
    for item in outputs:
        counts[item["dataset"]] += 1
    mode = "greedy" if not sampling else f"T={args.temperature:g}"
    lines = [
        f"# Discard rate vs verification rate (SpecDec++ Figure 4), {mode}",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {now_iso()}; machine: {info['cpu']}; torch {torch.__version__}",
        f"- target `{args.model}`, draft `{args.draft}`; prompts: "
        + ", ".join(f"{d} {c}" for d, c in counts.items())
        + f"; up to {args.max_draft} draft tokens for adaptive policies",
    ]
    if costs:
        pts = ", ".join(f"t({k})={v * 1e3:.0f} ms" for k, v in costs["target"].points)
        lines.append(
            f"- measured costs: target {pts}; draft forward {costs['draft'] * 1e3:.1f} ms; "
            f"head call {costs['head'] * 1e3:.2f} ms ({costs['head'] / costs['draft']:.1%} of a draft forward)"
        )
    for dataset, rows in per_set.items():
        lines += [
            "",
            f"## {dataset}",
            "",
            "| policy | setting | discard rate | verification rate | draft forwards / token | tokens / forward |"
            + (" predicted speedup |" if costs else ""),
            "|---|---|---:|---:|---:|---:|" + ("---:|" if costs else ""),
        ]
        for label, t in rows.items():
            n = t.new_tokens
            row = (
                f"| {families[label]} | {label} | {(t.drafted_tokens - t.accepted_tokens) / n:.3f} | "
                f"{t.target_forwards / n:.3f} | {t.draft_forwards / n:.3f} | {n / t.target_forwards:.2f} |"
            )
            if costs:
                row += f" {predicted_speedup(t, costs):.2f}× |"
            lines.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.plot:
        plot(per_set["all"], families, args, len(outputs))


def plot(rows: dict[str, Totals], families: dict[str, str], args, n_prompts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for family in dict.fromkeys(families.values()):
        pts = [
            ((t.drafted_tokens - t.accepted_tokens) / t.new_tokens, t.target_forwards / t.new_tokens, label)
            for label, t in rows.items()
            if families[label] == family
        ]
        style = "*" if family == "oracle" else "s" if family == "heuristic" else "o-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=family, markersize=10 if style == "*" else 5)
        for x, y, label in pts:
            ax.annotate(label.split(" ")[-1], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("discard rate (rejected draft tokens per generated token)")
    ax.set_ylabel("verification rate (target forwards per generated token)")
    mode = "greedy" if args.temperature == 0 else f"T={args.temperature:g}"
    ax.set_title(f"{args.model} / {args.draft}, {mode}, {n_prompts} prompts", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
