"""The verification cost curve t(K): one target forward over K new tokens after a cache of P tokens.

Speculative decoding pays off only when verifying K drafted tokens costs about as much as decoding
one. This measures that directly, for each dtype, with the LM head over all K positions (what a
verifier needs) and over the last position only (``logits_to_keep=1``, what plain decoding needs):

    python benchmarks/verify_cost.py gemma-3-270m
    python benchmarks/verify_cost.py qwen2.5-coder-1.5b --dtypes float32,bfloat16 --prefix 300 --reps 5
    python benchmarks/verify_cost.py shape:qwen2.5-7b --device cuda --dtypes bfloat16 --prepack off
    python benchmarks/verify_cost.py qwen2.5-coder-1.5b --dtypes bfloat16,gguf --prepack on

``gguf`` in ``--dtypes``: the GGUF model's linear layers on the file's own blocks (``quantization="gguf"``,
the rest in float32), as speculum runs a GGUF by default where that is faster.

``shape:NAME`` builds a published model's shape with random weights (what a forward costs does not
depend on the weights): a GPU that cannot download a 7B or 70B model still gives its t(K);
``--layers N`` keeps the first N layers of a shape too big for the device (cost grows linearly in N).

Prints a markdown table (median ms and ratio to K=1) with a machine/date/command header.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from speculum.bench.report import machine_info, now_iso


def prompt_ids(tokenizer, vocab_size: int, length: int) -> list[int]:
    """``length`` token ids of real text (HumanEval prompts), or seeded random ids without a tokenizer."""
    if tokenizer is not None:
        from speculum.bench.datasets import load_humaneval

        ids: list[int] = []
        for p in load_humaneval(None):
            ids.extend(tokenizer(p.raw, add_special_tokens=False)["input_ids"])
            if len(ids) >= length + 64:
                break
        if len(ids) >= length + 64:
            return ids[: length + 64]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab_size, (length + 64,), generator=gen).tolist()


# published configurations (the models' config.json), as the fields that set a forward's cost
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}  # fmt: skip


def load_model(name: str, dtype: str, device: str, layers: int | None = None):
    """(model, tokenizer): a packaged/hub/local model, or ``shape:NAME`` with random weights (no tokenizer)."""
    if not name.startswith("shape:"):
        from speculum import models

        if dtype == "gguf":
            return models.load_with_dtype_choice(name, dtype="float32", device=device, quantization="gguf")[:2]
        return models.load_model(name, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    if name[6:] not in SHAPES:
        raise SystemExit(f"unknown shape {name[6:]!r}: one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name[6:]])
    if layers:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**fields)
    with torch.device(device):  # initialised where it runs: a 70B-shaped slice never touches host memory
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval(), None


@torch.inference_mode()
def measure(model, ids: list[int], prefix: int, ks: list[int], reps: int, last_only: bool) -> dict[int, float]:
    """Median seconds of one forward over K tokens after a ``prefix``-token cache, per K."""
    device = model.device
    cache = DynamicCache()
    model(input_ids=torch.tensor([ids[:prefix]], device=device), past_key_values=cache, use_cache=True)
    extra = {"logits_to_keep": 1} if last_only else {}
    out: dict[int, float] = {}
    for k in ks:
        x = torch.tensor([ids[prefix : prefix + k]], device=device)
        out[k] = median_forward_seconds(model, cache, x, reps, extra)
        assert cache.get_seq_length() == prefix
    return out


@torch.inference_mode()
def median_forward_seconds(model, cache, input_ids: torch.Tensor, reps: int, extra: dict) -> float:
    """Median seconds of ``reps`` forwards of ``input_ids`` after ``cache`` (after one warm-up), the
    cache cropped back after each."""
    device = input_ids.device
    times = []
    for rep in range(reps + 1):  # the first run is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=input_ids, past_key_values=cache, use_cache=True, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
        cache.crop(-input_ids.shape[1])
    return statistics.median(times)


def table(rows: list[tuple[str, str, dict[int, float]]], ks: list[int]) -> str:
    lines = [
        "| dtype | LM head | " + " | ".join(f"K={k}" for k in ks) + " |",
        "|---|---|" + "---:|" * len(ks),
    ]
    for dtype, head, t in rows:
        base = t[ks[0]]
        cells = [f"{1000 * t[k]:.1f} ms (×{t[k] / base:.2f})" for k in ks]
        lines.append(f"| {dtype} | {head} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma-3-270m", help="alias, hub id or local path")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--prefix", type=int, default=300, help="tokens already in the cache (P)")
    ap.add_argument("--ks", default="1,2,4,8,16,32", help="comma-separated K values")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per K (median reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--layers", type=int, default=None, help="with shape:NAME, keep only the first N layers")
    ap.add_argument("--heads", default="all,last", help="all (LM head on all K positions), last (logits_to_keep=1)")
    ap.add_argument(
        "--prepack", default="off,on", help="off (stock linear layers) and/or on (speculum.accel oneDNN prepacking)"
    )
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    heads = [h.strip() for h in args.heads.split(",")]
    if any(h not in ("all", "last") for h in heads):
        ap.error("--heads takes all and/or last")

    from speculum import accel

    mach = machine_info()
    layers = f" ({args.layers} layers)" if args.layers else ""
    gpu = f", GPU {mach['gpu']}" if "gpu" in mach else ""
    given = argv if argv is not None else sys.argv[1:]
    header = [
        "# verification cost t(K)",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/verify_cost.py', *given])}`",
        f"- date: {now_iso()}",
        f"- machine: {mach.get('cpu')}, {torch.get_num_threads()} threads{gpu}; torch {mach.get('torch')}, "
        f"transformers {mach.get('transformers')}",
        f"- model: `{args.model}`{layers}; device {args.device}; cache of P = {args.prefix} tokens; "
        f"median of {args.reps} runs (after 1 warm-up); ratios are to K = {ks[0]}",
        "",
    ]
    rows = []
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        model, tokenizer = load_model(args.model, dtype, args.device, args.layers)
        model.eval()
        vocab = accel.output_size(model)
        ids = prompt_ids(tokenizer, vocab, args.prefix + max(ks))
        for pack in [p.strip() for p in args.prepack.split(",")]:
            if pack == "on" and dtype != "gguf" and not accel.prepack(model):
                continue  # not applicable (e.g. bfloat16)
            if pack == "off" and dtype == "gguf" and "on" in args.prepack:
                continue  # one row for the quantized model
            label = "gguf blocks, float32 rest" if dtype == "gguf" else str(model.dtype).replace("torch.", "")
            if pack == "on" and dtype == "gguf":
                pass  # nothing left to prepack: the quantized layers are packed for their own kernel
            elif pack == "on":
                label += " prepacked"
            for head in heads:
                t = measure(model, ids, args.prefix, ks, args.reps, last_only=head == "last")
                rows.append((label, "all K positions" if head == "all" else "last only", t))
            print(
                f"{rows[-1][0]} / {rows[-1][1]}: " + ", ".join(f"K={k} {1000 * v:.1f} ms" for k, v in t.items()),
                file=sys.stderr,
            )
        del model
    print("\n".join(header) + "\n" + table(rows, ks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
