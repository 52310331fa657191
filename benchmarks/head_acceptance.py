"""Mean acceptance length β of drafter configurations by exact replay (no timing noise), per
prompt set: each prompt's greedy reference is decoded once (``--batch``: with the batched engine),
then every configuration replays it step by step and gets exactly the acceptances a real greedy
run would (head drafters read the target's hidden states from one recorded forward; lookahead
and Ouroboros, which read its predictions off the accepted path, get those from the target). For
choosing heads and training recipes on held-out prompts before a timed run.

    python benchmarks/head_acceptance.py --model gemma-3-270m --dataset humaneval,gsm8k,mt_bench \
        --skip 5 --limit 5 --max-new-tokens 64 --methods "anpd;medusa:heads=DIR;ctc:heads=DIR,top_k=4"
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import speculum
from speculum.bench.datasets import load_dataset
from speculum.bench.method_specs import parse_method_spec
from speculum.tune import prepare_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--dataset", default="humaneval,gsm8k,mt_bench", help="comma-separated sets or files")
    parser.add_argument("--skip", type=int, default=5, help="prompts skipped per set (the report's first ones)")
    parser.add_argument("--limit", type=int, default=5, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", required=True, help="';'-separated method specs (name:key=value,...)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="the target's dtype (auto: the faster one, measured)")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="make the greedy references this many prompts at a time (batched engine; faster)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = speculum.load(args.model, dtype=args.dtype)
    has_template = bool(getattr(spec.tokenizer, "chat_template", None))
    sets = args.dataset.split(",")
    chosen = {name: load_dataset(name, args.skip + args.limit)[args.skip :] for name in sets}
    prompts = [spec.encode_prompt(p.render(p.chat_default and has_template)) for name in sets for p in chosen[name]]
    recorded = prepare_prompts(spec, prompts, args.max_new_tokens, hidden=True, batch=args.batch)
    by_set, first = {}, 0
    for name in sets:
        by_set[name] = recorded[first : first + len(chosen[name])]
        first += len(chosen[name])
    where = f"{args.dataset}, from prompt {args.skip + 1} of each"
    print(f"{len(recorded)} prompts ({where}), {args.max_new_tokens} new tokens")
    print("| method | " + " | ".join(f"β {name}" for name in sets) + " | β mean over sets | mean draft tree size |")
    print("|---|" + "---|" * (len(sets) + 2))
    for text in args.methods.split(";"):
        config = parse_method_spec(text).to_config()
        resources = dataclasses.replace(spec.resources(), shared={})
        drafter = config.drafter_class()(config.options(), resources)
        betas, nodes, steps_all = [], 0, 0
        for name in sets:
            tokens = steps = 0
            for p in by_set[name]:
                stats = p.replay(drafter, spec)
                tokens += stats.new_tokens
                steps += len(stats.accept_lengths)
                nodes += sum(stats.draft_sizes)
            betas.append(tokens / max(steps, 1))
            steps_all += steps
        cells = " | ".join(f"{b:.3f}" for b in betas)
        print(f"| {text} | {cells} | {sum(betas) / len(betas):.3f} | {nodes / max(steps_all, 1):.1f} |", flush=True)


if __name__ == "__main__":
    main()
