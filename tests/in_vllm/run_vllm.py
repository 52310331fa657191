"""Run vLLM offline on a model and print its outputs as JSON (one process per engine: the tests
compare engines without one's state reaching another's).

    python tests/in_vllm/run_vllm.py MODEL_DIR PROMPTS_JSON [--spec CLASS] [--k 4] [--temperature 0]
        [--n 1] [--max-tokens 32] [--seed 0] [--options JSON] [--method NAME] [--metrics]
        [--loader-config JSON] [--lookup MIN,MAX]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawn needed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", help="JSON list of token-id lists")
    parser.add_argument("--spec", default=None, help="a custom_class proposer's dotted path, or 'ngram'")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", default=None, help="speculum's options (additional_config's 'speculum')")
    parser.add_argument("--method", default=None, help="speculative_config's method (e.g. medusa; --spec: its model)")
    parser.add_argument("--metrics", action="store_true", help="also print vLLM's spec-decode counters")
    parser.add_argument("--loader-config", default=None, help="vLLM's model_loader_extra_config (JSON)")
    parser.add_argument("--lookup", default="4,4", help="ngram: prompt_lookup_min,prompt_lookup_max")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.spec:
        spec = {"num_speculative_tokens": args.k}
        low, high = (int(n) for n in args.lookup.split(","))
        ngram = {"method": "ngram", "prompt_lookup_min": low, "prompt_lookup_max": high}
        spec.update(ngram if args.spec == "ngram" else {"model": args.spec})
        if args.method:
            spec["method"] = args.method
        kwargs["speculative_config"] = spec
    if args.loader_config:
        kwargs["model_loader_extra_config"] = json.loads(args.loader_config)
    if args.options:
        kwargs["additional_config"] = {"speculum": json.loads(args.options)}
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=args.seed,
        gpu_memory_utilization=0.15,  # on the CPU backend: the share of memory for the KV cache
        disable_log_stats=not args.metrics,
        **kwargs,
    )
    params = SamplingParams(temperature=args.temperature, n=args.n, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(args.prompts)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps([[list(c.token_ids) for c in o.outputs] for o in outputs]))
    if args.metrics:
        counters = {m.name: m.value if hasattr(m, "value") else getattr(m, "values", None) for m in llm.get_metrics()}
        print("METRICS " + json.dumps({k: v for k, v in counters.items() if k.startswith("vllm:spec_decode")}))


if __name__ == "__main__":
    main()
