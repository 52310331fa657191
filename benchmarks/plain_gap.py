"""speculum's plain decoding against transformers' own, on the same loaded weights, alternated.

Where does a plain step's time go? Four ways of greedy decoding the same prompt, in rounds:
speculum's ``autoregressive`` method (the whole engine), transformers' ``generate`` on the same
weights (``accel.unpacked``), the engine's ``ModelRunner`` called in a bare loop, and the model
called in a bare loop with a ``DynamicCache``:

    python benchmarks/plain_gap.py qwen2.5-coder-1.5b --tokens 48 --rounds 2

Prints tokens per second per way and round (the first round includes cold starts).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import speculum
from speculum import accel


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="gemma-3-270m")
    ap.add_argument("--prompt", default="def quicksort(arr):\n    ")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = speculum.load(args.model)
    print(f"linear layers: {spec.row_padding.describe() if spec.row_padding else 'not prepacked'}")
    ids = spec.tokenizer(args.prompt, return_tensors="pt").input_ids
    n = args.tokens

    def engine() -> float:
        start = time.perf_counter()
        result = spec.generate(args.prompt, "autoregressive", max_new_tokens=n)  # may stop early at an EOS
        return len(result.token_ids) / (time.perf_counter() - start)

    def transformers_generate() -> float:
        with accel.unpacked(spec.model):
            start = time.perf_counter()
            spec.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return n / (time.perf_counter() - start)

    def runner_loop() -> float:
        cache = spec.runner.new_cache()
        spec.runner.prefill(cache, ids[0].tolist())
        token, start = int(ids[0, -1]), time.perf_counter()
        for _ in range(n):
            token = int(spec.runner.forward(cache, [token]).logits[-1].argmax())
        return n / (time.perf_counter() - start)

    @torch.inference_mode()
    def model_loop() -> float:
        cache = DynamicCache()
        spec.model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token, start = ids[:, -1:], time.perf_counter()
        for _ in range(n):
            out = spec.model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return n / (time.perf_counter() - start)

    ways = {"speculum autoregressive": engine, "transformers generate": transformers_generate,
            "runner loop": runner_loop, "model loop": model_loop}  # fmt: skip
    for round_ in range(args.rounds):
        for name, way in ways.items():
            print(f"round {round_}: {name}: {way():.3f} tok/s", flush=True)


if __name__ == "__main__":
    main()
