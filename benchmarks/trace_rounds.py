"""Round-by-round trace of methods under the controller: what each round verified, committed and cost.

    python benchmarks/trace_rounds.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --methods "autoregressive;auto;draft_model" --dataset mt_bench --limit 5 --out trace.jsonl
    (add --temperature 1 --seed 0 for sampled requests)

One JSON line per generation: the method, the prompt, tokens/s, and per round whether the drafter was
asked, the tree verified (nodes, root included), the tokens committed, the forward's, the drafting's
and the round's seconds, the controller's plan (nodes proposed and kept per source, expected
tokens, whether the round explored), and for ``auto`` its model gates (which groups ran; with / without
goodput, rounds still skipped) and their paired "without" estimates. It hooks the controller and
``auto`` from outside (nothing in the engine changes), so it times what the engine times. Issue #18's
twenty-third pass found with it that ``auto``'s plans expected more than the target accepted.
Methods run one after another per prompt, in a fresh process as ``speculum bench`` would share them.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import speculum
from speculum import controller as controller_module
from speculum.bench.datasets import load_datasets
from speculum.bench.runner import _tokenizer_has_chat_template
from speculum.drafters import auto as auto_module

_round: dict = {}  # what the hooks learnt of the round in progress
_rounds: list[dict] = []  # the generation's rounds so far


def _hook() -> None:
    plan, observe = controller_module.Controller.plan, controller_module.Controller.observe_round
    propose, without = auto_module.AutoDrafter.propose, auto_module.AutoDrafter._without

    def traced_plan(self, draft, max_depth, *args, **kwargs):
        result = plan(self, draft, max_depth, *args, **kwargs)
        sources = draft.sources or [""] * len(draft)
        keep = result.keep if result.keep is not None else [True] * len(draft)
        _round["plan"] = {
            "proposed": collections.Counter(sources),
            "kept": collections.Counter(s for s, k in zip(sources, keep, strict=True) if k),
            "expected": round(result.expected_tokens, 3),
            "explored": bool(getattr(result, "explored", False)),
        }
        return result

    def traced_observe(self, tree, path, draft, *, asked, committed, forward_seconds, round_seconds, **kwargs):
        _rounds.append({
            "asked": asked, "tree": len(tree), "committed": committed, "forward_s": round(forward_seconds, 4),
            "drafting_s": round(kwargs.get("draft_seconds", 0.0), 4), "round_s": round(round_seconds, 4),
            "plain_left": self._plain_left, "lean": kwargs.get("lean"),
            "asked_rate": self.asked.rate, "lean_rate": self.asked_lean.rate, "plain_rate": self.plain_rate(), **_round,
        })  # fmt: skip
        _round.clear()
        return observe(self, tree, path, draft, asked=asked, committed=committed, forward_seconds=forward_seconds,
                       round_seconds=round_seconds, **kwargs)  # fmt: skip

    def traced_propose(self, ctx):
        draft = propose(self, ctx)
        _round["used"] = dict(self._used)
        _round["gates"] = {
            group: {"with": self.gate(1, group).with_model.rate, "without": self.gate(1, group).without_model.rate,
                    "skip": self.gate(1, group)._skip}
            for group in self.groups
        }  # fmt: skip
        return draft

    def traced_without(self, groups, outcome, seconds):
        estimate = without(self, groups, outcome, seconds)
        _round.setdefault("without", {})["+".join(sorted(groups))] = estimate
        return estimate

    controller_module.Controller.plan = traced_plan
    controller_module.Controller.observe_round = traced_observe
    auto_module.AutoDrafter.propose = traced_propose
    auto_module.AutoDrafter._without = traced_without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--methods", default="autoregressive;auto", help="method specs separated by ';'")
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="a .jsonl file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _hook()
    spec = speculum.load(args.model, draft=args.draft)
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    chat = _tokenizer_has_chat_template(spec)  # as speculum bench renders prompts
    with open(args.out, "w", encoding="utf-8") as out:
        for prompts in load_datasets(args.dataset, args.limit).values():
            for prompt in prompts:
                ids = spec.encode_prompt(prompt.render(prompt.chat_default and chat))
                for method in methods:
                    _rounds.clear()
                    began = time.perf_counter()
                    sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature > 0 else {}
                    result = spec.generate(ids, method=method, max_new_tokens=args.max_new_tokens, **sampling)
                    wall = time.perf_counter() - began
                    line = {"dataset": prompt.dataset, "question_id": prompt.question_id, "method": method,
                            "new_tokens": len(result.token_ids), "tokens_per_second": len(result.token_ids) / wall,
                            "rounds": list(_rounds)}  # fmt: skip
                    out.write(json.dumps(line, default=str) + "\n")
                    out.flush()
                    print(f"{prompt.dataset} {prompt.question_id} {method}: {line['tokens_per_second']:.2f} tokens/s")


if __name__ == "__main__":
    main()
