"""What a request costs when the controller never drafts, against plain decoding (issue #18's bar:
within 1%).

    python benchmarks/controller_plain_rounds.py [--model gemma-3-270m] [--limit 5] [--max-new-tokens 128]

Every round of the controlled request is a plain round: the controller is asked (``wants_draft``),
says no, the drafter is not called but observes the step (an n-gram table keeps learning), and the
controller records the round. This is the path a request takes while the controller has backed off.
Rows are interleaved per prompt, over HumanEval, GSM8K, MT-bench and WMT16 (the report sets), each
prompt timed ``--repeats`` times per row; the ratio is of summed tokens/s.
"""

from __future__ import annotations

import argparse
import time

import speculum
from speculum.bench.datasets import load_gsm8k, load_humaneval, load_mt_bench, load_wmt16
from speculum.controller import Controller


class NeverDrafts(Controller):
    """A controller that has backed off for good: every round plain."""

    def wants_draft(self) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default="anpd", help="the drafter the controller never asks")
    parser.add_argument("--limit", type=int, default=5, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    spec = speculum.load(args.model, dtype=args.dtype)
    plain = speculum.SpeculativeConfig("autoregressive")
    controlled = speculum.SpeculativeConfig(args.method, controller=True)
    spec._controllers[(controlled.key(), False)] = NeverDrafts(spec.cost_model)  # greedy requests
    chat = bool(getattr(spec.tokenizer, "chat_template", None))
    prompts = [
        p.render(chat and name != "humaneval")
        for name, loader in (
            ("humaneval", load_humaneval),
            ("gsm8k", load_gsm8k),
            ("mt_bench", load_mt_bench),
            ("wmt16", load_wmt16),
        )
        for p in loader(args.limit)
    ]
    spec.generate(prompts[0], plain, max_new_tokens=8)  # warm-up
    spec.generate(prompts[0], controlled, max_new_tokens=8)
    totals = {"plain": [0, 0.0], "controlled": [0, 0.0]}
    control = 0.0
    for prompt in prompts:
        for _ in range(args.repeats):
            for name, config in (("plain", plain), ("controlled", controlled)):
                start = time.perf_counter()
                result = spec.generate(prompt, config, max_new_tokens=args.max_new_tokens)
                totals[name][0] += len(result.token_ids)
                totals[name][1] += time.perf_counter() - start
                if name == "controlled":
                    assert result.stats.rounds_drafted == 0
                    control += result.stats.time_control
    rate = {k: n / s for k, (n, s) in totals.items()}
    print(f"model {args.model}, dtype {spec.dtype_choice.dtype if spec.dtype_choice else args.dtype}, "
          f"{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} tokens")  # fmt: skip
    print(f"plain decoding:              {rate['plain']:.2f} tokens/s")
    print(f"controller, never drafting:  {rate['controlled']:.2f} tokens/s ({args.method} observing)")
    print(f"ratio: {rate['controlled'] / rate['plain']:.3f}; controller's own time "
          f"{100 * control / totals['controlled'][1]:.2f}% of wall")  # fmt: skip


if __name__ == "__main__":
    main()
