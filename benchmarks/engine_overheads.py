"""Engine overheads outside the model forward, before and after issue #6's changes, plus the cost of
keeping Gemma 3's sliding layers' full history.

    python benchmarks/engine_overheads.py [--model gemma-3-270m] [--skip-model]

Each row times the previous implementation (copied here verbatim) against the current one on the
same inputs, in one process:
- streaming detokenization of a 2,000-token answer (whole output decoded at every step, O(n^2),
  vs a short window per step);
- the draft model's cache catch-up (rescanning the context from position 0 every step vs comparing
  only the tokens committed since the last round);
- stochastic verification of a 5-token sampled chain over a 262,144-token vocabulary (four host
  syncs per tried child vs one);
- building the additive tree mask (16 nodes) after 500 and 2,000 cached positions;
- one Gemma 3 270M decode step at 512..4096 cached positions with speculum's cache (every layer
  keeps its full history, so rejected drafts can be rolled back) vs transformers' own cache (the
  sliding layers keep their 512-token window).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from speculum.api import IncrementalText  # noqa: E402
from speculum.runner import ModelRunner  # noqa: E402
from speculum.sampling import SamplingParams, sample, warp  # noqa: E402
from speculum.tree import Draft, TokenTree  # noqa: E402
from speculum.verify import verify  # noqa: E402


def best_of(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ------------------------------------------------------------------------------ previous versions


def old_stream(decode, steps):
    """api._stream before issue #6: the whole output decoded at every step."""
    ids, shown = [], ""
    for step in steps:
        ids.extend(step)
        text = decode(ids)
        if text.endswith("\ufffd"):
            continue
        shown = text
    return shown


def new_stream(decode, steps):
    ids, text = [], IncrementalText(decode)
    for step in steps:
        ids.extend(step)
        text.add(ids)
    return "".join(text.emitted)


def old_catch_up(seen, tokens):
    keep, limit = 0, min(len(seen), len(tokens) - 1)
    while keep < limit and seen[keep] == tokens[keep]:
        keep += 1
    return keep


def new_catch_up(seen, tokens, committed):
    keep, limit = committed, min(len(seen), len(tokens) - 1)
    while keep < limit and seen[keep] == tokens[keep]:
        keep += 1
    return keep


def old_verify_stochastic(tree, logits, sampling, generator):
    """verify._verify_sampled_stochastic before issue #6 (one q tensor per node)."""
    path = [0]
    while True:
        node = path[-1]
        p = warp(logits[node], sampling)[0]
        accepted = None
        for child in tree.children[node]:
            q = tree.q(child).to(p.device, torch.float32)
            x = tree.tokens[child]
            u = torch.rand((), generator=generator, device=p.device).item()
            if u * q[x].item() < p[x].item():
                accepted = child
                break
            residual = torch.clamp(p - q, min=0)
            total = residual.sum()
            if total.item() > 0:
                p = residual / total
        if accepted is None:
            return sample(p, generator)
        path.append(accepted)


def old_tree_mask(runner, tree, past, positions):
    n = len(tree)
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = tree.ancestor_mask
    full = runner._additive(allowed)
    key_positions = torch.cat([torch.arange(past), positions])
    in_window = positions[:, None] - key_positions[None, :] < 6
    return {"full_attention": full, "sliding_attention": runner._additive(allowed & in_window)}


# ------------------------------------------------------------------------------ measurements


def stream_rows(tokenizer) -> list[tuple[str, float, float]]:
    from speculum.bench.datasets import load_datasets

    text = "\n\n".join(p.render(False) for ps in load_datasets(["humaneval", "mt_bench"], 40).values() for p in ps)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:2000]
    sizes = [1, 3, 2, 5, 1, 1, 4]
    steps, i, k = [], 0, 0
    while i < len(ids):
        steps.append(ids[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1

    def decode(x):
        return tokenizer.decode(x, skip_special_tokens=True)

    rows = []
    for n in (500, 2000):
        part = []
        total = 0
        for s in steps:
            if total >= n:
                break
            part.append(s)
            total += len(s)
        rows.append(
            (
                f"stream {n} tokens ({len(part)} steps)",
                best_of(lambda p=part: old_stream(decode, p), 3),
                best_of(lambda p=part: new_stream(decode, p), 3),
            )
        )
    return rows


def catch_up_rows() -> list[tuple[str, float, float]]:
    tokens = list(range(2000))
    seen = tokens[:-3] + [7, 7]  # two rejected draft tokens at the end

    def old():
        for _ in range(100):
            old_catch_up(seen, tokens)

    def new():
        for _ in range(100):
            new_catch_up(seen, tokens, 1990)

    return [("draft cache catch-up at 2,000 tokens (x100)", best_of(old), best_of(new))]


def verify_rows() -> list[tuple[str, float, float]]:
    gen = torch.Generator().manual_seed(0)
    vocab = 262_144
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    logits = torch.randn(6, vocab, generator=gen) * 3
    q = warp(torch.randn(5, vocab, generator=gen) * 3, sampling)
    tokens = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(5)]
    tree = TokenTree.from_draft(1, Draft.chain(tokens, q))

    def old():
        for _ in range(20):
            old_verify_stochastic(tree, logits, sampling, gen)

    def new():
        for _ in range(20):
            verify(tree, logits, sampling, gen)

    return [("stochastic verify, 5-token chain, 262k vocab (x20)", best_of(old), best_of(new))]


def mask_rows() -> list[tuple[str, float, float]]:
    from tiny_models import tiny_model

    runner = ModelRunner(tiny_model("gemma3"))
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 10, 11]
    tree = TokenTree.from_draft(1, Draft([2 + i for i in range(16)], parents))
    rows = []
    for past in (500, 2000):
        positions = tree.position_ids(past)

        def old(p=past, pos=positions):
            for _ in range(100):
                old_tree_mask(runner, TokenTree(tree.tokens, tree.parents), p, pos)

        def new(p=past, pos=positions):
            for _ in range(100):
                runner._tree_mask(TokenTree(tree.tokens, tree.parents), p, pos)

        rows.append((f"tree mask, 16 nodes after {past} positions (x100)", best_of(old), best_of(new)))
    return rows


@torch.inference_mode()
def sliding_history_rows(model, model_name: str) -> list[tuple[str, float, float]]:
    """Median decode step with each cache, the two alternating step by step (this machine's speed
    drifts by tens of percent between runs: measured one after the other, they are not comparable)."""
    from transformers import DynamicCache

    rows = []
    step = torch.tensor([[42]])
    for context in (512, 1024, 2048, 4096):
        ids = torch.randint(10, 20000, (1, context), generator=torch.Generator().manual_seed(0))
        caches = [DynamicCache(), DynamicCache(config=model.config)]  # speculum's, transformers' own
        for cache in caches:
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        times: list[list[float]] = [[], []]
        for _ in range(15):  # each call adds one position: 15 barely move the context
            for cache, record in zip(caches, times, strict=True):
                t0 = time.perf_counter()
                model(input_ids=step, past_key_values=cache, use_cache=True)
                record.append(time.perf_counter() - t0)
        ours, theirs = (sorted(t)[len(t) // 2] for t in times)
        rows.append((f"{model_name} decode step at {context} positions", ours, theirs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--skip-model", action="store_true", help="only the model-free rows")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import speculum

    rows = catch_up_rows() + verify_rows() + mask_rows()
    spec = None if args.skip_model else speculum.load(args.model, dtype="float32")
    if spec is not None:
        rows = stream_rows(spec.tokenizer) + rows
    print("| what | before #6 | after #6 | after / before |")
    print("|---|---:|---:|---:|")
    for name, before, after in rows:
        print(f"| {name} | {before * 1e3:.2f} ms | {after * 1e3:.2f} ms | {after / before:.2f} |")
    if spec is not None:
        print()
        print("| decode step (median, alternating) | speculum's cache (full) | transformers' cache (window) | ratio |")
        print("|---|---:|---:|---:|")
        for name, ours, theirs in sliding_history_rows(spec.model, args.model):
            print(f"| {name} | {ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
