"""Where a draft model's chain should stop: the confidence stop and the controller's chain stop,
acceptance-only, with a predicted speedup from this machine's costs (issue #18).

``auto`` stops the draft model's chain on its confidence (0.8); Ouroboros and ``draft_model`` alone
stop at a low confidence floor and let the controller's chain stop (:class:`speculum.controller.
ChainStop`) end the chain where one more draft forward stops paying. On the Qwen pair neither wins
on both kinds of text (thirty-fourth pass: 0.8 on code, the chain stop on writing). This plays every
stop rule over the same greedy chains (:mod:`speculum.bench.chains`: the draft's chain from every
round start of a recorded output, and how far the target accepts it), keeping one calibration per
prompt set across its prompts as the engine keeps it across requests, and predicts each rule's
speedup over plain decoding from t(n) and a draft forward's seconds.

Rules: ``conf θ`` (the confidence stop alone); ``chain θ last`` (the chain stop over a confidence
floor θ, the next node's chance estimated as a node scored like the last one: the controller's
rule); ``chain θ typical`` (the next node's chance estimated over the scores the chain's recent
nodes had: its next score is not known when the forward that makes it is decided); ``oracle``
(stops exactly before the first rejection: the bound).

    python benchmarks/chain_stop_study.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --records bench-out/i18/qwen-bf16-chain-tuning-p34 bench-out/i18/qwen-bf16-chat-tuning-p34 \\
        --out benchmarks/results/issue18-chain-stop-study.md

Outputs come from ``speculum bench`` records (method ``autoregressive``, greedy). The predicted
speedup is Σ plain seconds / Σ (t(drafted + 1) + draft forwards × draft seconds + overhead) per round:
no end-to-end timing, and no other drafter's nodes beside the chain (``auto``'s trees carry some),
nor Ouroboros' phrases (a draft forward that takes a pool phrase yields several tokens, and its
phrases lengthen the chain): the chain alone. Issue #18's thirty-fifth pass found every sensible
stop within 2% of the others on the Qwen pair (1.36-1.38x predicted), the oracle at 1.72x.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections import deque
from pathlib import Path

import torch

import speculum
from speculum.bench.chains import draft_chains
from speculum.bench.report import machine_info, now_iso
from speculum.controller import Calibration, ChainStop

sys.path.insert(0, str(Path(__file__).parent))
from specdecpp_front import measure_costs, outputs_from_records  # noqa: E402

SOURCE = "draft_model"
FLOORS = (0.2, 0.5)
CONFIDENCE = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9)
CAPS = (4, 8)  # most draft tokens a round (Ouroboros' CPU setting drafts at most 4)
RECENT = 64  # chain nodes whose scores stand for the next node's (rule "typical")


class _Controller:
    """What ChainStop reads of a controller."""

    def __init__(self, cost, overhead: float):
        self.calibration, self.cost, self.probing, self.overhead = Calibration(), cost, False, overhead


class TypicalChainStop(ChainStop):
    """ChainStop with the next node's chance taken over the recent nodes' scores, not the last one's."""

    def __init__(self, controller, source: str, recent: deque):
        super().__init__(controller, source)
        self.recent = recent

    def next_chance(self, depth: int) -> float:
        scores = list(self.recent) or [self.last_score]
        return statistics.fmean(
            self.calibration.estimate(score, depth, self.source, optimistic=self.optimistic) for score in scores
        )


def play(
    chains, rule: str, floor: float, controller, costs: dict, recent: deque, cap: int
) -> tuple[int, float, int, int]:
    """One rule over one prompt's chains: (new tokens, predicted seconds, target forwards, draft forwards)."""
    t, step, overhead = costs["target"], costs["draft"], costs["overhead"]
    new = seconds = forwards = draft_forwards = 0
    row, rows = 0, chains.rows
    while new < rows:
        accept = chains.accept[row].tolist()
        first_reject = next((i for i, ok in enumerate(accept) if ok < 1.0), len(accept))
        budget = min(chains.max_draft, cap, rows - new - 1)
        drafted = 0
        stop = None
        if rule in ("last", "typical"):
            stop = ChainStop(controller, SOURCE) if rule == "last" else TypicalChainStop(controller, SOURCE, recent)
        for s in range(budget):
            conf = float(chains.confidence[row, s])
            if rule == "oracle" and s >= first_reject:
                break
            drafted += 1
            recent.append(conf)
            if drafted >= budget or (rule != "oracle" and conf < floor):
                break
            if stop is not None:
                stop.add(conf)
                if not stop.worth_another(step):
                    break
        for s in range(min(drafted, first_reject + 1)):  # nodes whose parent was accepted
            controller.calibration.update(float(chains.confidence[row, s]), s + 1, s < first_reject, SOURCE)
        accepted = min(drafted, first_reject)
        seconds += t(drafted + 1) + drafted * step + overhead
        forwards += 1
        draft_forwards += drafted
        produced = min(accepted + 1, rows - new)
        new += produced
        row += produced
    return new, seconds, forwards, draft_forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--records", type=Path, nargs="+", help="speculum bench --out directories")
    ap.add_argument("--max-draft", type=int, default=20)
    ap.add_argument("--draft-seconds", type=float, help="a draft forward's seconds (default: timed here)")
    ap.add_argument("--plain-seconds", type=float, help="a plain step's seconds (default: timed here)")
    ap.add_argument("--overhead", type=float, default=0.003, help="seconds per round beyond forwards")
    ap.add_argument("--cache", type=Path, help="a file keeping the chains computed, for reruns")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    spec = speculum.load(args.model, draft=args.draft)
    outputs = outputs_from_records(args.records, 0.0)
    if not outputs:
        sys.exit("no greedy autoregressive records found")
    costs = measure_costs(spec, {}, outputs[0]["prompt_ids"])
    if args.plain_seconds:  # the curve's shape as timed, scaled to the plain step given
        costs["target"] = costs["target"].with_plain_step(args.plain_seconds)
    if args.draft_seconds:
        costs["draft"] = args.draft_seconds
    costs["overhead"] = args.overhead
    print(f"t(1) {costs['target'](1):.4f} s, t(8) {costs['target'](8):.4f} s, t(16) {costs['target'](16):.4f} s,"
          f" draft forward {costs['draft']:.4f} s", file=sys.stderr)  # fmt: skip

    top = args.max_draft
    rules = [(f"conf {c}", "conf", c, top) for c in CONFIDENCE]
    rules += [(f"conf 0.8, at most {k}", "conf", 0.8, k) for k in CAPS]
    rules += [(f"chain {f} {mode}", mode, f, top) for f in FLOORS for mode in ("last", "typical")]
    rules += [(f"chain 0.2 last, at most {k}", "last", 0.2, k) for k in CAPS]
    rules.append(("oracle", "oracle", 0.0, top))
    sets = sorted({o["dataset"] for o in outputs}, key=[o["dataset"] for o in outputs].index)
    cached = torch.load(args.cache, weights_only=False) if args.cache and args.cache.exists() else {}
    results = {}  # (set, rule) -> [new, seconds, forwards, draft forwards, plain seconds]
    for name in sets:
        state = {label: (_Controller(costs["target"], args.overhead), deque(maxlen=RECENT)) for label, *_ in rules}
        for o in (o for o in outputs if o["dataset"] == name):
            key = (name, str(o["id"]), len(o["output_ids"]), args.max_draft)
            if key not in cached:
                cached[key] = draft_chains(
                    spec.draft_model, o["prompt_ids"], o["output_ids"], args.max_draft, hidden=False
                )
            chains = cached[key]
            for label, mode, floor, cap in rules:
                controller, recent = state[label]
                new, seconds, fw, dfw = play(chains, mode, floor, controller, costs, recent, cap)
                total = results.setdefault((name, label), [0, 0.0, 0, 0, 0.0])
                for i, v in enumerate((new, seconds, fw, dfw, new * (costs["target"](1) + args.overhead))):
                    total[i] += v
            print(f"{name} {o['id']}", file=sys.stderr)
    if args.cache:
        torch.save(cached, args.cache)

    lines = [
        "# Where the draft model's chain stops: predicted speedups (acceptance-only)",
        "",
        f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- date: {now_iso()}; machine: {machine_info()}",
        f"- costs: t(1) {costs['target'](1) * 1000:.1f} ms, t(8) {costs['target'](8) * 1000:.1f} ms,"
        f" t(16) {costs['target'](16) * 1000:.1f} ms, draft forward {costs['draft'] * 1000:.1f} ms,"
        f" {args.overhead * 1000:.1f} ms a round beyond; chains up to {args.max_draft} tokens",
        "",
        "| rule | " + " | ".join(sets) + " | all |",
        "|---|" + "---:|" * (len(sets) + 1),
    ]
    for label, *_ in rules:
        cells, tot = [], [0, 0.0, 0, 0, 0.0]
        for name in sets:
            r = results[(name, label)]
            tot = [a + b for a, b in zip(tot, r, strict=True)]
            cells.append(f"{r[4] / r[1]:.2f}× ({r[0] / r[2]:.2f} tok/fw, {r[3] / r[2]:.1f} dfw)")
        cells.append(f"{tot[4] / tot[1]:.2f}× ({tot[0] / tot[2]:.2f}, {tot[3] / tot[2]:.1f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Predicted speedup over plain decoding (tokens a target forward, draft forwards a round).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
