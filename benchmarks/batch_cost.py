"""What a target forward costs with B rows of K new tokens each: t(B, K), the cost model batching needs.

Two questions decide batched speculative decoding on a machine:

- **Batched plain decoding**: how much cheaper is one forward over B rows of one token than B
  forwards of one row? ``B * t(1, 1) / t(B, 1)`` is the most batching alone can give.
- **Where speculation thins out**: verifying K tokens per row costs ``t(B, K) / t(B, 1)`` of a plain
  batched step. Near 1 (memory-bound: the weights are read once for every token) drafts are nearly
  free; as B grows the forward turns compute-bound and that ratio climbs towards K, and speculation
  stops paying. The table shows at which B that happens on this CPU.

Each row attends to its own cache of P tokens (a different slice of real text per row); the LM head
runs on every new position (what a verifier needs) except for K = 1, where plain decoding needs the
last position only::

    python benchmarks/batch_cost.py gemma-3-270m --dtype float32
    python benchmarks/batch_cost.py qwen2.5-coder-1.5b --dtype bfloat16 --batches 1,2,4,8 --ks 1,2,4,8

Prints a markdown table with a machine/date/command header.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from transformers import DynamicCache

from speculum.bench.report import machine_info, now_iso

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from verify_cost import load_model, median_forward_seconds, prompt_ids  # noqa: E402 - the sibling script's helpers


@torch.inference_mode()
def measure(model, ids: list[int], prefix: int, batch: int, ks: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one forward over ``batch`` rows of K new tokens after ``prefix`` cached, per K."""
    device = model.device
    stride = max(1, (len(ids) - prefix - max(ks)) // max(batch, 1))
    rows = [ids[r * stride : r * stride + prefix + max(ks)] for r in range(batch)]
    cache = DynamicCache()
    model(input_ids=torch.tensor([r[:prefix] for r in rows], device=device), past_key_values=cache, use_cache=True)
    out: dict[int, float] = {}
    for k in ks:
        x = torch.tensor([r[prefix : prefix + k] for r in rows], device=device)
        out[k] = median_forward_seconds(model, cache, x, reps, {"logits_to_keep": 1} if k == 1 else {})
    return out


def table(results: dict[int, dict[int, float]], ks: list[int]) -> str:
    base = results[min(results)][1] if 1 in ks else None
    lines = [
        "| B | " + " | ".join(f"K={k}" for k in ks) + " | B·t(1,1) / t(B,1) |",
        "|---:|" + "---:|" * (len(ks) + 1),
    ]
    for batch, t in sorted(results.items()):
        cells = [f"{1000 * t[k]:.1f} ms (×{t[k] / t[ks[0]]:.2f})" for k in ks]
        gain = f"{batch * base / t[1]:.2f}×" if base and 1 in t else "–"
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma-3-270m", help="alias, hub id or local path")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--prepack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="oneDNN-prepacked linear layers where they apply (float32 on CPU), as speculum runs",
    )
    ap.add_argument("--prefix", type=int, default=300, help="tokens already in each row's cache (P)")
    ap.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes B")
    ap.add_argument("--ks", default="1,2,4,8,16", help="comma-separated tokens per row K (the first: ratios' base)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--layers", type=int, default=None, help="with shape:NAME (verify_cost.py), the first N layers")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]

    from speculum import accel

    model, tokenizer = load_model(args.model, args.dtype, args.device, args.layers)
    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]  # before prepacking replaces the layer
    packed = bool(args.prepack and accel.prepack(model))
    ids = prompt_ids(tokenizer, vocab, args.prefix + max(ks) + 64 * max(batches))
    results = {}
    for batch in batches:
        results[batch] = measure(model, ids, args.prefix, batch, ks, args.reps)
        times = ", ".join(f"K={k} {1000 * v:.1f} ms" for k, v in results[batch].items())
        print(f"B={batch}: {times}", file=sys.stderr)
    mach = machine_info()
    layers = f" ({args.layers} layers)" if args.layers else ""
    gpu = f", GPU {mach['gpu']}" if "gpu" in mach else ""
    given = argv if argv is not None else sys.argv[1:]
    print(
        "\n".join(
            [
                "# batched forward cost t(B, K)",
                "",
                f"- command: `{shlex.join(['python', 'benchmarks/batch_cost.py', *given])}`",
                f"- date: {now_iso()}",
                f"- machine: {mach.get('cpu')}, {torch.get_num_threads()} threads{gpu}; torch {mach.get('torch')}, "
                f"transformers {mach.get('transformers')}",
                f"- model: `{args.model}`{layers}; {str(model.dtype).replace('torch.', '')}"
                f"{' prepacked' if packed else ''}; "
                f"device {args.device}; each row has a cache of P = {args.prefix} tokens; median of {args.reps} runs",
                f"- cells: ms per forward (× the same B at K = {ks[0]}); last column: what batching plain decoding "
                "can give at most",
                "",
                table(results, ks),
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
