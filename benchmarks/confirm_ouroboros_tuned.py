"""Time the tuned Ouroboros setting (benchmarks/results/ouroboros-qwen-tuned.json) against the published
defaults and plain decoding on the tuning prompts (MBPP x 5, 64 tokens), interleaved per prompt, each
setting on its own phrase pool (``tune.confirm_timing``). Two passes: the second shows what a pool that
already holds these answers' phrases adds.

    python benchmarks/confirm_ouroboros_tuned.py
"""

import json

import torch

import speculum
from speculum.bench.datasets import load_dataset
from speculum.tune import confirm_timing, prepare_prompts

torch.set_num_threads(2)
spec = speculum.load("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
has_template = bool(getattr(spec.tokenizer, "chat_template", None))
ids = [spec.encode_prompt(p.render(p.chat_default and has_template)) for p in load_dataset("mbpp", 5)]
prompts = prepare_prompts(spec, ids, 64)
with open("benchmarks/results/ouroboros-qwen-tuned.json", encoding="utf-8") as f:
    chosen = json.load(f)["params"]
for rep in range(2):
    measured = confirm_timing(spec, "ouroboros", chosen, {}, prompts, 64)
    plain = measured["autoregressive"]
    ratios = f"tuned x{measured['tuned'] / plain:.2f}, published defaults x{measured['defaults'] / plain:.2f}"
    print(f"pass {rep + 1}: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in measured.items()) + f"; {ratios}")
